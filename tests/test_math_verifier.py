"""The strict binary math reward in verifiers/math.py."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import reasoning_gym

from cascade_rl.data.arithmetic import worked_solution
from cascade_rl.verifiers.math import extract_boxed, score_math

# --- extract_boxed ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{4}.", "4"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box is the answer
        ("\\boxed{a^{2^{x}}} tail", "a^{2^{x}}"),
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),  # escaped braces need not pair up
        ("the answer is 4", None),
        ("\\boxed 4", None),  # only \boxed{ counts
        ("\\boxed{1} and \\boxed{\\frac{1}{2}", None),  # last box never closed: truncated
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# --- score_math: equivalences ----------------------------------------------------------


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{-4}", "-4"),
        ("\\boxed{0.5}", "1/2"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{2x+1}", "1+2x"),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
        ("\\boxed{-4.0}", "-4"),
        ("The total is \\boxed{7}.", "7"),
    ],
)
def test_equivalent_answers_score_one(response, reference):
    assert score_math(response, reference) == 1.0


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{12}", "2"),  # no partial credit for containing the digit
        ("the answer is 4", "4"),  # right number, but not boxed
        ("\\boxed{5}", "4"),
        ("\\boxed{4.0001}", "4"),
        ("\\boxed{}", "4"),
        ("", "4"),
    ],
)
def test_wrong_or_unboxed_answers_score_zero(response, reference):
    assert score_math(response, reference) == 0.0


# --- score_math: which part of the response counts -------------------------------------


def test_only_text_after_last_think_close_counts():
    # A box inside the reasoning is a draft, not the answer.
    assert score_math("try \\boxed{4}\n</think>\n\nSo 5.", "4") == 0.0
    assert score_math("try \\boxed{5}\n</think>\n\n\\boxed{4}", "4") == 1.0
    assert score_math("<think>\n\\boxed{3}</think>a</think>\\boxed{4}", "4") == 1.0


def test_unclosed_think_means_no_answer():
    assert score_math("<think>\n7 + 5 = 12 so \\boxed{12}", "12") == 0.0


def test_worked_solutions_from_tasks_score_one():
    assert score_math(worked_solution(["7 + 5 = 12", "12 - 3 = 9"], "9"), "9") == 1.0


# --- reasoning-gym basic_arithmetic answers --------------------------------------------


@pytest.mark.parametrize("answer", ["-61", "-204", "-27", "-129", "-1043", "-764495", "-131073014"])
def test_basic_arithmetic_answers(answer):
    assert score_math(f"\\boxed{{{answer}}}", answer) == 1.0
    assert score_math(f"\\boxed{{{int(answer) + 1}}}", answer) == 0.0


def test_basic_arithmetic_dataset_answers_verify_against_themselves():
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=7)
    for item in ds:
        answer = str(item["answer"])
        assert score_math(f"reasoning\n</think>\n\n\\boxed{{{answer}}}", answer) == 1.0, item
        assert score_math(f"\\boxed{{{answer}0}}", answer) == 0.0, item


# --- robustness ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{\\frac{}{}}", "1"),
        ("\\boxed{)(}", "1"),
        ("\\boxed{1}", "\\frac{"),
        ("\\boxed{\\sqrt}", "}{"),
        ("\\boxed{x^{10^{10}}}", "1"),
    ],
)
def test_malformed_input_never_raises(response, reference):
    assert score_math(response, reference) in (0.0, 1.0)


def test_works_outside_the_main_thread():
    # math-verify's signal-based timeout would raise in a worker thread.
    cases = [("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{12}", "2")] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda c: score_math(*c), cases))
    assert scores == [1.0, 0.0] * 4


def test_verdicts_are_remembered_per_answer_and_reference():
    """A group's responses mostly box the same answers: the second time, math-verify is not run again."""
    from cascade_rl.verifiers.math import _equivalent

    before = _equivalent.cache_info()
    first = [score_math(f"</think>\n\n\\boxed{{{a}}}", "-7") for a in ("-7", "-7.0", "7", "-7")]
    again = [score_math(f"work\n</think>\n\\boxed{{{a}}}", "-7") for a in ("-7", "-7.0", "7")]
    assert first == [1.0, 1.0, 0.0, 1.0] and again == [1.0, 1.0, 0.0]
    after = _equivalent.cache_info()
    assert after.hits - before.hits >= 4 and after.misses - before.misses <= 3


def test_math_verifys_timeout_warning_goes_to_the_log_not_the_console(tmp_path):
    """Off the main thread score_math calls math-verify without its signal timeout, knowingly: the library's
    warning about it (once a process, so a fresh one) is kept in the log of a process whose console the supervisor
    keeps quiet (supervisor/console.py), and never reaches its stderr; the score is right."""
    log = tmp_path / "logs" / "supervisor.log"
    probe = f"""
import threading
from pathlib import Path
from cascade_rl.supervisor import console
from cascade_rl.verifiers.math import score_math
console.quiet(Path({str(log)!r}))
scores = []
t = threading.Thread(target=lambda: scores.append(score_math("so \\\\boxed{{42}}", "42")))
t.start(); t.join()
print(scores)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[1.0]", r.stdout + r.stderr
    assert r.stderr == "", r.stderr
    assert "math_verify.parser: Timeout is disabled" in log.read_text()

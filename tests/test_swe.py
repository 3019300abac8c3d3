"""The swe verifier (verifiers/swe.py: edit blocks, hidden tests in the sandbox, env_state) and the swe environment
(environments/swe.py: the repository tools, state carried between steps, test runs that hang, crash or exit early),
all in the real sandbox; and a sandbox that cannot start (not root) failing the group instead of scoring 0."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from cascade_rl.environments.base import EnvSettings
from cascade_rl.environments.registry import ENVIRONMENTS
from cascade_rl.environments.swe import SweEnvironment, summary
from cascade_rl.verifiers.registry import VERIFIERS, check_row
from cascade_rl.verifiers.sandbox import isolation_available
from cascade_rl.verifiers.swe import Edit, EditError, Verdict, apply_edits, evaluate, parse_edits

needs_sandbox = pytest.mark.skipif(not isolation_available(), reason="the sandbox needs root on Linux")
UID_BASE, SLOTS = 63100, 8  # the environment's own uid range: other sandboxes on the machine cannot interfere
TIMEOUT_S = 1.5
FILES = {"utils.py": "def double(x):\n    return x + 2\n\ndef inc(x):\n    return x + 1\n",
         "test_utils.py": "from utils import double, inc\n\ndef test_double():\n    assert double(4) == 8\n\n"
                          "def test_inc():\n    assert inc(1) == 2\n"}
TESTS = "from utils import double, inc\nassert double(4) == 8\nassert double(0) == 0\nassert inc(1) == 2\n"
META = {"files": {"utils.py": FILES["utils.py"]}, "tests": TESTS}
FIX = "utils.py\n<<<<<<< SEARCH\n    return x + 2\n=======\n    return x * 2\n>>>>>>> REPLACE"


def answer(text: str) -> str:
    return f"<think>\ndouble adds.\n</think>\n\n{text}"


# --- edit blocks -------------------------------------------------------------------------------------------


def test_edit_blocks_are_parsed_in_order_with_their_paths():
    text = ("First:\n\n`utils.py`\n```python\n<<<<<<< SEARCH\n    return x + 2\n=======\n    return x * 2\n"
            ">>>>>>> REPLACE\n```\nThen\n**pkg/mod.py**\r\n<<<<<<< SEARCH\r\na\nb\r\n=======\r\n>>>>>>> REPLACE\r\n")
    assert parse_edits(text) == [Edit("utils.py", "    return x + 2", "    return x * 2"),
                                 Edit("pkg/mod.py", "a\nb", "")]
    assert parse_edits("no edits here") == []
    with pytest.raises(EditError, match="not closed"):
        parse_edits(FIX.removesuffix(">>>>>>> REPLACE"))
    with pytest.raises(EditError, match="no file path"):
        parse_edits(FIX.removeprefix("utils.py\n"))


def test_edits_apply_in_order_and_name_what_cannot_be_applied():
    files = {"utils.py": FILES["utils.py"]}
    two = parse_edits(FIX + "\nutils.py\n<<<<<<< SEARCH\nx * 2\n=======\n2 * x\n>>>>>>> REPLACE")
    assert apply_edits(files, two)["utils.py"].startswith("def double(x):\n    return 2 * x\n")
    assert files == {"utils.py": FILES["utils.py"]}  # a new dict: the row's files are left alone
    for edit, words in [(Edit("utils.py", "    return", "x"), "occurs 2 times in utils.py"),
                        (Edit("utils.py", "return y", "x"), "does not occur in utils.py"),
                        (Edit("utils.py", "", "x"), "empty"),
                        (Edit("main.py", "x", "y"), "no file 'main.py' (files: utils.py)")]:
        with pytest.raises(EditError, match=re.escape(words)):
            apply_edits(files, [edit])


# --- the verifier ----------------------------------------------------------------------------------------


@needs_sandbox
def test_the_verifier_scores_the_fix_and_refuses_bad_answers_with_the_reason():
    assert evaluate(answer(FIX), META).reward == 1.0
    assert VERIFIERS["swe"](answer(FIX), "", META) == 1.0
    wrong = evaluate(answer(FIX.replace("x * 2", "x * 3")), META)
    assert wrong.reward == 0.0 and "hidden test line 2 (assert double(4) == 8): AssertionError" in wrong.reason
    for text, reason in [(FIX.replace("x + 2\n", "x + 3\n"), "edit 1: the search text does not occur in utils.py"),
                         ("I fixed it.", "no edit block ('<<<<<<< SEARCH' ... '>>>>>>> REPLACE') in the final answer"),
                         (FIX.replace("utils.py", "lib.py", 1), "edit 1: no file 'lib.py' (files: utils.py)")]:
        assert evaluate(answer(text), META) == Verdict(0.0, reason)
    unclosed = evaluate("<think>\n" + FIX, META)
    assert unclosed.reward == 0.0 and "never closed" in unclosed.reason


@needs_sandbox
def test_env_state_files_are_the_repository_of_a_multi_turn_row():
    fixed = {"utils.py": FILES["utils.py"].replace("x + 2", "x * 2")}
    assert evaluate(answer("Fixed double."), {**META, "env_state": {"files": fixed}}).reward == 1.0
    assert evaluate(answer("Fixed double."), {**META, "env_state": {"files": META["files"]}}).reward == 0.0
    # edits of the final answer apply on top of the environment's files
    assert evaluate(answer(FIX), {**META, "env_state": {"files": META["files"]}}).reward == 1.0
    assert evaluate(answer(FIX), {**META, "env_state": {"files": fixed}}).reason.endswith("does not occur in utils.py")
    # a state without files (another environment's): the row's files, and an edit is needed
    assert evaluate(answer("Fixed."), {**META, "env_state": {"cells": []}}).reason.startswith("no edit block")


@needs_sandbox
def test_modules_import_each_other_and_packages_from_memory():
    files = {"pkg/__init__.py": "", "pkg/ops.py": "from helpers import two\ndef double(x):\n    return x * two()\n",
             "helpers.py": "def two():\n    return 2\n", "ns/deep.py": "VALUE = 7\n"}
    tests = "from pkg.ops import double\nimport ns.deep\nassert double(4) == 8 and ns.deep.VALUE == 7\n"
    assert evaluate(answer("done"), {"files": files, "tests": tests, "env_state": {"files": files}}).reward == 1.0


@needs_sandbox
def test_early_exits_hangs_and_crashes_score_zero():
    def verdict(source: str, **limits):
        return evaluate(answer("done"), {**META, **limits, "env_state": {"files": {"utils.py": source}}})

    fixed = FILES["utils.py"].replace("x + 2", "x * 2")
    assert verdict(fixed).reward == 1.0
    assert verdict("import os\nos._exit(0)\n" + fixed) == Verdict(0.0, "exited before the tests finished")
    assert "SystemExit" in verdict("import sys\nsys.exit(0)\n" + fixed).reason
    assert verdict(fixed + "\nwhile True:\n    pass\n", timeout_s=1).reason == "timeout"
    assert verdict("def double(x)\n").reason.startswith("exit code 1")


BAD_ROWS = [
    ({"tests": TESTS}, ["metadata['files']", "path (a string) -> source"]),
    ({"files": {"utils.py": 3}, "tests": TESTS}, ["metadata['files']"]),
    ({"files": {}, "tests": TESTS}, ["non-empty"]),
    ({"files": META["files"]}, ["metadata['tests']", "non-empty string"]),
    ({"files": META["files"], "tests": "assert ("}, ["not valid Python"]),
    ({**META, "env_state": []}, ["env_state", "object"]),
    ({**META, "env_state": {"files": {"a.py": None}}}, ["metadata['env_state']['files']"]),
    ({**META, "timeout_s": 0}, ["timeout_s", "positive"]),
]


@pytest.mark.parametrize("metadata, words", BAD_ROWS)
def test_the_row_check_and_the_verifier_reject_malformed_metadata(metadata, words):
    reason = check_row("swe", "", metadata)
    assert reason and all(w in reason for w in words), reason
    with pytest.raises(ValueError):
        VERIFIERS["swe"](answer(FIX), "", metadata)


def test_good_rows_pass_the_row_check():
    assert check_row("swe", "", META) == ""
    assert check_row("swe", FIX, {**META, "env_state": {"files": META["files"]}, "timeout_s": 2}) == ""


# --- a sandbox that cannot start --------------------------------------------------------------------------

_NOT_ROOT = """
import json, sys
from cascade_rl.environments.base import EnvSettings, ToolUnavailable
from cascade_rl.environments.swe import SweEnvironment
from cascade_rl.verifiers.errors import VerifierUnavailable
from cascade_rl.verifiers.registry import VERIFIERS
meta = json.loads(sys.argv[1])
out = {}
try:
    VERIFIERS["swe"](sys.argv[2], "", meta)
except VerifierUnavailable as e:
    out["verifier"] = type(e).__name__
turn = {"role": "assistant", "content": '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'}
try:
    SweEnvironment(EnvSettings()).step([turn], {}, {"files": meta["files"]})
except ToolUnavailable as e:
    out["environment"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or not isolation_available(), reason="needs root and unshare")
def test_a_sandbox_that_cannot_start_raises_instead_of_scoring_zero():
    """In a user namespace the verifier is not root: the sandbox refuses to start, and the swe verifier lets
    SandboxUnavailable (a VerifierUnavailable: the group fails) through, as the environment raises ToolUnavailable."""
    meta = {**META, "files": FILES}
    r = subprocess.run(["unshare", "--user", sys.executable, "-c", _NOT_ROOT, json.dumps(meta), answer(FIX)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == {"verifier": "SandboxUnavailable", "environment": "ToolUnavailable"}


# --- the environment ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> SweEnvironment:
    state_dir = tmp_path_factory.mktemp("swe-sandbox-state")
    state_dir.chmod(0o700)
    return SweEnvironment(EnvSettings(tool_timeout_s=TIMEOUT_S, memory_mb=256, max_processes=16),
                          uid_base=UID_BASE, slots=SLOTS, state_dir=str(state_dir))


def turn(*calls: tuple[str, dict], prose: str = "") -> list[dict]:
    text = prose + "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
    return [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": f"<think>\n\n</think>\n\n{text}"}]


def observations(env, *calls, state=None, metadata=None) -> tuple[list[str], dict]:
    step = env.step(turn(*calls), {} if state is None else state, {"files": FILES} if metadata is None else metadata)
    return [m["content"] for m in step.tool_messages], step.state


def test_swe_is_a_registered_environment():
    assert ENVIRONMENTS["swe"] is SweEnvironment


def test_files_are_listed_read_and_edited_in_the_state_carried_between_steps(env):
    (listing, text), state = observations(env, ("list_files", {}), ("read_file", {"path": "utils.py"}))
    assert listing == "utils.py\ntest_utils.py" and text == FILES["utils.py"] and state == {"files": FILES}
    (edited,), after = observations(env, ("edit_file", {"path": "utils.py", "search": "x + 2", "replace": "x * 2"}),
                                    state=state)
    assert edited == "Edited utils.py." and state == {"files": FILES}  # the incoming state is not changed
    assert after["files"]["utils.py"] == FILES["utils.py"].replace("x + 2", "x * 2")
    (text,), again = observations(env, ("read_file", {"path": "utils.py"}), state=after, metadata={})
    assert text == after["files"]["utils.py"] and again == after  # later steps need no metadata: the state has all
    step = env.step(turn(prose="Fixed double."), after, {"files": FILES})
    assert step.done and step.state == after  # what the verifier gets as env_state


def test_bad_calls_are_error_observations(env):
    outs, state = observations(
        env, ("read_file", {"path": "main.py"}), ("read_file", {}), ("edit_file", {"path": "utils.py", "search": 1}),
        ("edit_file", {"path": "utils.py", "search": "    return", "replace": "    return 0 +"}))
    assert outs == ["error: read_file: no file 'main.py'; the files are utils.py, test_utils.py",
                    "error: read_file: missing argument 'path' (a string); got no arguments",
                    "error: edit_file: argument 'search' must be a string, got int",
                    "error: edit_file: the search text occurs 2 times in utils.py; make it occur once"]
    outs, _ = observations(env, ("edit_file", {"path": "utils.py", "search": "x * 9", "replace": "y"}),
                           ("edit_file", {"path": "utils.py", "search": "", "replace": "y"}), ("delete_file", {}))
    assert outs[0] == "error: edit_file: the search text does not occur in utils.py"
    assert outs[1] == "error: edit_file: the search text for utils.py is empty"
    assert outs[2].startswith("error: unknown tool 'delete_file'; tools on offer: edit_file, list_files, read_file")
    assert state == {"files": FILES}  # nothing was changed
    with pytest.raises(ValueError, match="metadata\\['files'\\]"):
        env.step(turn(("list_files", {})), {}, {})


@needs_sandbox
def test_run_tests_reports_passes_and_failures_with_the_value(env):
    (out,), _ = observations(env, ("run_tests", {}))
    assert out == "1 passed, 1 failed: test_double: assert double(4) == 8 (got 6)"
    outs, _ = observations(env, ("edit_file", {"path": "utils.py", "search": "x + 2", "replace": "x * 2"}),
                           ("run_tests", {}))
    assert outs == ["Edited utils.py.", "2 passed"]
    outs, _ = observations(env, ("edit_file", {"path": "utils.py", "search": "x + 2", "replace": "y"}),
                           ("run_tests", {}))
    assert outs[1] == "1 passed, 1 failed: test_double: NameError: name 'y' is not defined"
    (out,), _ = observations(env, ("run_tests", {}), metadata={"files": {"utils.py": FILES["utils.py"]}})
    assert out == "error: run_tests: no test files (test_*.py) in the repository"
    assert summary([["test_a", "passed", ""], ["x.py", "error", "SyntaxError: bad"]]) == \
        "1 passed, 1 error: x.py: SyntaxError: bad"


@needs_sandbox
@pytest.mark.parametrize("bad, words, kind", [
    ("while True:\n    pass\n", f"error: the tests timed out after {TIMEOUT_S:g}s", "timeout"),
    ("import os\nos._exit(3)\n", "error: the test run failed (exit code 3)", "error"),
    ("import os\nos._exit(0)\n", "error: the test run ended before it finished", "error"),
    ("print('x' * 3_000_000)\n", "error: the test run failed (output limit)", "error"),
    ("def broken(:\n", "1 error: test_utils.py: SyntaxError", ""),
    ("import sys\nsys.exit(0)\n", "1 error: test_utils.py: SystemExit: 0", ""),
])
def test_a_test_run_that_hangs_crashes_or_exits_early_is_an_observation(env, bad, words, kind):
    step = env.step(turn(("edit_file", {"path": "utils.py", "search": "def inc", "replace": bad + "def inc"}),
                         ("run_tests", {})), {}, {"files": FILES})
    out = step.tool_messages[1]["content"]
    assert out.startswith(words), out
    assert (step.tool_errors, step.timeouts) == ((kind != "") * 1, (kind == "timeout") * 1)
    assert len(out) < 400

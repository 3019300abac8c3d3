"""The ``swe`` environment: a small repository an agent reads, edits and tests (execution-based agentic SWE).

    env = build_environment("swe")
    step = env.step([{"role": "user", "content": "..."}, {"role": "assistant", "content": "<think>\\n\\n</think>\\n\\n"
                     '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'}], {}, row_metadata)
    step.tool_messages  # [{"role": "tool", "content": "1 passed, 1 failed: test_double: assert double(4) == 8 (got 6)"}]
    step.state          # {"files": {...}}: hand it to the next step

Tools (a ``ToolEnvironment``, environments/base.py):

| tool | arguments | answers |
| --- | --- | --- |
| list_files | {} | the paths, one a line |
| read_file | {"path"} | the file's text |
| edit_file | {"path", "search", "replace"} | "Edited PATH.": ``search`` must occur exactly once in the file, else an error says so |
| run_tests | {} | the repository's ``test_*.py`` run against the current files: "2 passed", "1 passed, 1 failed: test_double: assert double(4) == 8 (got 6)" |

**State.** The repository lives in ``state["files"]`` ({path: text}), taken from the row's ``metadata["files"]``
on the first step, so any worker serves any step. The episode's final state goes to the row's verifier as
``metadata["env_state"]`` (orchestrator/core.py): the ``swe`` verifier (verifiers/swe.py) runs its hidden tests on
those files.

**run_tests** is one sandbox run (``verifiers/sandbox.py``, under ``tool_timeout_s``, ``memory_mb`` and
``max_processes``): the files are importable modules served from memory (verifiers/swe.py ``repo_program``), each
test file is imported and its ``test*`` functions called in order; a failing ``assert a == b`` is shown with the
value of ``a``. A test run that hangs, crashes, exits early or floods its output is an error observation, never an
exception; only a sandbox that cannot start raises (``ToolUnavailable``).
"""

from __future__ import annotations

import ast
import secrets
from typing import Any

from cascade_rl.verifiers.sandbox import SandboxConfig, SandboxError, run_python
from cascade_rl.verifiers.swe import EditError, replace_once, repo_program

from .base import BadArguments, EnvSettings, StepResult, ToolEnvironment, ToolOutcome, ToolUnavailable, string_argument
from .registry import register_environment

MAX_OUTPUT_BYTES = 1 << 20  # a test run printing more is stopped
_SHOW = 80  # characters of a value or an exception message in a test's failure line

# After the loader: import each test file, call its test functions in order, print the results after the marker
# line (a repository module can print anything, but not the marker, which is new every run). No ast, json or
# traceback: importing them costs more than the tests.
_RUNNER = '''
def _short(text, n={show}):
    return text if len(text) <= n else text[:n] + "..."


def _failure(path, exc):
    """The failing assert's line, with the value of its left side for ``assert a == b`` (pytest-like), else the
    exception."""
    frame, lineno, tb = None, 0, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            frame, lineno = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    lines = _FILES[path].splitlines()
    line = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    if not isinstance(exc, AssertionError) or not line.startswith("assert "):
        return _short(f"{{type(exc).__name__}}: {{exc}}" if str(exc) else type(exc).__name__)
    if " == " in line:
        try:
            got = eval(line[len("assert "):].split(" == ", 1)[0], frame.f_globals, frame.f_locals)
            line += f" (got {{_short(repr(got))}})"
        except BaseException:
            pass
    return line


_results = []
for _path in {tests!r}:
    try:
        _module = importlib.import_module(_path[:-3].replace("/", "."))
    except BaseException as e:
        _results.append((_path, "error", _short(f"{{type(e).__name__}}: {{e}}")))
        continue
    _tests = [(k, f) for k, f in vars(_module).items() if k.startswith("test") and callable(f)
              and getattr(getattr(f, "__code__", None), "co_filename", None) == _path]
    for _name, _test in _tests:  # in the order they are defined
        try:
            _test()
            _results.append((_name, "passed", ""))
        except BaseException as e:
            _results.append((_name, "failed", _failure(_path, e)))
sys.stdout.flush()
print()
print({marker!r} + repr(_results))
'''


def summary(results: list[list[str]]) -> str:
    """"2 passed", "1 passed, 1 failed: test_double: assert double(4) == 8 (got 6)"; a file that cannot be imported
    is an error with its exception."""
    counts = {kind: sum(r[1] == kind for r in results) for kind in ("passed", "failed", "error")}
    head = ", ".join(f"{n} {kind}" + ("s" if kind == "error" and n > 1 else "") for kind, n in counts.items() if n)
    details = "; ".join(f"{name}: {why}" for name, kind, why in results if kind != "passed")
    return f"{head}: {details}" if details else head or "no tests ran"


class RepoTools:
    """The four tools over ``state["files"]`` (the module docstring)."""

    def __init__(self, settings: EnvSettings, **sandbox: Any) -> None:
        """``sandbox``: other ``SandboxConfig`` fields (tests give their own ``uid_base`` and ``state_dir``)."""
        self.settings = settings
        self.sandbox = SandboxConfig(timeout_s=settings.tool_timeout_s, memory_mb=settings.memory_mb,
                                     max_processes=settings.max_processes, max_output_bytes=MAX_OUTPUT_BYTES,
                                     **sandbox)

    @staticmethod
    def _file(arguments: dict[str, Any], files: dict[str, str]) -> str:
        path = string_argument(arguments, "path")
        if path not in files:
            raise BadArguments(f"no file {path!r}; the files are {', '.join(files)}")
        return path

    def list_files(self, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome("\n".join(state["files"]))

    def read_file(self, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(state["files"][self._file(arguments, state["files"])])

    def edit_file(self, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        files = state["files"]
        path = self._file(arguments, files)
        search, replace = string_argument(arguments, "search"), string_argument(arguments, "replace")
        try:
            files[path] = replace_once(files[path], search, replace, path)
        except EditError as e:
            return ToolOutcome(f"error: edit_file: {e}", "error")
        return ToolOutcome(f"Edited {path}.")

    def run_tests(self, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        files = state["files"]
        tests = [p for p in files if p.rsplit("/", 1)[-1].startswith("test_") and p.endswith(".py")]
        if not tests:
            return ToolOutcome("error: run_tests: no test files (test_*.py) in the repository", "error")
        marker = f"cascade-rl-tests-{secrets.token_hex(8)}:"
        program = repo_program(files, _RUNNER.format(show=_SHOW, tests=tests, marker=marker))
        try:
            r = run_python(program, "", self.sandbox)
        except SandboxError as e:  # SandboxUnavailable too: the sandbox, not the call, failed
            raise ToolUnavailable(f"the test sandbox failed: {e}") from e
        if r.reason in ("timeout", "cpu time limit"):
            return ToolOutcome(f"error: the tests timed out after {self.settings.tool_timeout_s:g}s", "timeout")
        report = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith(marker)), None)
        if r.ok and report is not None:
            return ToolOutcome(summary(ast.literal_eval(report[len(marker):])))
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
        why = "the test run ended before it finished" if r.ok else f"the test run failed ({r.reason})"
        return ToolOutcome(f"error: {why}" + (f": {last[:200]}" if last else ""), "error")


@register_environment("swe")
class SweEnvironment(ToolEnvironment):
    def __init__(self, settings: EnvSettings, **sandbox: Any) -> None:
        tools = RepoTools(settings, **sandbox)
        super().__init__(settings, {"list_files": tools.list_files, "read_file": tools.read_file,
                                    "edit_file": tools.edit_file, "run_tests": tools.run_tests})

    def step(self, messages: list[dict[str, Any]], state: dict[str, Any], metadata: dict[str, Any]) -> StepResult:
        if "files" not in state:  # the first step: the repository is the row's
            files = metadata.get("files")
            if not isinstance(files, dict) or not all(isinstance(p, str) and isinstance(s, str)
                                                      for p, s in files.items()):
                raise ValueError("an swe row needs metadata['files']: {path: text}")
            state = {**state, "files": dict(files)}
        return super().step(messages, state, metadata)

"""Strict binary SWE reward: apply the response's SEARCH/REPLACE edits to a repository's files, then run the hidden
tests against them in the sandbox; 1.0 iff every test passes (Nemotron-Cascade 2 §4.8, agentless and agentic).

    from cascade_rl.verifiers.swe import evaluate, score_swe
    files = {"utils.py": "def double(x):\\n    return x * 2 + 1\\n"}
    tests = "from utils import double\\nassert double(4) == 8\\n"
    patch = ("utils.py\\n<<<<<<< SEARCH\\n    return x * 2 + 1\\n=======\\n    return x * 2\\n"
             ">>>>>>> REPLACE")
    score_swe("<think>\\nadds 1\\n</think>\\n\\n" + patch, "", {"files": files, "tests": tests})  # 1.0
    evaluate("</think>\\n\\nno edit", {"files": files, "tests": tests})  # Verdict(0.0, "no edit block ...")

**Metadata** (domain ``swe``): ``files`` ({path: source}, the repository), ``tests`` (the hidden test program:
Python that imports the repository's modules and asserts; it fails by raising), optional ``timeout_s`` and
``memory_mb`` (as the code verifier's). A multi-turn row's metadata also holds ``env_state``, what its environment
(environments/swe.py) left: with ``env_state["files"]`` the edits start from those files (the agent's repository),
not from ``files``.

**Edits** are the aider/Agentless format, in the final answer (the text after the last ``</think>``; a
``<think>`` never closed is no answer, 0.0)::

    utils.py
    <<<<<<< SEARCH
        return x * 2 + 1
    =======
        return x * 2
    >>>>>>> REPLACE

The path is the last line before ``<<<<<<< SEARCH`` that is not a code fence (backticks and ``*`` around it
dropped). The SEARCH text must occur exactly once in that file (a substring, line ends included) and is replaced;
edits apply in order. An edit of a file the repository does not have, a SEARCH that occurs 0 or 2+ times, an
empty SEARCH, a block left open, or no edit block at all (without ``env_state``) scores 0.0 with the reason
(``evaluate``).

**Tests** run as one sandboxed program: the files become importable modules (a meta-path finder serves
``utils.py`` as ``utils``, ``pkg/mod.py`` as ``pkg.mod``, from memory; nothing is written), the hidden tests run
in a fresh namespace, then a random marker is printed that must end stdout, so a module that exits early
(``sys.exit``, ``os._exit`` at import) fails. A sandbox that cannot start raises ``SandboxError`` (a
``VerifierUnavailable``: the group fails, it is not scored 0). environments/swe.py runs a repository's visible
tests with the same finder (``repo_program``).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from .code import check_limits
from .sandbox import SandboxConfig, run_python
from .text import final_answer_text

_SEARCH, _DIVIDER, _REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"
_BLOCK = re.compile(r"^<{7} SEARCH[ \t]*\n(.*?)^={7}[ \t]*\n(.*?)^>{7} REPLACE[ \t]*$", re.M | re.S)
_FENCE = re.compile(r"^\s*```")
_SHOW = 200  # characters of a failure quoted in a reason

# The repository as importable modules, from ``_FILES`` (path -> source, defined before this runs).
_LOADER = '''
import importlib, importlib.machinery, sys


class _Repo:  # a meta-path finder and loader (no importlib.abc: its import costs more than the tests)
    def find_spec(self, name, path=None, target=None):
        base = name.replace(".", "/")
        for origin, package in ((base + ".py", False), (base + "/__init__.py", True)):
            if origin in _FILES:
                return importlib.machinery.ModuleSpec(name, self, origin=origin, is_package=package)
        if any(p.startswith(base + "/") for p in _FILES):  # a folder without __init__.py: an empty package
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        origin = module.__spec__.origin
        if origin in _FILES:
            module.__file__ = origin
            exec(compile(_FILES[origin], origin, "exec"), module.__dict__)


sys.meta_path.insert(0, _Repo())
'''

# The hidden tests after the loader: a failure names the test line that raised (for the reason, never the model).
_HIDDEN = '''
try:
    exec(compile(_TESTS, "<hidden tests>", "exec"), {"__name__": "__main__"})
except BaseException as e:
    line, tb = 0, e.__traceback__
    while tb is not None:
        line = tb.tb_lineno if tb.tb_frame.f_code.co_filename == "<hidden tests>" else line
        tb = tb.tb_next
    text = _TESTS.splitlines()[line - 1].strip() if 0 < line <= len(_TESTS.splitlines()) else ""
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    sys.stderr.write(f"hidden test line {line} ({text}): {why}\\n")
    sys.stderr.flush()
    import os
    os._exit(1)
'''


class EditError(ValueError):
    """An edit that cannot be applied (or parsed); the message says why."""


@dataclass(frozen=True)
class Edit:
    path: str
    search: str
    replace: str


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str
    """"" when every test passed; else why not (no answer, a bad edit, the failing test)."""


def _cut(text: str, n: int = _SHOW) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _path_before(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip() and not _FENCE.match(line):
            return line.strip().strip("`*").strip()
    return ""


def parse_edits(text: str) -> list[Edit]:
    """The SEARCH/REPLACE blocks of ``text`` in order; raises EditError for a block left open or without a path."""
    text = text.replace("\r\n", "\n")
    edits, start = [], 0
    for m in _BLOCK.finditer(text):
        path = _path_before(text[start:m.start()])
        if not path:
            raise EditError(f"edit {len(edits) + 1} has no file path on the line before {_SEARCH!r}")
        search, replace = (part[:-1] if part.endswith("\n") else part for part in m.groups())
        edits.append(Edit(path, search, replace))
        start = m.end()
    if text.count(_SEARCH) > len(edits):
        raise EditError(f"an edit block is not closed: {_SEARCH!r}, the old lines, {_DIVIDER!r}, the new lines, "
                        f"{_REPLACE!r}")
    return edits


def replace_once(source: str, search: str, replace: str, path: str) -> str:
    """``source`` with the one occurrence of ``search`` replaced; EditError when it occurs 0 or 2+ times."""
    if not search:
        raise EditError(f"the search text for {path} is empty")
    count = source.count(search)
    if count != 1:
        where = "does not occur" if count == 0 else f"occurs {count} times"
        raise EditError(f"the search text {where} in {path}" + ("" if count == 0 else "; make it occur once"))
    return source.replace(search, replace)


def apply_edits(files: dict[str, str], edits: list[Edit]) -> dict[str, str]:
    """The files after ``edits``, in order (a new dict); EditError names the first that cannot be applied."""
    out = dict(files)
    for i, e in enumerate(edits, 1):
        if e.path not in out:
            raise EditError(f"edit {i}: no file {e.path!r} (files: {', '.join(out)})")
        try:
            out[e.path] = replace_once(out[e.path], e.search, e.replace, e.path)
        except EditError as err:
            raise EditError(f"edit {i}: {err}") from None
    return out


def repo_program(files: dict[str, str], body: str) -> str:
    """A program that makes ``files`` importable (from memory), then runs ``body`` (which may use ``sys``)."""
    return f"_FILES = {files!r}\n{_LOADER}\n{body}"


def run_hidden_tests(files: dict[str, str], tests: str, timeout_s: float, memory_mb: int) -> Verdict:
    """Run the hidden ``tests`` against ``files`` in the sandbox: 1.0 iff they finish and print the marker."""
    marker = f"cascade-rl-swe-passed-{secrets.token_hex(16)}"
    body = f"_TESTS = {tests!r}\n{_HIDDEN}\nprint({marker!r})\n"
    r = run_python(repo_program(files, body), "", SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb))
    if not r.ok:
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
        return Verdict(0.0, f"{r.reason}: {_cut(last)}" if last else r.reason)
    if r.stdout.rstrip("\n").rsplit("\n", 1)[-1] != marker:
        return Verdict(0.0, "exited before the tests finished")
    return Verdict(1.0, "")


def _check_files(files: Any, where: str) -> dict[str, str]:
    if not isinstance(files, dict) or not files or not all(
            isinstance(p, str) and p.strip() and isinstance(s, str) for p, s in files.items()):
        raise ValueError(f"{where} must be a non-empty object of path (a string) -> source (a string)")
    return files


def check_metadata(metadata: dict[str, Any]) -> tuple[float, int]:
    """``(timeout_s, memory_mb)``; raises ValueError when the metadata is malformed (the row check of domain
    ``swe`` and the verifier both call this)."""
    limits = check_limits(metadata)
    _check_files(metadata.get("files"), "metadata['files']")
    tests = metadata.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError("metadata['tests'] must be a non-empty string: the hidden test program")
    try:
        compile(tests, "<hidden tests>", "exec")  # parsed only: a broken test program fails every patch
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"metadata['tests'] is not valid Python: {e}") from None
    state = metadata.get("env_state")
    if state is not None:
        if not isinstance(state, dict):
            raise ValueError(f"metadata['env_state'] must be an object, got {type(state).__name__}")
        if "files" in state:
            _check_files(state["files"], "metadata['env_state']['files']")
    return limits


def evaluate(response: str, metadata: dict[str, Any]) -> Verdict:
    """The reward of ``response`` and why (see the module docstring); ValueError for malformed metadata."""
    timeout_s, memory_mb = check_metadata(metadata)
    text = final_answer_text(response)
    if text is None:
        return Verdict(0.0, "no final answer: the <think> was never closed")
    state = metadata.get("env_state") or {}
    files = state.get("files", metadata["files"])
    try:
        edits = parse_edits(text)
        if not edits and "files" not in state:
            return Verdict(0.0, f"no edit block ({_SEARCH!r} ... {_REPLACE!r}) in the final answer")
        files = apply_edits(files, edits)
    except EditError as e:
        return Verdict(0.0, str(e))
    return run_hidden_tests(files, metadata["tests"], timeout_s, memory_mb)


def score_swe(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """The verifier of domain ``swe``: 1.0 iff the patched repository passes every hidden test (``reference`` is
    unused). Malformed metadata raises ValueError, a broken sandbox SandboxError (neither is a 0)."""
    return evaluate(response, metadata).reward

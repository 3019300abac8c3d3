"""The ``python`` tool: a notebook-like Python executor per trajectory, each call run in the code sandbox.

    tool = PythonTool(EnvSettings())
    state = {}
    tool({"code": "x = 41"}, state)        # -> ToolOutcome("(no output)"); state == {"cells": ["x = 41"]}
    tool({"code": "print(x + 1)"}, state)  # -> ToolOutcome("42\\n")

**State by replay.** No interpreter outlives a call: ``state["cells"]`` holds the code of the trajectory's
earlier calls that ran without error, and a call runs them again, then the new cell, in one sandbox run
(``cascade_rl.verifiers.sandbox.run_python``: no network, no host files, rlimits, wall-clock kill). So any
environment worker can serve any step, and a worker killed mid-step loses nothing. The earlier cells' output
is discarded; the new cell's stdout and stderr (one stream, in order) are the observation, with, like a
notebook, the ``repr`` of a final bare expression that is not None. A new cell that raises gives its output
and the last lines of its traceback, and is not kept (it will not be replayed). What it costs: a call runs
every earlier cell again, so a trajectory's n-th call costs the sum of its cells, all within one
``tool_timeout_s``; a cell whose effect is not deterministic (random numbers, the clock) may differ on replay.

**Failures** are error observations, never exceptions: the wall-clock limit (``tool_timeout_s``, error_kind
"timeout"), a crash (a signal, ``os._exit``, the memory limit), too much output (``MAX_OUTPUT_BYTES``), a fork
bomb (``max_processes``: fork fails, or the loop runs into the timeout; the sandbox's pid namespace kills every
process left). Only a sandbox that cannot start raises (``ToolUnavailable``): not the model's fault.

The program sees the standard library only (the sandbox runs ``python -I -S``) and no stdin.
"""

from __future__ import annotations

import json
import signal
from typing import Any

from cascade_rl.verifiers.sandbox import RunResult, SandboxConfig, SandboxError, run_python

from .base import EnvSettings, ToolOutcome, ToolUnavailable, string_argument

MAX_OUTPUT_BYTES = 1 << 20  # a cell printing more is stopped (what is shown is cut to max_output_chars anyway)
TRACEBACK_LINES = 12  # the end of a failing cell's traceback that is shown
CELL_FAILED, REPLAY_FAILED = 17, 18  # the driver's exit codes
_DONE = "\x1ecascade-rl: cell done\n"  # the driver's last words on stderr: the cell ran to its end

# The program run in the sandbox; the cells come on stdin as JSON ({"cells": [...], "code": ...}).
_DRIVER = f"""
import ast, io, json, linecache, os, sys, traceback
_p = json.loads(sys.stdin.read())
sys.stdin = io.StringIO()
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
_out, _err = sys.stdout, sys.stderr

def _compile(src, i, tree=None, mode="exec"):
    name = f"<cell {{i}}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    return compile(src if tree is None else tree, name, mode)

sys.stdout = sys.stderr = io.StringIO()  # the earlier cells' output is discarded
_i = 0
try:
    for _i, _c in enumerate(_p["cells"], 1):
        exec(_compile(_c, _i), _g)
except BaseException as _e:
    _err.write(f"cell {{_i}}: {{type(_e).__name__}}: {{_e}}\\n")
    _err.flush()
    os._exit({REPLAY_FAILED})
sys.stdout, sys.stderr = _out, _out  # the new cell's stdout and stderr: one stream, in order
_n, _src = len(_p["cells"]) + 1, _p["code"]
try:
    _tree = ast.parse(_src, f"<cell {{_n}}>")
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
    exec(_compile(_src, _n, _tree), _g)
    if _last is not None:
        _v = eval(_compile(_src, _n, ast.Expression(_last.value), "eval"), _g)
        if _v is not None:
            print(repr(_v))
except BaseException as _e:
    _tb = _e.__traceback__
    while _tb is not None and not _tb.tb_frame.f_code.co_filename.startswith("<cell"):
        _tb = _tb.tb_next  # the driver's own frames are not the model's business
    sys.stdout.flush()
    _err.write("".join(traceback.format_exception(type(_e), _e, _tb)))
    _err.flush()
    os._exit({CELL_FAILED})
sys.stdout.flush()
_err.write({_DONE!r})
_err.flush()
"""


def _tail(text: str, lines: int = TRACEBACK_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _signal_name(num: int) -> str:
    try:
        return f"signal {num} ({signal.Signals(num).name})"
    except ValueError:
        return f"signal {num}"


class PythonTool:
    """``tool({"code": str}, state) -> ToolOutcome``; see the module docstring."""

    def __init__(self, settings: EnvSettings, **sandbox: Any) -> None:
        """``sandbox``: other ``SandboxConfig`` fields (tests give their own ``uid_base`` and ``state_dir``)."""
        self.settings = settings
        self.sandbox = SandboxConfig(timeout_s=settings.tool_timeout_s, memory_mb=settings.memory_mb,
                                     max_processes=settings.max_processes, max_output_bytes=MAX_OUTPUT_BYTES,
                                     **sandbox)

    def __call__(self, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        code = string_argument(arguments, "code")
        cells = state.get("cells", [])
        if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
            raise ToolUnavailable("state['cells'] is not a list of strings: the trajectory's state is corrupt")
        try:
            result = run_python(_DRIVER, stdin=json.dumps({"cells": cells, "code": code}), config=self.sandbox)
        except SandboxError as e:  # SandboxUnavailable too: the sandbox, not the call, failed
            raise ToolUnavailable(f"the python sandbox failed: {e}") from e
        outcome = self.outcome(result)
        if not outcome.error_kind:
            state["cells"] = [*cells, code]
        return outcome

    def outcome(self, r: RunResult) -> ToolOutcome:
        """The observation of one sandbox run of the driver."""
        out, err = r.stdout, r.stderr
        if r.exit_code == 0 and err.endswith(_DONE):
            return ToolOutcome(out or "(no output)")
        if r.reason in ("timeout", "cpu time limit"):
            return ToolOutcome(f"{out}error: timed out after {self.settings.tool_timeout_s:g}s (the cell was killed)",
                               "timeout")
        if r.exit_code == CELL_FAILED:
            return ToolOutcome(f"{out}{_tail(err)}", "error")
        if r.exit_code == REPLAY_FAILED:
            return ToolOutcome(f"error: the earlier cells did not run again as before ({_tail(err, 1)}); "
                               "this cell was not run", "error")
        if r.reason == "output limit":
            return ToolOutcome(f"{out}\nerror: the cell printed more than {MAX_OUTPUT_BYTES} bytes and was stopped",
                               "error")
        if r.reason == "memory":
            why = f"out of memory (the limit is {self.settings.memory_mb} MB)"
        elif r.signal is not None:
            why = f"the cell crashed: killed by {_signal_name(r.signal)}"
        elif r.exit_code == 0:
            why = "the cell ended the interpreter (exit code 0) before it finished"
        else:
            why = f"the cell ended the interpreter with exit code {r.exit_code}"
        err = err.replace(_DONE, "")
        return ToolOutcome(f"{out}error: {why}" + (f"\n{_tail(err)}" if err.strip() else ""), "error")

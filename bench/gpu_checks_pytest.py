"""A pytest plugin that writes each test's outcome the moment it is known, so a killed run keeps them.

    GPU_CHECKS_TESTS_JSONL=out.jsonl PYTHONPATH=bench python -m pytest -p gpu_checks_pytest tests/...

bench/gpu_checks.sh runs its tests part under `timeout`; pytest writes its JUnit XML only at the end, so a
part stopped at its cap used to lose every figure. Here each line of the JSONL file is flushed as it is
written:

    {"event": "start", "test": NODEID}                     before a test's setup (a SIGKILL leaves the name)
    {"event": "result", "test": NODEID, "outcome": "passed" | "failed" | "skipped" | "error",
     "seconds": setup + call + teardown, "message": first lines of the failure or the skip reason}
    {"event": "interrupted", "test": NODEID | null, "signal": "SIGTERM" | null}

SIGTERM (what `timeout` sends first) becomes a KeyboardInterrupt, so pytest still ends its session: the test
in progress is named, and the JUnit XML and the short summary are written before the kill grace runs out.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

_state = {"file": None, "current": None, "seconds": {}, "outcome": {}, "message": {}, "signal": None}


def _write(record: dict) -> None:
    f = _state["file"]
    if f is not None:
        f.write(json.dumps(record) + "\n")
        f.flush()  # a kill after this line keeps it


def _on_sigterm(signum, _frame) -> None:
    _state["signal"] = signal.Signals(signum).name
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process for real
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("GPU_CHECKS_TESTS_JSONL")
    if path and _state["file"] is None:
        _state["file"] = open(path, "a", buffering=1)
        signal.signal(signal.SIGTERM, _on_sigterm)


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _state["current"] = nodeid
    _write({"event": "start", "test": nodeid, "t": round(time.time(), 3)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid
    _state["seconds"][nodeid] = _state["seconds"].get(nodeid, 0.0) + report.duration
    outcome = _state["outcome"].get(nodeid, "passed")
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        _state["message"][nodeid] = "\n".join(str(report.longrepr).splitlines()[-15:])
    elif report.skipped and outcome == "passed":
        outcome = "skipped"
        longrepr = report.longrepr
        _state["message"][nodeid] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    _state["outcome"][nodeid] = outcome


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    record = {"event": "result", "test": nodeid, "outcome": _state["outcome"].pop(nodeid, "passed"),
              "seconds": round(_state["seconds"].pop(nodeid, 0.0), 3)}
    if nodeid in _state["message"]:
        record["message"] = _state["message"].pop(nodeid)[:2000]
    _write(record)
    _state["current"] = None


def pytest_keyboard_interrupt(excinfo) -> None:
    _write({"event": "interrupted", "test": _state["current"], "signal": _state["signal"]})


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state["file"] is not None:
        _state["file"].close()
        _state["file"] = None

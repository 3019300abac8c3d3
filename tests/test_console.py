"""The console of a launch or a cascade (supervisor/console.py): the user's business on the terminal, every
dependency's output in the log. The real launches' consoles are checked in test_launch.py and test_cascade.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import math_verify

from cascade_rl.supervisor import console


def record(path: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("x", level, path, 1, "msg", None, None)


def test_records_of_the_project_and_the_users_code_are_the_users_business_a_dependencys_are_not():
    business = console.UsersBusiness()
    assert business.filter(record(console.__file__))  # the project's own warning
    assert business.filter(record("/home/someone/my_reward.py"))  # a user's reward module
    assert not business.filter(record(math_verify.__file__))  # site-packages
    assert not business.filter(record(warnings.__file__))  # the standard library: Python's warnings, logged
    assert not business.filter(record(console.__file__, logging.INFO))  # INFO: the log's
    logged = console.Logged()
    assert logged.filter(record(console.__file__, logging.INFO)) and logged.filter(record(math_verify.__file__))
    assert not logged.filter(record(math_verify.__file__, logging.INFO))  # httpx's line per judge call


def test_quiet_sends_every_dependency_line_to_the_log_and_the_users_business_to_the_terminal(tmp_path):
    log = tmp_path / "logs" / "supervisor.log"
    probe = f"""
import logging, os, sys, warnings
from pathlib import Path
from cascade_rl.supervisor import console
console.quiet(Path({str(log)!r}))
warnings.warn("a library's FutureWarning", FutureWarning)
logging.getLogger("math_verify.parser").handlers.append(logging.StreamHandler(sys.stderr))  # a library's own handler
logging.getLogger("math_verify.parser").propagate = False
import math_verify.parser
math_verify.parser.logger.warning("Timeout is disabled (a library's logging)")
print("a library's print to stderr", file=sys.stderr, flush=True)
os.write(2, b"C++ code writing to fd 2\\n")
logging.getLogger("user").warning("the user's warning")
print("cascade-rl: an error the user reads", file=console.err())
print("step 1/3 | progress")
raise RuntimeError("the supervisor crashed")
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stdout == "step 1/3 | progress\n"
    lines = r.stderr.splitlines()
    assert lines[:2] == ["WARNING user: the user's warning", "cascade-rl: an error the user reads"], r.stderr
    assert lines[-1] == "RuntimeError: the supervisor crashed" and "library" not in r.stderr, r.stderr
    text = Path(log).read_text()
    for line in ("py.warnings", "FutureWarning: a library's FutureWarning", "Timeout is disabled (a library's logging)",
                 "a library's print to stderr", "C++ code writing to fd 2", "user: the user's warning",
                 "RuntimeError: the supervisor crashed"):
        assert line in text, (line, text)

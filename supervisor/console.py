"""What the console of a launch or a cascade shows, and where the rest of the supervisor's process goes.

    console.quiet(run_dir / "logs" / "supervisor.log")   # cli.py, before the run's data is prepared
    print(message, file=console.err())                   # an error the user must read: to the terminal

The console (``cascade-rl launch``, ``cascade-rl cascade``, so ``make run``) shows what the supervisor prints to
stdout itself (the progress lines, notices of stalls, restarts and lost work, a failure, the summary's and the
report's paths), the errors it writes to ``err()`` (a config or data refusal, its own traceback if it crashes) and
the WARNING and ERROR records logged by code that is no dependency: the project's own (an agent's or environment's
error met while evaluating, a checkpoint it cannot read, a tracker it cannot reach) and the user's modules (a reward,
agent or data module outside the interpreter's library folders). Those are the user's business.

Everything else goes to the log: the process's stderr (file descriptor 2) is the log file, so whatever a dependency
writes there, by ``logging`` and its own handlers (transformers', mlflow's), Python ``warnings`` (torch's,
transformers', triton's FutureWarnings and UserWarnings), a tqdm bar or C++ code, lands in the log and not on the
terminal; so does math-verify's "Timeout is disabled ..." warning about the evaluations' untimed parses (we run
them off the main thread knowingly). The log holds the project's records from INFO up, the dependencies' from
WARNING up (``Logged``). Library output to stdout is not caught (none is printed by the supervisor's process
today).

Workers never print to the console: each process's stdout and stderr are its own log file,
``<run_dir>/logs/<worker-id>.log`` (supervisor/launchers/), where every dependency's line stays.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import TextIO

# the project's code: this folder's parent (the checkout, in an editable install; site-packages/cascade_rl otherwise)
_PROJECT = str(Path(__file__).resolve().parent.parent)
# where the interpreter keeps the dependencies and the standard library (Python's warnings are logged from there)
_LIBRARIES = sorted({str(Path(sysconfig.get_paths()[k]).resolve())
                     for k in ("purelib", "platlib", "stdlib", "platstdlib")})
_FORMAT = "%(asctime)s supervisor %(levelname)s %(name)s: %(message)s"

_terminal: TextIO | None = None  # the console's stderr, once quiet() has made file descriptor 2 the log


def err() -> TextIO:
    """Where an error the user must read goes: the console's stderr (``sys.stderr`` is the log after ``quiet``)."""
    return _terminal or sys.stderr


def from_dependency(path: str) -> bool:
    """Whether code at ``path`` belongs to a dependency: the longest of the project's and the libraries' folders
    that holds it is a library's (an editable checkout holds its own .venv; site-packages holds an installed copy
    of the project)."""
    owner = max((p for p in (_PROJECT, *_LIBRARIES) if path.startswith(p + os.sep)), key=len, default="")
    return owner in _LIBRARIES


class UsersBusiness(logging.Filter):
    """Passes the records a user acts on: WARNING and above, logged by code that is no dependency."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not from_dependency(os.path.realpath(record.pathname))


class Logged(logging.Filter):
    """Passes what the log keeps: every record of the project's and the user's code, a dependency's from WARNING
    up (httpx logs every judge call at INFO: thousands of lines a cascade, none of them news)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not from_dependency(os.path.realpath(record.pathname))


def quiet(log: Path, inline: bool = False, fmt: str = _FORMAT) -> None:
    """Make ``log`` this process's stderr and its logging's file (``Logged``'s records, every Python warning);
    on the console ``err()`` and the ``UsersBusiness`` records. ``inline`` (--inline: the roles are threads of this
    process, logging to logs/inline.log): as a worker's log, every record, none on the console. Called again, it
    moves the log; the console stays the terminal's."""
    global _terminal
    log.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log)  # appends: a resumed run keeps its earlier lines
    to_file.setFormatter(logging.Formatter(fmt))
    if not inline:
        to_file.addFilter(Logged())
    sys.stdout.flush()
    sys.stderr.flush()
    if _terminal is None:
        _terminal = os.fdopen(os.dup(2), "w", buffering=1, errors="replace")
    os.dup2(to_file.stream.fileno(), 2)  # fd 2 outlives the handler's own descriptor (closed by a later call)
    handlers: list[logging.Handler] = [to_file]
    if not inline:
        to_console = logging.StreamHandler(_terminal)
        to_console.addFilter(UsersBusiness())
        to_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handlers.append(to_console)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)  # force: closes the handlers set before
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger: a time in the log
    sys.excepthook = _crash


def _crash(kind, value, tb) -> None:
    """The supervisor's own traceback (it crashed): on the console, and in the log."""
    traceback.print_exception(kind, value, tb, file=err())
    sys.__excepthook__(kind, value, tb)


def no_progress_bars() -> None:
    """No tqdm bar of transformers (loading and writing a model) or huggingface_hub on stderr, in this process only:
    the commands that build models with no run dir to log to (``sft``, ``make-tiny-model``) print their own progress."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()

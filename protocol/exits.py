"""Exit codes a process uses to tell the supervisor why it stopped, where the reason decides what happens next.

The supervisor (supervisor/procs.py ``ROLES``) reads a trainer's or orchestrator's exit code: 0 is a finished run,
``FAILED`` (1, what Python exits with on an uncaught exception) a failure that a restart would repeat (bad data, no
group survives the refills), ``DISK_FULL`` a write that found no room: both stop the run with the reason. Any
other end (a signal: SIGKILL, the OOM killer, a segfault) is a fault the supervisor recovers from by itself.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FAILED = 1
DISK_FULL = 28  # the value of ENOSPC: the run's disk (run_dir) had no room for a checkpoint or a ledger line

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NO_ROOM_TEXT = tuple(os.strerror(code) for code in _NO_ROOM)  # what libraries that drop the errno still say
_LOW_FREE_BYTES = 1 << 20  # under this, a failed write is taken for a full disk (torch.save reports no errno)


def disk_full(exc: BaseException, path: Path | str | None = None) -> bool:
    """Whether ``exc`` (or what caused it) is a write that found no room: an ``OSError`` with ENOSPC or EDQUOT, an
    error whose text quotes theirs (safetensors' ``SafetensorError: ... No space left on device (os error 28)``),
    or any error of a write to ``path`` while its filesystem has under 1 MiB free (torch.save's ``RuntimeError``s,
    ``file write failed`` or ``basic_ios::clear: iostream error``, carry no errno)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM or any(t in str(exc) for t in _NO_ROOM_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return path is not None and _free_bytes(path) < _LOW_FREE_BYTES


def _free_bytes(path: Path | str) -> int:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free

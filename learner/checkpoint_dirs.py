"""Where checkpoints live and which one a run resumes from: names and directory scans, no torch.

The orchestrator (the data cursor it resumes) and the supervisor (a cascade's stage finals) read these without
importing torch and transformers (~4 s of CPU in every process that does); ``checkpoint.py`` writes and loads
what they find (its docstring has the layout and the atomicity rules).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger("checkpoint")
STATE_FILE, STATE_JSON = "trainer_state.pt", "trainer_state.json"
STEP_DIR = re.compile(r"step_(\d+)")
LEFTOVER = re.compile(r"\.step_\d+\.(?:tmp|old)-(\d+)")  # a crashed save's temp/old directory, by its writer's pid


def step_dir(checkpoints_dir: Path, step: int) -> Path:
    return Path(checkpoints_dir) / f"step_{step:06d}"


def resolve(resume_from: str, run_dir: Path) -> Path | None:
    """``run.resume_from`` as a checkpoint directory: "" -> None, "latest" -> the newest complete one
    under run_dir/checkpoints, else the path itself; FileNotFoundError if that is not a complete checkpoint."""
    if not resume_from:
        return None
    path = latest(Path(run_dir) / "checkpoints") if resume_from == "latest" else Path(resume_from)
    if path is None or not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"run.resume_from={resume_from}: no complete checkpoint there")
    return path


def latest(checkpoints_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoints_dir`` (None if there is none). Read-only."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in checkpoints_dir.iterdir()
        if (m := STEP_DIR.fullmatch(p.name)) and (p / STATE_FILE).is_file()
    ]
    return max(found)[1] if found else None


def prune(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (0: keep every one); returns what it removed. A run
    of days that saves often to bound what a restart loses would otherwise fill its disk."""
    checkpoints_dir = Path(checkpoints_dir)
    if not keep or not checkpoints_dir.is_dir():
        return []
    complete = sorted((int(m.group(1)), p) for p in checkpoints_dir.iterdir()
                      if (m := STEP_DIR.fullmatch(p.name)) and (p / STATE_FILE).is_file())
    gone = [p for _, p in complete[:-keep]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def clean(checkpoints_dir: Path) -> None:
    """Remove temp/old directories of crashed saves. One whose writer is still alive (another
    process in the middle of a save) is left alone."""
    for p in Path(checkpoints_dir).iterdir():
        m = LEFTOVER.fullmatch(p.name)
        if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
            log.info("removing %s (left by an interrupted save)", p)
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""Append-only JSONL records two processes agree on: the orchestrator's ``ledger.jsonl`` and the trainer's
``trained_ids.jsonl`` (docs/ARCHITECTURE.md §6). Each line is one JSON object with a ``step``.

A run resumed from the checkpoint of step s redoes every step from s on, so each writer first keeps only the
lines of the steps before s (``keep_steps_before``): the files then describe the history of the weights the
run goes on from, and the orchestrator compares them at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEDGER_FILE = "ledger.jsonl"  # the orchestrator's: one line per terminal event of a training rollout
TRAINED_IDS_FILE = "trained_ids.jsonl"  # the trainer's: {"step", "ids"}, the rollout ids of each step it trained


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of ``path`` (none if it does not exist); a torn last line (a writer killed mid-line) is
    skipped."""
    if not path.is_file():
        return
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def keep_steps_before(path: Path, step: int) -> int:
    """Rewrite ``path`` with only its records of steps before ``step`` (atomically); returns how many stay."""
    kept = [r for r in read(path) if r.get("step", step) < step]
    if not path.exists() and not kept:
        return 0
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return len(kept)


class Appender:
    """Append records to ``path``, each line written through at once (a killed writer loses nothing it wrote)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = path.is_file() and path.stat().st_size and not _ends_with_newline(path)
        self._f = open(path, "a", buffering=1)
        if torn:  # a writer killed mid-line (or a full disk): end that line, so the next one is whole
            self._f.write("\n")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"

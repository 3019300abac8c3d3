"""Receiving side of weight transports: resolve a ``WeightsReady`` to a verified local file.

The publishing side lives with the trainer (learner/weights.py). ``shm``
notices carry a ``file://`` URI of a safetensors file in /dev/shm (or any
shared path) and its blake2b checksum; a file that changed or vanished is
refused with a reason rather than loaded half-written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .messages import WeightsReady


def shm_dir(run_id: str, root: str = "/dev/shm") -> Path:
    """Where the shm transport of run ``run_id`` keeps its files (also cleaned by the supervisor)."""
    base = Path(root) if Path(root).is_dir() else Path("/tmp")
    return base / f"cascade-rl-{run_id}"


class WeightsError(RuntimeError):
    """A weights notice that cannot be honoured (missing file, bad checksum, unknown format)."""


def file_checksum(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def resolve(notice: WeightsReady) -> str:
    """Local path of the weights announced by ``notice``, after checking size and checksum."""
    if notice.format != "safetensors":
        raise WeightsError(f"weights format {notice.format!r} not supported")
    if not notice.uri.startswith("file://"):
        raise WeightsError(f"weights uri {notice.uri!r}: only file:// (shm transport) is resolvable here")
    path = Path(notice.uri[len("file://") :])
    if not path.is_file():
        raise WeightsError(f"weights file {path} is gone (version {notice.version})")
    if notice.nbytes and path.stat().st_size != notice.nbytes:
        raise WeightsError(f"weights file {path} has {path.stat().st_size} bytes, notice says {notice.nbytes}")
    if notice.checksum and file_checksum(path) != notice.checksum:
        raise WeightsError(f"weights file {path} fails its checksum")
    return str(path)

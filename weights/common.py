"""What every weight transport shares, light enough for the supervisor to import (no torch): the run's weights
folder, the errors a notice that cannot be honoured raises, and the weights checksum.

Checksum (the ``shm`` and ``stream`` transports, both sides): XXH3-128 (xxhash), as hex, over the bytes of the
safetensors file in order -- what ``file_checksum`` of the file gives. The stream sends exactly the file's bytes,
so the receiver hashes the chunks as they arrive and never re-reads what it wrote. (A notice without a checksum
is checked against the one in the publisher's replies.) ``cuda_ipc`` checksums its sidecar instead (cuda_ipc.py).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from cascade_rl.protocol import auth


class WeightsError(RuntimeError):
    """A weights notice that cannot be honoured (missing file, bad checksum, unknown format)."""


def notice_uri(pattern: re.Pattern, notice, want: str, full_only: str = "") -> re.Match:
    """``notice.uri`` matched by a transport's ``pattern`` (a ``version`` group equal to the notice's), else a
    ``WeightsError`` naming ``want`` (the form expected); ``full_only``: the transport's name, refusing a LoRA
    adapter notice (it ships full weights only)."""
    m = pattern.match(notice.uri)
    if m is None or int(m["version"]) != notice.version:
        raise WeightsError(f"weights uri {notice.uri!r}: want {want}")
    if full_only and notice.adapter:
        raise WeightsError(f"the {full_only} weight transport ships full weights, not LoRA adapters")
    return m


class TornRead(WeightsError):
    """The weights were rewritten while they were being copied: what the engine loaded may be a mix of versions
    (``cuda_ipc``: the trainer reused the buffer mid-copy)."""


def shm_dir(run_id: str, root: str = "/dev/shm") -> Path:
    """Where the shm transport of run ``run_id`` keeps its files (also cleaned by the supervisor)."""
    base = Path(root) if Path(root).is_dir() else Path("/tmp")
    return base / f"cascade-rl-{run_id}"


def receive_dir(run_id: str) -> Path:
    """This process's folder for streamed weights: inside the run's shm folder (RAM; the supervisor
    removes it at the end of a run on this host), one per process so that no sampler deletes a file
    another is loading. Removed at exit."""
    path = shm_dir(run_id or "local") / f"stream-{os.getpid()}"
    if not path.is_dir():
        auth.private_dir(path.parent)  # the run's weights: this user's only (0700)
        auth.private_dir(path)
        atexit.register(_remove_receive_dir, path)
    return path


def _remove_receive_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()  # the run's folder, if no one else uses it
    except OSError:
        pass


class Checksum:
    """The weights checksum (see the module docstring), fed from a worker thread, so hashing chunk i
    overlaps copying or receiving chunk i+1. XXH3 runs at memory speed (blake2b, used before, ran at
    ~0.5 GB/s a core here and was the largest cost of a transfer: shm took 1.6-2x a memcpy)."""

    SMALL = 1 << 16  # buffers below this are batched (copied) into one update: a task per tiny tensor costs more

    def __init__(self, max_pending: int = 8) -> None:
        self._h = xxhash.xxh3_128()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checksum")  # one worker: updates stay in order
        self._pending: list = []
        self._max_pending = max_pending
        self._small = bytearray()

    def update(self, data):
        """Queue ``data`` (any buffer; it must not change until hashed). Waits while ``max_pending``
        buffers are queued, so a slow hash holds back the producer instead of buffering a model. Returns
        the future of ``data``'s hash (done: ``data`` may change), or None when it was copied (small)."""
        data = memoryview(data).cast("B")
        if len(data) < self.SMALL:
            self._small += data
            if len(self._small) >= 16 * self.SMALL:
                self._flush()
            return None
        self._flush()
        return self._submit(data)

    def hexdigest(self) -> str:
        self._flush()
        self._pool.shutdown(wait=True)
        return self._h.hexdigest()

    def _flush(self) -> None:
        if self._small:
            self._submit(self._small)
            self._small = bytearray()

    def _submit(self, data):
        future = self._pool.submit(self._h.update, data)
        self._pending.append(future)
        if len(self._pending) > self._max_pending:
            self._pending.pop(0).result()
        return future


def file_checksum(path: str | Path) -> str:
    """XXH3-128 of a file, hashed in place through a read-only mapping (prefaulted in one call where the
    platform has MAP_POPULATE): no copy into a buffer. 256 MiB in /dev/shm: 37 ms, against 58-73 ms reading
    it in 4 MiB blocks (bench/weight_transport.py)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ) as mapped:
            h.update(mapped)
    return h.hexdigest()

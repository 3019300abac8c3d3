"""The ``shm`` weight transport (default on one machine): the policy as one safetensors file in /dev/shm.

Publisher (the trainer, ``ShmTransport``): the file is byte for byte what ``save_model`` (a module: tied
embeddings stored once) or ``save_file`` (a state dict) writes, laid out by layout.py ``layout`` and checksummed
while it is written (common.py ``Checksum``). An atomic rename, so a reader never sees a partial file; the newest
``keep`` versions stay, the one being written included: the oldest goes before a new one is written, so /dev/shm
holds at most ``keep`` (2) files. 2 is the least that is safe: a sampler handed version v just before v+1 appears
must still find v's file (an SGLang server opens it by path later). A file a sampler still has open or mapped
keeps its pages after it is deleted, until it closes it.

Receiver (a sampler, ``resolve``): the notice's ``file://PATH`` (any shared path works), checked in place (size,
checksum) and returned as is; the engine loads it by path (registry.py ``load_file``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cascade_rl.protocol import auth
from cascade_rl.protocol.messages import WeightsReady

from .common import Checksum, WeightsError, file_checksum, shm_dir
from .layout import Staging, Weights, layout

FORMAT, SCHEME = "safetensors", "file"  # its notices: WeightsReady.format, and the URI's scheme


class ShmTransport:
    def __init__(self, run_id: str, keep: int = 2) -> None:
        self.dir = auth.private_dir(shm_dir(run_id))  # the run's weights: this user's only (0700)
        if keep < 1:
            raise ValueError(f"shm: keep must be >= 1, got {keep}")
        self.keep = keep
        self._published: list[Path] = []
        self._staging = Staging()

    def publish(self, model: Weights, version: int) -> WeightsReady:
        """``model``: the policy, a state dict in HF names, or a ``TensorSource`` (FSDP2: gathered one
        parameter at a time while this writes, learner/parallel.py)."""
        path = self.dir / f"policy-v{version:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        while len(self._published) >= self.keep:  # room first: at most ``keep`` files, the one being written included
            self._published.pop(0).unlink(missing_ok=True)
        lay, checksum = layout(model), Checksum()
        try:
            with open(tmp, "wb") as f:  # one copy (the write); the checksum thread hashes the same buffers meanwhile
                f.write(lay.header)
                checksum.update(lay.header)
                # a source that gathers each tensor when read (FSDP2) frees it once hashed: the hash then runs at
                # most one tensor behind the write, so its queue never holds a model; a module's tensors live on
                throttle, behind = hasattr(model, "read"), None
                for data, _ in lay.tensors():
                    for chunk in self._staging.host(data):  # a CPU tensor's own bytes, or a pinned staging chunk
                        f.write(chunk)
                        hashed = checksum.update(chunk)
                        self._staging.hold(hashed)  # a staging chunk is reused once hashed
                    if throttle and behind is not None:
                        behind.result()
                    behind = hashed
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            digest = checksum.hexdigest()
        os.replace(tmp, path)
        self._published.append(path)
        return WeightsReady(version=version, uri=f"file://{path}", nbytes=lay.nbytes, checksum=digest)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def resolve(notice: WeightsReady, run_id: str, timeout_s: float) -> str:
    """The notice's file, after checking its size and checksum (``run_id`` and ``timeout_s``: unused here)."""
    path = Path(notice.uri[len("file://") :])
    if not path.is_file():
        raise WeightsError(f"weights file {path} is gone (version {notice.version})")
    if notice.nbytes and path.stat().st_size != notice.nbytes:
        raise WeightsError(f"weights file {path} has {path.stat().st_size} bytes, notice says {notice.nbytes}")
    if notice.checksum and file_checksum(path) != notice.checksum:
        raise WeightsError(f"weights file {path} fails its checksum")
    return str(path)

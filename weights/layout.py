"""The safetensors file a weight transport publishes, laid out without reading a tensor, and how device tensors
reach host memory to fill it (shm.py and stream.py write the file; cuda_ipc.py lays its GPU buffer out the same).

``layout(weights)`` gives the header and each tensor's offset in file order (``file_order``: the order every
rank of an FSDP2 trainer reads its source in); ``Layout.tensors()`` then reads the tensors one at a time from a
``TensorSource`` (a module, a state dict, or learner/parallel.py ``GatheredWeights``). ``Staging`` copies device
tensors through two reused pinned buffers; a CPU tensor is written from its own memory. So a version costs one
host copy, the file (or the stream's snapshot), and nothing proportional to the model besides.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import _remove_duplicate_names  # save_model's rule for tied weights (safetensors pinned)

from .common import WeightsError

# safetensors dtype names (what the layout's header writes) -> torch dtypes
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}  # torch dtype -> its safetensors name


# --------------------------------------------------------------------------- serialisation


class TensorSource(Protocol):
    """Weights to publish that are read one tensor at a time, in the order the file wants them: what the
    FSDP2 trainer hands a transport (learner/parallel.py ``GatheredWeights``: each parameter gathered when
    read, so no rank holds the full weights). A module or a state dict becomes one with ``source``."""

    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # name -> (dtype, shape) of each tensor to publish
    metadata: dict[str, str]  # the file's __metadata__: a dropped tied name -> the name it is stored under

    def read(self, names: list[str]) -> Iterator[torch.Tensor]:
        """The tensors of ``names``, in that order (each with its spec's dtype and shape)."""
        ...


Weights = torch.nn.Module | dict[str, torch.Tensor] | TensorSource


class LocalTensors:
    """A module's state dict (tied weights once, as ``save_model`` writes it) or a state dict, as a source."""

    def __init__(self, weights: torch.nn.Module | dict[str, torch.Tensor]) -> None:
        self.state, self.metadata = named_tensors(weights)
        self.specs = {k: (t.dtype, tuple(t.shape)) for k, t in self.state.items()}

    def read(self, names: list[str]) -> Iterator[torch.Tensor]:
        return (self.state[name] for name in names)

    @property
    def device(self) -> torch.device:
        return next((t.device for t in self.state.values() if t.is_cuda), torch.device("cpu"))


def source(weights: Weights) -> TensorSource:
    return weights if hasattr(weights, "read") else LocalTensors(weights)


def file_order(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[str]:
    """The tensors' order in the file: element size (largest first), then name, as safetensors does (every
    tensor aligned for zero-copy loading). Every rank of an FSDP2 trainer reads its source in this order."""
    return sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))


@dataclass
class Layout:
    """A safetensors file to be written: its header, and each tensor's offset in the file, in file order;
    ``tensors()`` reads them from the source one at a time."""

    header: bytes
    names: list[str]
    offsets: list[int]
    nbytes: int
    source: TensorSource
    entries: dict = field(default_factory=dict)  # the header's JSON: name -> dtype, shape, data_offsets; __metadata__

    @property
    def device(self) -> torch.device:
        """Where the tensors are (a source says; else the CPU)."""
        return torch.device(getattr(self.source, "device", "cpu"))

    def tensors(self) -> Iterator[tuple[torch.Tensor, int]]:
        """(bytes as a 1-D uint8 view on the tensor's device, offset in the file), in file order."""
        for name, offset, t in zip(self.names, self.offsets, self.source.read(self.names), strict=True):
            dtype, shape = self.source.specs[name]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise WeightsError(f"weights {name}: read {t.dtype} {tuple(t.shape)}, announced {dtype} {shape}")
            yield t.detach().contiguous().reshape(-1).view(torch.uint8), offset


def layout(weights: Weights) -> Layout:
    """The safetensors layout of ``weights`` (``file_order``); reads no tensor data."""
    src = source(weights)
    names = file_order(src.specs)
    entries: dict = {"__metadata__": src.metadata} if src.metadata else {}
    offset = 0
    for name in names:
        dtype, shape = src.specs[name]
        if dtype not in DTYPES:
            raise ValueError(f"weights {name}: dtype {dtype} has no safetensors name here")
        n = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    header = struct.pack("<Q", len(text)) + text
    start = len(header)
    offsets = [start + entries[name]["data_offsets"][0] for name in names]
    return Layout(header, names, offsets, start + offset, src, entries)


class Staging:
    """How a device tensor's bytes reach host memory: through two reused staging buffers of ``chunk`` bytes,
    pinned (page-locked) where CUDA is available, so each device-to-host copy is one DMA instead of the
    driver's pageable bounce, and no host copy of a whole tensor (or model) is made. A CPU tensor is its own
    host memory: no copy. Allocated at the first device tensor (CPU-only runs never pin anything): 2 x 64 MiB.

    A chunk handed out stays valid until the one after next: a consumer that keeps using it later (the
    checksum thread) passes the future of that use to ``hold`` and the buffer waits for it before reuse."""

    def __init__(self, chunk: int = 64 << 20, copy_cpu: bool = False) -> None:
        """``copy_cpu``: stage CPU tensors too (tests: the device path on a machine without a device)."""
        self.chunk, self.copy_cpu = chunk, copy_cpu
        self._buffers: list[torch.Tensor] = []
        self._pending: list = [None, None]  # per buffer: the future its last chunk is still used by
        self._next = 0

    def host(self, data: torch.Tensor) -> Iterator[np.ndarray]:
        """``data`` (1-D uint8, any device) as host arrays, in order."""
        if data.is_cpu and not self.copy_cpu:
            yield data.numpy()
            return
        if not self._buffers:
            pin = torch.cuda.is_available()  # pinning needs CUDA
            self._buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        for start in range(0, data.numel(), self.chunk):
            k, self._next = self._next, 1 - self._next
            if self._pending[k] is not None:
                self._pending[k].result()
                self._pending[k] = None
            part = data[start : start + self.chunk]
            buf = self._buffers[k][: part.numel()]
            buf.copy_(part)  # synchronous: the bytes are on the host when this returns
            self._current = k
            yield buf.numpy()

    def hold(self, future) -> None:
        """The chunk last handed out is in use until ``future`` is done (None: it is not)."""
        if future is not None and self._buffers:
            self._pending[self._current] = future


def named_tensors(weights: torch.nn.Module | dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, metadata): a module's state dict without duplicate names of one storage (the
    metadata maps each dropped name to the kept one, as ``save_model`` writes); a state dict as is (each
    name's bytes are written from its own tensor, so names sharing a storage need no copy)."""
    if isinstance(weights, dict):
        return dict(weights), {}
    state, metadata = weights.state_dict(), {}
    for kept, dropped in _remove_duplicate_names(state).items():
        for name in dropped:
            metadata[name] = kept
            del state[name]
    return state, metadata


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no storage shared between names (safetensors refuses shared ones; tied
    embeddings are one tensor under two names): a second name gets a copy."""
    seen, out = set(), {}
    for name, t in state.items():
        t = t.contiguous()
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return out

"""The ``cuda_ipc`` weight transport: the trainer's GPU buffer, read in place by the samplers. No file at all.

For a trainer and its samplers on ONE GPU (docs/ARCHITECTURE.md §5, §10). The trainer
(``CudaIpcTransport``, the publisher) keeps ``keep`` (2) flat byte buffers on its GPU and
writes version v into buffer ``v % keep``, laid out as the data section of the safetensors file
the other transports publish (same names, dtypes, shapes, byte offsets; tied weights once).
Nothing leaves the GPU: a sampler maps the buffer into its own process with CUDA IPC and its
engine copies device to device from views of it (``reading``).

Per version the trainer writes, atomically (tmp + rename) in the run's shm folder:

* the sidecar ``policy-vVVVVVV.cuda_ipc.json`` (the notice's ``file://`` URI): one JSON object
  with the buffer's CUDA IPC handle (``handle``: the 8 values of torch's
  ``UntypedStorage._share_cuda_()``, bytes as hex, plus the GPU's UUID), the tensor table
  (``tensors``: the safetensors header entries; ``metadata``: its ``__metadata__``), ``nbytes``,
  ``version``, ``buffer``, ``seq_file`` and ``seq``, and ``torch`` (the trainer's version: the
  handle's bytes are versioned by torch, so both sides must run the same major.minor);
* the buffer's seqlock file ``buffer-K.seq``: one integer, ``2v+1`` while version v is being
  written into buffer K (odd: "writing"), ``2v+2`` once it holds v (even). The trainer writes
  the odd value before its first copy into the buffer and the even one after
  ``torch.cuda.synchronize()``; the sidecar of the version it replaces is deleted in between.

A receiver reads the seqlock before its copy (it must say "holds v", else ``WeightsError``: the
engine was not touched) and again after the copy has finished on the GPU (``TornRead``, a
``WeightsError``, if it changed: the trainer began writing v + keep into the buffer meanwhile, so
what the engine copied may be a mix, and a newer notice is on its way). Values only grow, so an
unchanged value means no write overlapped the copy.

Checksum: the notice's ``checksum`` is XXH3-128 (hex) of the sidecar's bytes, which name the
version, the buffer and its seqlock value. Hashing gigabytes of GPU memory on every load would
cost what this transport saves, so the weights' integrity here is the seqlock's job: the bytes
were written by one process on one device and ``synchronize``d before the sidecar existed.

Each IPC handle is opened once per process (``open_buffer`` keeps the mapping); the views handed
out are valid only until the trainer reuses the buffer, so engines copy them (``load_tensors``, which ``load``,
the sampler's side, calls inside ``reading``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from cascade_rl.protocol import auth
from cascade_rl.protocol.messages import WeightsReady

from .common import TornRead, WeightsError, shm_dir
from .layout import SAFETENSORS_DTYPES, Layout, Weights, layout

FORMAT, SCHEME = "cuda_ipc", "file"  # its notices: WeightsReady.format, and the URI's scheme (the sidecar's)
PROTOCOL = 1  # the sidecar's layout; a receiver refuses another

# the 8 values of ``UntypedStorage._share_cuda_()`` and ``_new_shared_cuda(*values)``, in order, with their
# types, as torch/multiprocessing/reductions.py (reduce_tensor / rebuild_cuda_tensor) and
# torch/csrc/StorageSharing.cpp use them in torch 2.11 to 2.13
HANDLE_FIELDS = (("device", int), ("handle", bytes), ("size", int), ("offset", int), ("ref_counter", bytes),
                 ("ref_counter_offset", int), ("event_handle", bytes), ("event_sync_required", bool))


# --------------------------------------------------------------------------- files


def sidecar_path(folder: Path, version: int) -> Path:
    return folder / f"policy-v{version:06d}.cuda_ipc.json"


def seq_path(folder: Path, buffer: int) -> Path:
    return folder / f"buffer-{buffer}.seq"


def writing(version: int) -> int:
    """The seqlock value while ``version`` is being written (odd)."""
    return 2 * version + 1


def holding(version: int) -> int:
    """The seqlock value once the buffer holds ``version`` (even)."""
    return 2 * version + 2


def describe(seq: int) -> str:
    """A seqlock value in words, for messages."""
    if seq < 0:
        return "nothing"
    return f"version {(seq - 1) // 2} being written" if seq % 2 else f"version {(seq - 2) // 2}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_seq(path: Path, seq: int) -> None:
    write_atomic(path, f"{seq}\n".encode())


def read_seq(path: Path) -> int:
    """The seqlock value in ``path`` (-1 if the file is gone: the trainer closed)."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return -1
    except ValueError as e:
        raise WeightsError(f"seqlock file {path} is not an integer: {e}") from None


def check_holds(path: Path, version: int, torn: bool = False) -> None:
    """Raise unless the buffer of ``path`` holds ``version``: ``WeightsError`` before a copy, ``TornRead``
    after one (``torn``)."""
    seq = read_seq(path)
    if seq == holding(version):
        return
    if torn:
        raise TornRead(f"cuda_ipc weights v{version}: the trainer's buffer was rewritten during the copy (it now "
                       f"holds {describe(seq)}); the weights loaded are discarded, waiting for the next notice")
    raise WeightsError(f"cuda_ipc weights v{version}: the trainer's buffer now holds {describe(seq)} "
                       f"({path.name}); waiting for the next notice")


# --------------------------------------------------------------------------- the IPC handle


def encode_handle(values: tuple) -> dict:
    """``_share_cuda_()``'s 8 values as JSON-safe primitives (bytes as hex). A tuple of another shape (a
    torch that changed the protocol) raises ``WeightsError`` rather than publish a handle nobody can open."""
    _check_values(values, "UntypedStorage._share_cuda_() returned")
    return {name: value.hex() if kind is bytes else value
            for (name, kind), value in zip(HANDLE_FIELDS, values, strict=True)}


def decode_handle(handle: dict) -> tuple:
    """The arguments of ``UntypedStorage._new_shared_cuda`` from an encoded handle (``WeightsError`` if
    a field is missing or of another type)."""
    try:
        values = tuple(bytes.fromhex(handle[name]) if kind is bytes else handle[name] for name, kind in HANDLE_FIELDS)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"cuda_ipc sidecar: bad IPC handle ({type(e).__name__}: {e})") from None
    _check_values(values, "the sidecar's handle has")
    return values


def _check_values(values, what: str) -> None:
    def fits(value, kind) -> bool:
        return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))

    if not (isinstance(values, tuple) and len(values) == len(HANDLE_FIELDS)
            and all(fits(v, kind) for v, (_, kind) in zip(values, HANDLE_FIELDS, strict=True))):
        got = tuple(type(v).__name__ for v in values) if isinstance(values, tuple) else type(values).__name__
        want = tuple(kind.__name__ for _, kind in HANDLE_FIELDS)
        raise WeightsError(f"cuda_ipc: {what} {got}, expected {want} as in torch 2.11-2.13 "
                           f"(torch/multiprocessing/reductions.py); this torch is {torch.__version__}")


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it ('' if torch cannot tell). Processes that
    see one GPU under different indices (CUDA_VISIBLE_DEVICES) agree on its UUID."""
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # an older torch or another platform: fall back to the index
        return ""
    return uuid if re.fullmatch(r"(GPU-)?[0-9a-fA-F]{8}(-[0-9a-fA-F]+)+", uuid) else ""  # never an object's repr


def share_storage(storage: torch.UntypedStorage) -> dict:
    """The encoded CUDA IPC handle of ``storage`` (call once per buffer: each call wraps the storage in a
    new reference-counted IPC context)."""
    if storage.device.type != "cuda":
        raise WeightsError(f"cuda_ipc shares GPU memory, but the trainer's weights are on {storage.device}: "
                           f"give the trainer a GPU (gpus.trainer=[0]) or use weights_transport=shm")
    try:
        values = storage._share_cuda_()
    except RuntimeError as e:  # e.g. a driver or container that does not export IPC handles
        raise WeightsError(f"cuda_ipc: cannot share the trainer's buffer ({e}); use weights_transport=shm") from None
    handle = encode_handle(values)
    handle["uuid"] = device_uuid(storage.device.index or 0)
    return handle


def local_device(handle: dict) -> int:
    """This process's index of the GPU the handle's memory is on: found by UUID, else the producer's index."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise WeightsError("cuda_ipc weights need CUDA in the sampler process: this process sees no GPU "
                           "(give the samplers the trainer's GPU, gpus.samplers=[G], or use weights_transport=shm)")
    uuid = handle.get("uuid", "")
    if uuid:
        for index in range(count):
            if device_uuid(index) == uuid:
                return index
        raise WeightsError(f"cuda_ipc: the trainer's GPU {uuid} is not visible to this process "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): every sampler must "
                           f"be on the trainer's GPU, or use weights_transport=shm")
    if not 0 <= handle["device"] < count:
        raise WeightsError(f"cuda_ipc: the trainer's buffer is on device {handle['device']}, this process sees {count}")
    return handle["device"]


def same_torch(theirs: str, ours: str | None = None) -> bool:
    """Whether two torch versions share the IPC handle format (same major.minor; torch 2.13 changed the
    handle's version byte)."""
    ours = torch.__version__ if ours is None else ours
    return theirs.split("+")[0].split(".")[:2] == ours.split("+")[0].split(".")[:2]


_OPENED: dict[str, torch.Tensor] = {}  # handle -> this process's mapping of a trainer buffer, as uint8
_MAX_OPENED = 4  # two buffers, and two more while a re-laid-out trainer's new ones replace them


def open_buffer(sidecar: dict) -> torch.Tensor:
    """The trainer's buffer of ``sidecar`` as a uint8 tensor on this process's device, opened once per handle
    (CUDA IPC maps a handle once per process; later versions in that buffer reuse the mapping)."""
    handle = sidecar["handle"]
    key = f"{handle.get('uuid')}:{handle.get('handle')}:{handle.get('offset')}"
    if key in _OPENED:
        return _OPENED[key]
    if not same_torch(sidecar.get("torch", "")):
        raise WeightsError(f"cuda_ipc: the trainer runs torch {sidecar.get('torch')!r}, this sampler "
                           f"{torch.__version__}: CUDA IPC handles need the same torch on both sides")
    values = decode_handle(handle)
    device = local_device(handle)
    try:
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(device, *values[1:])
    except (RuntimeError, TypeError) as e:
        raise WeightsError(f"cuda_ipc: cannot open the trainer's buffer on cuda:{device} ({e}); CUDA IPC needs "
                           f"both processes on one GPU of one machine, with a driver that allows it "
                           f"(weights_transport=shm does not need it)") from None
    buf = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
    while len(_OPENED) >= _MAX_OPENED:
        _OPENED.pop(next(iter(_OPENED)))  # the oldest: a buffer the trainer no longer publishes from
    _OPENED[key] = buf
    return buf


# --------------------------------------------------------------------------- publisher


@dataclass
class IpcBuffer:
    """One of the cuda_ipc transport's GPU buffers: its bytes, its shared handle (taken once: each
    ``_share_cuda_`` call wraps the storage in a new IPC context) and its seqlock file."""

    data: torch.Tensor  # 1-D uint8 on the trainer's GPU
    handle: dict  # ``share_storage``
    seq: Path


class CudaIpcTransport:
    def __init__(self, run_id: str, keep: int = 2, share=share_storage) -> None:
        """``keep``: buffers (version v goes to buffer v % keep; 2 = double buffering: a sampler still copying
        v is never overwritten by v + 1); ``share``: how a buffer's storage becomes a handle (CUDA IPC; tests on
        the CPU pass their own)."""
        if keep < 1:
            raise ValueError(f"cuda_ipc: keep must be >= 1, got {keep}")
        self.dir = auth.private_dir(shm_dir(run_id))  # the run's weights: this user's only (0700)
        self.keep, self._share = keep, share
        self._buffers: list[IpcBuffer] = []
        self._shape: tuple | None = None  # (bytes, tensor table) the buffers were laid out for
        self._held: dict[int, int] = {}  # buffer -> the version its sidecar announces

    def publish(self, weights: Weights, version: int) -> WeightsReady:
        """``weights``: the policy, or its full state dict in HF names, on the GPU. Copies it into buffer
        ``version % keep`` (device to device), waits for the copies, then writes the version's sidecar."""
        lay = layout(weights)
        table = {k: v for k, v in lay.entries.items() if k != "__metadata__"}
        nbytes = lay.nbytes - len(lay.header)
        buf = self._buffer(version % self.keep, lay, table, nbytes)
        write_seq(buf.seq, writing(version))  # before the first byte changes: readers see "writing"
        old = self._held.pop(version % self.keep, None)
        if old is not None:
            sidecar_path(self.dir, old).unlink(missing_ok=True)
        start = len(lay.header)
        for data, offset in lay.tensors():
            buf.data[offset - start : offset - start + data.numel()].copy_(data)
        if buf.data.is_cuda:
            torch.cuda.synchronize(buf.data.device)  # the bytes are in place before anyone is told they are
        write_seq(buf.seq, holding(version))
        sidecar = {"protocol": PROTOCOL, "format": FORMAT, "version": version,
                   "buffer": version % self.keep, "seq_file": buf.seq.name, "seq": holding(version),
                   "nbytes": nbytes, "torch": torch.__version__, "handle": buf.handle, "tensors": table,
                   "metadata": lay.entries.get("__metadata__", {})}
        text = json.dumps(sidecar, separators=(",", ":")).encode()
        path = sidecar_path(self.dir, version)
        write_atomic(path, text)
        self._held[version % self.keep] = version
        return WeightsReady(version=version, uri=f"file://{path}", format=FORMAT, nbytes=nbytes,
                            checksum=xxhash.xxh3_128_hexdigest(text))

    def _buffer(self, index: int, lay: Layout, table: dict, nbytes: int) -> IpcBuffer:
        """Buffer ``index``, allocating (and sharing) all of them at the first publish, and again only if the
        weights' layout changes (the sidecars carry the new handles)."""
        shape = (nbytes, json.dumps(table, sort_keys=True))
        if shape != self._shape:
            if nbytes == 0:
                raise WeightsError("cuda_ipc: the weights are empty")
            device = lay.device
            for old in self._held.values():  # their buffers go: so do the notices of what those held
                sidecar_path(self.dir, old).unlink(missing_ok=True)
            self._held.clear()
            self._buffers = []  # the old ones are freed once no sampler maps them (torch's IPC reference counts)
            for k in range(self.keep):
                data = torch.empty(nbytes, dtype=torch.uint8, device=device)
                seq = seq_path(self.dir, k)
                write_seq(seq, -1)
                self._buffers.append(IpcBuffer(data, self._share(data.untyped_storage()), seq))
            self._shape = shape
        return self._buffers[index]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._buffers = []


# --------------------------------------------------------------------------- receiver: the sidecar and its views


def read_sidecar(notice: WeightsReady) -> tuple[dict, Path]:
    """(the sidecar of ``notice``, its path), checked against the notice: its bytes' checksum, version, size."""
    if notice.format != FORMAT or not notice.uri.startswith("file://"):
        raise WeightsError(f"not a cuda_ipc notice: format {notice.format!r}, uri {notice.uri!r}")
    path = Path(notice.uri[len("file://"):])
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WeightsError(f"cuda_ipc sidecar {path} is gone: its buffer holds a newer version "
                           f"(v{notice.version} was replaced); waiting for the next notice") from None
    if notice.checksum and xxhash.xxh3_128_hexdigest(data) != notice.checksum:
        raise WeightsError(f"cuda_ipc sidecar {path} does not match its notice's checksum")
    try:
        sidecar = json.loads(data)
    except ValueError as e:
        raise WeightsError(f"cuda_ipc sidecar {path} is not JSON: {e}") from None
    if not isinstance(sidecar, dict) or sidecar.get("protocol") != PROTOCOL:
        raise WeightsError(f"cuda_ipc sidecar {path}: protocol {sidecar.get('protocol') if isinstance(sidecar, dict) else None!r}"
                           f", this sampler reads {PROTOCOL}")
    if sidecar.get("version") != notice.version or (notice.nbytes and sidecar.get("nbytes") != notice.nbytes):
        raise WeightsError(f"cuda_ipc sidecar {path}: v{sidecar.get('version')} of {sidecar.get('nbytes')} bytes, "
                           f"the notice says v{notice.version} of {notice.nbytes}")
    name = sidecar.get("seq_file")
    if not isinstance(name, str) or Path(name).name != name:
        raise WeightsError(f"cuda_ipc sidecar {path}: bad seq_file {name!r}")
    return sidecar, path.parent / name


def views(buffer: torch.Tensor, table: dict, nbytes: int) -> dict[str, torch.Tensor]:
    """name -> a tensor viewing its bytes of ``buffer`` (1-D uint8), per the safetensors header entries in
    ``table``; an entry that does not fit the buffer raises ``WeightsError``."""
    if buffer.numel() < nbytes:
        raise WeightsError(f"cuda_ipc: the buffer has {buffer.numel()} bytes, the table needs {nbytes}")
    out = {}
    for name, entry in table.items():
        try:
            dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]]
            start, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"cuda_ipc tensor table: bad entry {name!r}: {e!r}") from None
        size = math.prod(shape) * dtype.itemsize
        if not (isinstance(start, int) and 0 <= start and end == start + size <= nbytes and start % dtype.itemsize == 0):
            raise WeightsError(f"cuda_ipc tensor table: {name!r} at bytes {start}..{end} does not fit "
                               f"{dtype} {shape} in {nbytes} bytes")
        out[name] = buffer[start:end].view(dtype).view(shape)
    return out


Opener = Callable[[dict], torch.Tensor]  # sidecar -> the buffer as 1-D uint8 (open_buffer; tests pass their own)


def open_weights(notice: WeightsReady, opener: Opener | None = None) -> dict[str, torch.Tensor]:
    """name -> a view of each tensor of ``notice``'s version in the trainer's buffer (names as the safetensors
    file of the other transports has them). Checks the seqlock first; the views are valid until the trainer
    reuses the buffer, so copy them inside ``reading``, which checks again after the copy."""
    return _open(notice, opener)[0]


def _open(notice: WeightsReady, opener: Opener | None) -> tuple[dict[str, torch.Tensor], Path, torch.device]:
    sidecar, seq = read_sidecar(notice)
    check_holds(seq, notice.version)
    buffer = (opener or open_buffer)(sidecar)
    tensors = views(buffer, sidecar.get("tensors") or {}, int(sidecar.get("nbytes", 0)))
    return tensors, seq, buffer.device


@contextmanager
def reading(notice: WeightsReady, opener: Opener | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """``with reading(notice) as tensors: engine.load_tensors(tensors, v)``: the views of ``open_weights``;
    after the block, once this process's GPU work has finished, raises ``TornRead`` if the trainer began to
    rewrite the buffer meanwhile (the engine then holds a possible mix of two versions)."""
    tensors, seq, device = _open(notice, opener)
    yield tensors
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the engine's copies are queued on the GPU: they must be done first
    check_holds(seq, notice.version, torn=True)


def load(engine, notice: WeightsReady, run_id: str) -> None:
    """A sampler applies a notice: the engine copies from views of the trainer's GPU buffer; ``TornRead`` if the
    trainer rewrote the buffer during the copy."""
    load_tensors = getattr(engine, "load_tensors", None)
    if load_tensors is None:
        raise WeightsError(f"the {type(engine).__name__} loads weights from files only: use weights_transport=shm")
    with reading(notice) as tensors:
        load_tensors(tensors, notice.version)

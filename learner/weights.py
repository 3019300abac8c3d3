"""Publishing side of weight transports, registered by name.

Both transports publish the same bytes: the policy as one safetensors file,
byte for byte what ``save_model`` (a module: tied embeddings stored once) or
``save_file`` (a state dict) writes, laid out by ``layout`` and checksummed
while it is written (XXH3-128 of the file; see protocol/weights.py).
Samplers resolve a ``WeightsReady`` with ``cascade_rl.protocol.weights.resolve``
and load a local file either way. The trainer builds one transport,
``TRANSPORTS[name](run_id=..., **options)``; ``bench/weight_transport.py``
times both against a memory copy.

* ``shm`` (default on one machine): the file goes to /dev/shm (atomic rename,
  so a reader never sees a partial file); the newest ``keep`` versions stay.
* ``stream`` (hosts without a shared file system): the file is built once per
  version in memory (one copy of the weights: the trainer changes them in the
  next step) and served in chunks from a background thread that owns a ROUTER
  bound on ``endpoint``; it answers each ``WeightsGet`` with a ``WeightsChunk``
  (or a ``WeightsRefused``), messages of the codec (protocol/messages.py) whose
  data frame is a zero-copy view of the snapshot, so many samplers fetch
  concurrently without further copies. The newest ``keep`` versions stay in
  memory, and the last evicted one, whose buffer the next version reuses once
  no frame of it is in flight (touching fresh pages costs more than the copy):
  (keep + 1) x the model's bytes.
  The notice's URI is ``stream+tcp://HOST:PORT/VERSION``: HOST is ``host`` if
  given, else the bound address if it is not a wildcard, else this machine's
  hostname (if it resolves; 127.0.0.1 otherwise). Set ``host`` when samplers
  reach the trainer under another name or address.
* ``cuda_ipc`` (a trainer and its samplers on ONE GPU): no file at all. The
  trainer keeps ``keep`` (2) flat GPU byte buffers laid out like the file's data
  section (``layout``) and copies version v into buffer ``v % keep`` device to
  device; samplers map the buffer with CUDA IPC and copy from views of it. The
  notice names a small JSON sidecar (the IPC handle and the tensor table) and
  its checksum is the sidecar's; a seqlock file per buffer catches a sampler
  still copying a version the trainer overwrites (protocol/cuda_ipc.py).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash
import zmq
from safetensors.torch import _remove_duplicate_names  # save_model's rule for tied weights (safetensors pinned)

from cascade_rl.protocol import auth, cuda_ipc
from cascade_rl.protocol.codec import ProtocolError, decode, encode
from cascade_rl.protocol.messages import WeightsChunk, WeightsGet, WeightsReady, WeightsRefused
from cascade_rl.protocol.registry import Registry
from cascade_rl.protocol.weights import Checksum, WeightsError, shm_dir

log = logging.getLogger(__name__)

TRANSPORTS = Registry("weight transport")  # name -> class(run_id) with publish(model, version), close()
register_transport = TRANSPORTS.register

Weights = torch.nn.Module | dict[str, torch.Tensor]

DTYPES = {dtype: name for name, dtype in cuda_ipc.DTYPES.items()}  # torch dtype -> its safetensors name


@register_transport("shm")
class ShmTransport:
    def __init__(self, run_id: str, keep: int = 2) -> None:
        self.dir = auth.private_dir(shm_dir(run_id))  # the run's weights: this user's only (0700)
        self.keep = keep
        self._published: list[Path] = []

    def publish(self, model: Weights, version: int) -> WeightsReady:
        """``model``: the policy, or its full state dict in HF names (gathered from FSDP2 shards)."""
        path = self.dir / f"policy-v{version:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        lay, checksum = layout(model), Checksum()
        try:
            with open(tmp, "wb") as f:  # one copy (the write); the checksum thread hashes the same buffers meanwhile
                f.write(lay.header)
                checksum.update(lay.header)
                for data, _ in lay.tensors:
                    data = data.cpu().numpy()
                    f.write(data)
                    checksum.update(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            digest = checksum.hexdigest()
        os.replace(tmp, path)
        self._published.append(path)
        while len(self._published) > self.keep:
            self._published.pop(0).unlink(missing_ok=True)
        return WeightsReady(version=version, uri=f"file://{path}", nbytes=lay.nbytes, checksum=digest)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Snapshot:
    """One published version of the stream transport: the safetensors file's bytes and checksum, and
    a tracker for each reply frame sent from them (the buffer is reused only once all are done)."""

    data: np.ndarray
    checksum: str
    trackers: list = field(default_factory=list)

    def in_flight(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return bool(self.trackers)


@register_transport("stream")
class StreamTransport:
    def __init__(self, run_id: str, keep: int = 2, endpoint: str = "tcp://0.0.0.0:0", host: str = "",
                 chunk_mb: int = 16) -> None:
        """``endpoint``: where the ROUTER binds (port 0: a free one); ``host``: the name samplers connect
        to (see the module docstring); ``chunk_mb``: the size of one reply frame."""
        self.keep, self.chunk = keep, chunk_mb << 20
        self.malformed = 0  # requests that could not be parsed (answered with a refusal when possible)
        self.dropped = 0  # replies to peers that vanished or stopped reading
        self._snapshots: dict[int, Snapshot] = {}
        self._retired: Snapshot | None = None  # the last evicted version: its buffer is the next one's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=1)  # its own IO thread: transfers never delay the trainer's sockets
        bound: queue.Queue = queue.Queue(1)
        self._thread = threading.Thread(target=self._serve, args=(endpoint, bound), name="weights-stream", daemon=True)
        self._thread.start()
        self.endpoint = bound.get(timeout=30)
        if isinstance(self.endpoint, Exception):
            auth.release(self._ctx)
            self._ctx.term()
            raise self.endpoint
        address, port = self.endpoint.split("://", 1)[1].rsplit(":", 1)
        self.host, self.port = host or advertised_host(address), int(port)

    def publish(self, weights: Weights, version: int) -> WeightsReady:
        """``weights``: the policy, or its full state dict in HF names. Returns once the snapshot is
        built and hashed; samplers fetch it from the server thread afterwards."""
        with self._lock:  # reuse a warm buffer: fresh pages cost more than the copy (page faults, zeroing)
            old, self._retired = self._retired, None
            reuse = old.data if old is not None and not old.in_flight() else None
        snap = snapshot(weights, reuse)
        with self._lock:
            self._snapshots[version] = snap
            for v in sorted(self._snapshots)[: -self.keep]:
                self._retired = self._snapshots.pop(v)  # fetches of it now get "evicted"
        return WeightsReady(version=version, uri=f"stream+tcp://{self.host}:{self.port}/{version}",
                            nbytes=len(snap.data), checksum=snap.checksum)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        auth.release(self._ctx)  # its ZAP handler, if any, would hold up term()
        self._ctx.term()
        self._snapshots.clear()

    # ------------------------------------------------------------------ server thread

    def _serve(self, endpoint: str, bound: queue.Queue) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises instead of vanishing
        sock.setsockopt(zmq.LINGER, 0)
        try:
            auth.bind(sock, endpoint)  # CURVE server when the run has keys (protocol/auth.py)
        except Exception as e:
            sock.close()
            bound.put(WeightsError(f"stream weights transport cannot bind {endpoint}: {e}"))
            return
        bound.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            while not self._stop.is_set():
                if sock.poll(100):  # the stop flag is checked at least every 100 ms
                    self._answer(sock)
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)
        identity, version = frames[0].bytes, -1  # bytes: a received Frame cannot be sent tracked
        try:
            request = decode(frames[1:], (WeightsGet,))
            version = request.version
            with self._lock:  # the snapshot cannot be retired and reused between lookup and tracking
                snap = self._snapshots.get(version)
                if snap is not None:
                    self._send_chunk(sock, identity, version, request.chunk, snap)
                    return
                served = sorted(self._snapshots)
            reason = f"version {version} is not served (evicted or never published); serving {served}"
        except ProtocolError as e:
            self.malformed += 1
            reason = f"malformed request: {str(e):.300}"  # a reason, not an echo of what the peer sent
            log.warning("weights stream: %s", reason)
        except Exception as e:  # never let one request stop the server
            log.exception("weights stream: request failed")
            reason = f"publisher error: {e}"
        self._refuse(sock, identity, version, reason)

    def _send_chunk(self, sock: zmq.Socket, identity: bytes, version: int, chunk: int, snap: Snapshot) -> None:
        nbytes = len(snap.data)
        chunks = max(1, -(-nbytes // self.chunk))
        if chunk >= chunks:
            self._refuse(sock, identity, version, f"chunk {chunk} out of range: v{version} has {chunks}")
            return
        data = snap.data[chunk * self.chunk : (chunk + 1) * self.chunk]  # a view: encode frames it without a copy
        reply = WeightsChunk(version=version, chunk=chunk, chunks=chunks, nbytes=nbytes, checksum=snap.checksum,
                             data=data)
        if tracker := self._send(sock, [identity, *encode(reply)], track=True):  # zmq reads the snapshot
            snap.trackers.append(tracker)
            if len(snap.trackers) > 256:
                snap.in_flight()  # drop the finished ones

    def _refuse(self, sock: zmq.Socket, identity: bytes, version: int, reason: str) -> None:
        self._send(sock, [identity, *encode(WeightsRefused(version=version, reason=reason))])

    def _send(self, sock: zmq.Socket, frames: list, track: bool = False):
        try:
            return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=track)
        except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY) or its queue full: it times out and retries
            self.dropped += 1
            return None


def advertised_host(address: str) -> str:
    if address not in ("0.0.0.0", "*", "::", "[::]"):
        return address
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


# --------------------------------------------------------------------------- cuda_ipc


@dataclass
class IpcBuffer:
    """One of the cuda_ipc transport's GPU buffers: its bytes, its shared handle (taken once: each
    ``_share_cuda_`` call wraps the storage in a new IPC context) and its seqlock file."""

    data: torch.Tensor  # 1-D uint8 on the trainer's GPU
    handle: dict  # protocol/cuda_ipc.py ``share_storage``
    seq: Path


@register_transport("cuda_ipc")
class CudaIpcTransport:
    def __init__(self, run_id: str, keep: int = 2, share=cuda_ipc.share_storage) -> None:
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
        cuda_ipc.write_seq(buf.seq, cuda_ipc.writing(version))  # before the first byte changes: readers see "writing"
        old = self._held.pop(version % self.keep, None)
        if old is not None:
            cuda_ipc.sidecar_path(self.dir, old).unlink(missing_ok=True)
        start = len(lay.header)
        for data, offset in lay.tensors:
            buf.data[offset - start : offset - start + data.numel()].copy_(data)
        if buf.data.is_cuda:
            torch.cuda.synchronize(buf.data.device)  # the bytes are in place before anyone is told they are
        cuda_ipc.write_seq(buf.seq, cuda_ipc.holding(version))
        sidecar = {"protocol": cuda_ipc.PROTOCOL, "format": cuda_ipc.FORMAT, "version": version,
                   "buffer": version % self.keep, "seq_file": buf.seq.name, "seq": cuda_ipc.holding(version),
                   "nbytes": nbytes, "torch": torch.__version__, "handle": buf.handle, "tensors": table,
                   "metadata": lay.entries.get("__metadata__", {})}
        text = json.dumps(sidecar, separators=(",", ":")).encode()
        path = cuda_ipc.sidecar_path(self.dir, version)
        cuda_ipc.write_atomic(path, text)
        self._held[version % self.keep] = version
        return WeightsReady(version=version, uri=f"file://{path}", format=cuda_ipc.FORMAT, nbytes=nbytes,
                            checksum=xxhash.xxh3_128_hexdigest(text))

    def _buffer(self, index: int, lay: Layout, table: dict, nbytes: int) -> IpcBuffer:
        """Buffer ``index``, allocating (and sharing) all of them at the first publish, and again only if the
        weights' layout changes (the sidecars carry the new handles)."""
        shape = (nbytes, json.dumps(table, sort_keys=True))
        if shape != self._shape:
            if nbytes == 0:
                raise WeightsError("cuda_ipc: the weights are empty")
            device = next((t.device for t, _ in lay.tensors if t.is_cuda), lay.tensors[0][0].device)
            for old in self._held.values():  # their buffers go: so do the notices of what those held
                cuda_ipc.sidecar_path(self.dir, old).unlink(missing_ok=True)
            self._held.clear()
            self._buffers = []  # the old ones are freed once no sampler maps them (torch's IPC reference counts)
            for k in range(self.keep):
                data = torch.empty(nbytes, dtype=torch.uint8, device=device)
                seq = cuda_ipc.seq_path(self.dir, k)
                cuda_ipc.write_seq(seq, -1)
                self._buffers.append(IpcBuffer(data, self._share(data.untyped_storage()), seq))
            self._shape = shape
        return self._buffers[index]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._buffers = []


# --------------------------------------------------------------------------- serialisation


@dataclass
class Layout:
    """A safetensors file to be written: its header, and each tensor's bytes (a 1-D uint8 view, on the
    tensor's device) with its offset in the file, in file order."""

    header: bytes
    tensors: list[tuple[torch.Tensor, int]]
    nbytes: int
    entries: dict = field(default_factory=dict)  # the header's JSON: name -> dtype, shape, data_offsets; __metadata__


def layout(weights: Weights) -> Layout:
    """The safetensors layout of ``weights``: tensors sorted by element size (largest first) then name,
    as safetensors does, so every tensor is aligned for zero-copy loading."""
    state, metadata = named_tensors(weights)
    names = sorted(state, key=lambda k: (-state[k].element_size(), k))
    entries: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = state[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"weights {name}: dtype {t.dtype} has no safetensors name here")
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    header = struct.pack("<Q", len(text)) + text
    tensors, start = [], len(header)
    for name in names:
        data = state[name].detach().contiguous().reshape(-1).view(torch.uint8)
        tensors.append((data, start + entries[name]["data_offsets"][0]))
    return Layout(header, tensors, start + offset, entries)


def snapshot(weights: Weights, reuse: np.ndarray | None = None) -> Snapshot:
    """The file's bytes in one buffer (``reuse`` if it has the right size, else a fresh one): one copy,
    device tensors straight into it; hashed by a second thread while later tensors are copied."""
    lay, checksum = layout(weights), Checksum()
    data = reuse if reuse is not None and len(reuse) == lay.nbytes else np.empty(lay.nbytes, np.uint8)
    out = torch.from_numpy(data)
    data[: len(lay.header)] = np.frombuffer(lay.header, np.uint8)
    hashed = 0
    for t, start in lay.tensors:
        end = start + t.numel()
        if t.is_cpu:
            data[start:end] = t.numpy()  # numpy's copy is one thread: torch's would fight the hash thread
        else:
            out[start:end].copy_(t)
        if end - hashed >= Checksum.SMALL:  # hash in contiguous runs, not tensor by tensor
            checksum.update(data[hashed:end])
            hashed = end
    checksum.update(data[hashed:])
    return Snapshot(data, checksum.hexdigest())


def named_tensors(weights: Weights) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, metadata): a module's state dict without duplicate names of one storage (the
    metadata maps each dropped name to the kept one, as ``save_model`` writes); a state dict as is,
    with shared storages copied."""
    if isinstance(weights, dict):
        return unshared(weights), {}
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

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
  so a reader never sees a partial file); the newest ``keep`` versions stay,
  the one being written included: the oldest goes before a new one is
  written, so /dev/shm holds at most ``keep`` (2) files. 2 is the least that
  is safe: a sampler handed version v just before v+1 appears must still find
  v's file (an SGLang server opens it by path later). A file a sampler still
  has open or mapped keeps its pages after it is deleted, until it closes it.

Where the weights are: a module or a state dict (one rank), or a
``TensorSource`` that yields one tensor at a time (FSDP2: learner/parallel.py
``GatheredWeights`` gathers each parameter as it is written, so no rank holds
the full weights). Device tensors reach host memory through ``Staging``: two
reused 64 MiB buffers, pinned where CUDA is available; a CPU tensor is written
from its own memory. So a version costs one host copy, the file (or the
stream's snapshot), and nothing proportional to the model besides.
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
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash
import zmq

from cascade_rl.protocol import auth, cuda_ipc
from cascade_rl.protocol.codec import ProtocolError, decode, encode
from cascade_rl.protocol.messages import WeightsChunk, WeightsGet, WeightsReady, WeightsRefused
from cascade_rl.protocol.registry import Registry
from cascade_rl.protocol.weights import Checksum, WeightsError, shm_dir

from .weight_layout import (  # noqa: F401  (named_tensors, unshared: this module's API for callers)
    DTYPES,
    Layout,
    Staging,
    Weights,
    layout,
    named_tensors,
    unshared,
)

log = logging.getLogger(__name__)

TRANSPORTS = Registry("weight transport")  # name -> class(run_id) with publish(model, version), close()
register_transport = TRANSPORTS.register



@register_transport("shm")
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
        self._staging = Staging()
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
        """``weights``: the policy, a state dict in HF names, or a ``TensorSource``. Returns once the
        snapshot is built and hashed; samplers fetch it from the server thread afterwards."""
        with self._lock:  # reuse a warm buffer: fresh pages cost more than the copy (page faults, zeroing)
            old, self._retired = self._retired, None
            reuse = old.data if old is not None and not old.in_flight() else None
        snap = snapshot(weights, reuse, self._staging)
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
        for data, offset in lay.tensors():
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
            device = lay.device
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


def snapshot(weights: Weights, reuse: np.ndarray | None = None, staging: Staging | None = None) -> Snapshot:
    """The file's bytes in one buffer (``reuse`` if it has the right size, else a fresh one): one host copy,
    device tensors through ``staging``; hashed by a second thread while later tensors are copied."""
    lay, checksum = layout(weights), Checksum()
    staging = staging or Staging()
    data = reuse if reuse is not None and len(reuse) == lay.nbytes else np.empty(lay.nbytes, np.uint8)
    data[: len(lay.header)] = np.frombuffer(lay.header, np.uint8)
    hashed = 0
    for t, start in lay.tensors():
        end = start
        for chunk in staging.host(t):  # numpy's copy is one thread: torch's would fight the hash thread
            data[end : end + len(chunk)] = chunk
            end += len(chunk)
        if end - hashed >= Checksum.SMALL:  # hash in contiguous runs, not tensor by tensor
            checksum.update(data[hashed:end])
            hashed = end
    checksum.update(data[hashed:])
    return Snapshot(data, checksum.hexdigest())

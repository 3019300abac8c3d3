"""The ``stream`` weight transport (hosts without a shared file system): the safetensors file over ZeroMQ.

Publisher (the trainer, ``StreamTransport``): the file (the same bytes as shm.py's, layout.py ``layout``) is
built once per version in memory (``snapshot``: one copy of the weights: the trainer changes them in the next
step) and served in chunks from a background thread that owns a ROUTER bound on ``endpoint``; it answers each
``WeightsGet`` with a ``WeightsChunk`` (or a ``WeightsRefused``), messages of the codec (protocol/messages.py)
whose data frame is a zero-copy view of the snapshot, so many samplers fetch concurrently without further
copies. The newest ``keep`` versions stay in memory, and the last evicted one, whose buffer the next version
reuses once no frame of it is in flight (touching fresh pages costs more than the copy): (keep + 1) x the
model's bytes. The notice's URI is ``stream+tcp://HOST:PORT/VERSION``: HOST is ``host`` if given, else the bound
address if it is not a wildcard, else this machine's hostname (if it resolves; 127.0.0.1 otherwise). Set
``host`` when samplers reach the trainer under another name or address.

Receiver (a sampler, ``resolve``): fetched from the trainer's ROUTER in chunks, written under this process's
receive folder (common.py ``receive_dir``, in /dev/shm) with an atomic rename; the folder keeps the returned
file and the newest other one. The engine loads it by path (registry.py ``load_file``).

Wire protocol (DEALER of the sampler -> ROUTER of the trainer): messages of the codec like every other
(protocol/codec.py, protocol/messages.py; a msgpack header frame, the data in a frame of its own, received
zero-copy):

    request   WeightsGet(version, chunk, part)       part "": the file; another: a payload served with it (``attach``)
    reply     WeightsChunk(version, chunk, chunks, nbytes, checksum, data)
    refusal   WeightsRefused(version, reason)

Chunk ``i`` is bytes ``[i*S, min((i+1)*S, nbytes))`` of the file (``S`` is the publisher's chunk size; ``chunks``
tells the count). The receiver asks for chunk 0, then keeps at most ``window`` requests in flight (credit-based
flow control: a slow sampler never makes the trainer queue more than ``window`` chunks for it). Replies on one
connection arrive in request order; a reply that does not decode, or is not the chunk asked for, ends the fetch
with a ``WeightsError``, as does a refusal (its reason in the message).
"""

from __future__ import annotations

import io
import logging
import os
import queue
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError, decode, encode
from cascade_rl.protocol.messages import WeightsChunk, WeightsGet, WeightsReady, WeightsRefused

from .common import Checksum, WeightsError, notice_uri, receive_dir
from .layout import Staging, Weights, layout

log = logging.getLogger(__name__)

FORMAT, SCHEME = "safetensors", "stream+tcp"  # its notices: WeightsReady.format, and the URI's scheme
STREAM_URI = re.compile(r"^stream\+tcp://(?P<addr>.+:\d+)/(?P<version>\d+)$")


# --------------------------------------------------------------------------- publisher


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


class StreamTransport:
    def __init__(self, run_id: str, keep: int = 2, endpoint: str = "tcp://0.0.0.0:0", host: str = "",
                 chunk_mb: int = 16) -> None:
        """``endpoint``: where the ROUTER binds (port 0: a free one); ``host``: the name samplers connect
        to (see the module docstring); ``chunk_mb``: the size of one reply frame."""
        self.keep, self.chunk = keep, chunk_mb << 20
        self.malformed = 0  # requests that could not be parsed (answered with a refusal when possible)
        self.dropped = 0  # replies to peers that vanished or stopped reading
        self._snapshots: dict[int, Snapshot] = {}
        self._parts: dict[tuple[int, str], Snapshot] = {}  # (version, part) -> a payload served with that version
        self._retired: Snapshot | None = None  # the last evicted version: its buffer is the next one's
        self._staging = Staging()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=1)  # its own IO thread: transfers never delay the trainer's sockets
        self._thread, self.endpoint, self.host, self.port = serve_in_thread(self._ctx, self._serve, endpoint,
                                                                            "weights-stream", host)

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
            self._parts = {key: p for key, p in self._parts.items() if key[0] in self._snapshots}
        return WeightsReady(version=version, uri=f"stream+tcp://{self.host}:{self.port}/{version}",
                            nbytes=len(snap.data), checksum=snap.checksum)

    def served(self, version: int) -> Snapshot | None:
        """The snapshot of ``version`` while it is served (weights/delta.py diffs the newest two). Its buffer is
        reused ``keep`` versions later: read it before publishing again."""
        with self._lock:
            return self._snapshots.get(version)

    def attach(self, version: int, part: str, data: np.ndarray) -> str:
        """Serve ``data`` (uint8, never changed afterwards) as ``part`` of the published ``version``, until that
        version is evicted (``WeightsGet.part``; weights/delta.py: the version's delta). Returns its checksum."""
        checksum = Checksum()
        checksum.update(data)
        snap = Snapshot(data, checksum.hexdigest())
        with self._lock:
            if version not in self._snapshots:
                raise WeightsError(f"stream: cannot attach {part!r} to version {version}: not served")
            self._parts[(version, part)] = snap
        return snap.checksum

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        auth.release(self._ctx)  # its ZAP handler, if any, would hold up term()
        self._ctx.term()
        self._snapshots.clear()

    # ------------------------------------------------------------------ server thread

    def _serve(self, endpoint: str, bound: queue.Queue) -> None:
        if (sock := bind_router(self._ctx, endpoint, bound, "stream")) is None:
            return
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
                snap = self._parts.get((version, request.part)) if request.part else self._snapshots.get(version)
                if snap is not None:
                    self._send_chunk(sock, identity, version, request.chunk, snap)
                    return
                served = sorted(self._snapshots)
            what = f"{request.part} of version {version}" if request.part else f"version {version}"
            reason = f"{what} is not served (evicted or never published); serving {served}"
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


def serve_in_thread(ctx: zmq.Context, serve, endpoint: str, name: str, host: str):
    """Run ``serve(endpoint, bound)`` on a daemon thread ``name``; it puts in ``bound`` the address its ROUTER
    bound (or the exception that stopped it). Returns (the thread, that address, the host samplers connect to:
    ``host``, else the bound one's, and the port); a failure to bind is raised here, with ``ctx`` released."""
    bound: queue.Queue = queue.Queue(1)
    thread = threading.Thread(target=serve, args=(endpoint, bound), name=name, daemon=True)
    thread.start()
    address = bound.get(timeout=30)
    if isinstance(address, Exception):
        auth.release(ctx)
        ctx.term()
        raise address
    bound_host, port = address.split("://", 1)[1].rsplit(":", 1)
    return thread, address, host or advertised_host(bound_host), int(port)


def bind_router(ctx: zmq.Context, endpoint: str, bound: queue.Queue, transport: str) -> zmq.Socket | None:
    """A transport's ROUTER bound at ``endpoint`` (a CURVE server when the run has keys: protocol/auth.py), its
    address put in ``bound``; None, with the reason in ``bound``, when it cannot bind."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises instead of vanishing
    sock.setsockopt(zmq.LINGER, 0)
    try:
        auth.bind(sock, endpoint)
    except Exception as e:
        sock.close()
        bound.put(WeightsError(f"{transport} weights transport cannot bind {endpoint}: {e}"))
        return None
    bound.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return sock


def advertised_host(address: str) -> str:
    if address not in ("0.0.0.0", "*", "::", "[::]"):
        return address
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


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


# --------------------------------------------------------------------------- receiver


def resolve(notice: WeightsReady, run_id: str, timeout_s: float, window: int = 4) -> str:
    """The notice's file, fetched into this process's receive folder and checked (size, checksum); ``timeout_s``
    bounds each wait for the publisher, ``window`` the requests in flight."""
    m = notice_uri(STREAM_URI, notice, f"stream+tcp://HOST:PORT/{notice.version}")
    folder = receive_dir(run_id)
    path = folder / f"policy-v{notice.version:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.connect(sock, f"tcp://{m['addr']}")  # CURVE client when the run has keys (protocol/auth.py)
    try:
        with open(tmp, "wb") as f:
            nbytes, checksum, announced = _receive(sock, notice, f, timeout_s, window)
        if notice.nbytes and nbytes != notice.nbytes:
            raise WeightsError(f"streamed weights v{notice.version}: {nbytes} bytes, notice says {notice.nbytes}")
        if checksum != (notice.checksum or announced):  # a notice without one: the publisher's
            raise WeightsError(f"streamed weights v{notice.version} from {m['addr']} fail their checksum")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        sock.close(linger=0)
    _keep_newest(folder, path, 2)  # the engine has loaded the older ones by now
    return str(path)


def fetch_part(addr: str, version: int, part: str, timeout_s: float, window: int = 4) -> np.ndarray:
    """``part`` of ``version`` (``StreamTransport.attach``) from the publisher at ``addr`` (HOST:PORT), in memory,
    checked against the checksum its replies announce."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.connect(sock, f"tcp://{addr}")
    buf = io.BytesIO()
    try:
        nbytes, checksum, announced = _receive(sock, WeightsReady(version=version, uri=f"tcp://{addr}"), buf,
                                               timeout_s, window, part)
    finally:
        sock.close(linger=0)
    if checksum != announced:
        raise WeightsError(f"{part} of weights v{version} from {addr} fails its checksum")
    return np.frombuffer(buf.getbuffer(), np.uint8)[:nbytes]


def _receive(sock: zmq.Socket, notice: WeightsReady, f, timeout_s: float, window: int,
             part: str = "") -> tuple[int, str, str]:
    """Fetch every chunk of ``notice.version`` (or of its ``part``) in order into ``f``; (bytes received, their
    checksum, the checksum the publisher's last reply announced)."""
    version, addr = notice.version, notice.uri
    checksum = Checksum()  # holds each chunk's frame (through the array viewing it) until hashed
    try:
        sock.send_multipart(encode(WeightsGet(version=version, chunk=0, part=part)))
        sent, got, chunks, nbytes = 1, 0, 1, 0
        while got < chunks:
            if not sock.poll(int(timeout_s * 1000)):
                raise WeightsError(f"no reply from the weights publisher {addr} in {timeout_s:g}s "
                                   f"(chunk {got}): is the trainer up and its weights host reachable from here?")
            reply = _reply(sock.recv_multipart(copy=False), version, got)
            if got == 0:
                chunks = reply.chunks
                while sent < min(chunks, window):
                    sock.send_multipart(encode(WeightsGet(version=version, chunk=sent, part=part)))
                    sent += 1
            data = reply.data  # a read-only view of the received frame: no copy
            f.write(data)
            checksum.update(data)
            nbytes += len(data)
            got += 1
            if sent < chunks:
                sock.send_multipart(encode(WeightsGet(version=version, chunk=sent, part=part)))
                sent += 1
        if nbytes != reply.nbytes:
            raise WeightsError(f"streamed weights v{version}: {nbytes} bytes, publisher says {reply.nbytes}")
    finally:
        digest = checksum.hexdigest()
    return nbytes, digest, reply.checksum


def _reply(frames: list, version: int, chunk: int) -> WeightsChunk:
    """The publisher's reply to the request for ``chunk`` of ``version``, or the ``WeightsError`` saying why not."""
    try:
        reply = decode(frames, (WeightsChunk, WeightsRefused))
    except ProtocolError as e:
        raise WeightsError(f"weights publisher sent a malformed reply: {e}") from None
    if isinstance(reply, WeightsRefused):
        raise WeightsError(f"weights v{version}: publisher refused: {reply.reason}")
    if reply.version != version or reply.chunk != chunk:
        raise WeightsError(f"weights publisher sent v{reply.version} chunk {reply.chunk}, "
                           f"expected v{version} chunk {chunk}")
    return reply


def _keep_newest(folder: Path, current: Path, keep: int) -> None:
    """Delete all but ``current`` and the newest ``keep - 1`` others."""
    others = [p for p in sorted(folder.glob("policy-v*.safetensors")) if p != current]
    for old in others[: max(0, len(others) - (keep - 1))]:
        old.unlink(missing_ok=True)

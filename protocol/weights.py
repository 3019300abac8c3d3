"""Receiving side of weight transports: resolve a ``WeightsReady`` to a verified local file.

The publishing side lives with the trainer (learner/weights.py). Whatever the
transport, a sampler ends up with one local safetensors file whose size and
checksum match the notice, and loads it by path (torch engine, vLLM, SGLang).
Resolvers are registered by URI scheme:

* ``file://PATH`` (``shm`` transport): a file in /dev/shm (or any shared path),
  written with an atomic rename; checked in place and returned as is.
* ``stream+tcp://HOST:PORT/VERSION`` (``stream`` transport, for hosts without a
  shared file system): fetched from the trainer's ROUTER in chunks, written
  under this process's receive folder (``receive_dir``, in /dev/shm) with an
  atomic rename; the folder keeps the returned file and the newest other one.

Checksum (both transports, both sides): XXH3-128 (xxhash), as
hex, over the bytes of the safetensors file in order -- what ``file_checksum``
of the file gives. The stream sends exactly the file's bytes, so the receiver
hashes the chunks as they arrive and never re-reads what it wrote. (A notice
without a checksum is checked against the one in the publisher's replies.)

Stream wire protocol (DEALER of the sampler -> ROUTER of the trainer): messages of the codec like
every other (protocol/codec.py, protocol/messages.py; a msgpack header frame, the data in a frame of
its own, received zero-copy):

    request   WeightsGet(version, chunk)
    reply     WeightsChunk(version, chunk, chunks, nbytes, checksum, data)
    refusal   WeightsRefused(version, reason)

Chunk ``i`` is bytes ``[i*S, min((i+1)*S, nbytes))`` of the file (``S`` is the
publisher's chunk size; ``chunks`` tells the count). The receiver asks for
chunk 0, then keeps at most ``window`` requests in flight (credit-based flow
control: a slow sampler never makes the trainer queue more than ``window``
chunks for it). Replies on one connection arrive in request order; a reply
that does not decode, or is not the chunk asked for, ends the fetch with a
``WeightsError``, as does a refusal (its reason in the message).
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
import zmq

from . import auth
from .codec import ProtocolError, decode, encode
from .messages import WeightsChunk, WeightsGet, WeightsReady, WeightsRefused
from .registry import Registry

STREAM_URI = re.compile(r"^stream\+tcp://(?P<addr>.+:\d+)/(?P<version>\d+)$")

RESOLVERS = Registry("weights uri scheme")  # scheme -> fn(notice, run_id, timeout_s) -> local path


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


class WeightsError(RuntimeError):
    """A weights notice that cannot be honoured (missing file, bad checksum, unknown format)."""


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


def resolve(notice: WeightsReady, run_id: str = "", timeout_s: float = 30.0) -> str:
    """Local path of the weights announced by ``notice``, after checking size and checksum.
    ``run_id`` names the folder streamed weights land in; ``timeout_s`` bounds each wait for the
    publisher (stream)."""
    if notice.format != "safetensors":
        raise WeightsError(f"weights format {notice.format!r} not supported")
    scheme = notice.uri.split("://", 1)[0] if "://" in notice.uri else ""
    if scheme not in RESOLVERS:
        raise WeightsError(f"weights uri {notice.uri!r}: scheme not resolvable here; known: {sorted(RESOLVERS)}")
    return RESOLVERS[scheme](notice, run_id, timeout_s)


@RESOLVERS.register("file")
def resolve_file(notice: WeightsReady, run_id: str, timeout_s: float) -> str:
    path = Path(notice.uri[len("file://") :])
    if not path.is_file():
        raise WeightsError(f"weights file {path} is gone (version {notice.version})")
    if notice.nbytes and path.stat().st_size != notice.nbytes:
        raise WeightsError(f"weights file {path} has {path.stat().st_size} bytes, notice says {notice.nbytes}")
    if notice.checksum and file_checksum(path) != notice.checksum:
        raise WeightsError(f"weights file {path} fails its checksum")
    return str(path)


# --------------------------------------------------------------------------- stream


@RESOLVERS.register("stream+tcp")
def resolve_stream(notice: WeightsReady, run_id: str, timeout_s: float, window: int = 4) -> str:
    m = STREAM_URI.match(notice.uri)
    if m is None or int(m["version"]) != notice.version:
        raise WeightsError(f"weights uri {notice.uri!r}: want stream+tcp://HOST:PORT/{notice.version}")
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


def _receive(sock: zmq.Socket, notice: WeightsReady, f, timeout_s: float, window: int) -> tuple[int, str, str]:
    """Fetch every chunk of ``notice.version`` in order into ``f``; (bytes received, their checksum,
    the checksum the publisher's last reply announced)."""
    version, addr = notice.version, notice.uri
    checksum = Checksum()  # holds each chunk's frame (through the array viewing it) until hashed
    try:
        sock.send_multipart(encode(WeightsGet(version=version, chunk=0)))
        sent, got, chunks, nbytes = 1, 0, 1, 0
        while got < chunks:
            if not sock.poll(int(timeout_s * 1000)):
                raise WeightsError(f"no reply from the weights publisher {addr} in {timeout_s:g}s "
                                   f"(chunk {got}): is the trainer up and its weights host reachable from here?")
            reply = _reply(sock.recv_multipart(copy=False), version, got)
            if got == 0:
                chunks = reply.chunks
                while sent < min(chunks, window):
                    sock.send_multipart(encode(WeightsGet(version=version, chunk=sent)))
                    sent += 1
            data = reply.data  # a read-only view of the received frame: no copy
            f.write(data)
            checksum.update(data)
            nbytes += len(data)
            got += 1
            if sent < chunks:
                sock.send_multipart(encode(WeightsGet(version=version, chunk=sent)))
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

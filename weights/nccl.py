"""The ``nccl`` weight transport: the trainer (rank 0) broadcasts each version to the samplers that ask for it, over
a torch.distributed process group of its own -- NCCL when the trainer's weights are on CUDA (samplers on other
GPUs, other hosts; a sampler on the trainer's own GPU cannot be in its NCCL group: use cuda_ipc there), gloo
otherwise (and in the CPU tests).

    cascade-rl launch tiny weights_transport=nccl weights_options.nccl.host=10.0.0.1

Samplers apply a notice at their own safe point and join or leave at any time, but a collective needs every member
present. So there is no fixed group: a sampler *asks* the trainer's ROUTER for the notice's version
(``WeightsJoin``, protocol/weights_group.py); the publisher's thread gathers the askers for ``gather_ms`` after the
first ask -- or less, once the askers are exactly a group it holds, each holding it too, and include everyone served
in the last two versions (so groups that parted merge again) -- then tells each its rank (``WeightsGroup``) and
broadcasts the newest version to them. A sampler that does not ask delays the others by ``gather_ms`` at most: the
round goes without it, and it is served in a round of its own when it asks.

Publisher (``NcclTransport``): ``publish`` copies the weights into a staging buffer (one flat copy of the data
section of the safetensors file layout.py lays out: file order, every tensor aligned) on the backend's device --
the trainer's GPU for NCCL (a device-to-device copy: ~ ``keep`` x the model's bytes of GPU memory), host memory for
gloo -- and returns once copied; the broadcast reads only the staging copy, so the trainer's next step never waits
for a sampler and never changes what is sent. A buffer being broadcast is never reused. Groups are built without the
default process group (the trainer's FSDP group is not touched): a ``PrefixStore`` per group over a ``TCPStore`` the
publisher hosts, and ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed directly, rank 0 the publisher. A
group is cached by its members: the same receivers asking again, each still holding it, reuse it; any other set (a
new or restarted sampler, one that missed a round) gets a new group under a new prefix -- a new communicator: about
a second for NCCL -- and the cached groups of its members are dropped (a receiver holds one group per publisher).
An asker that is gone by the round (its socket closed) fails the round before any rendezvous; one that is told its
rank and never joins fails it after ``timeout_s`` (the others keep their weights and ask again).

Receiver (nccl_receiver.py ``load``): the notice's URI is ``nccl+tcp://HOST:PORT/VERSION?timeout=S`` (the
publisher's ROUTER, and its ``timeout_s``; a sampler waits 2 x S for its answer: a round in progress first). It
asks, joins (or reuses) the group, receives the bytes in ``chunk``-sized broadcasts into a buffer it keeps (the
engine's GPU for NCCL), checks them -- the header's XXH3-128 against the notice's ``checksum``, every tensor's
dtype, shape and offsets against ``nbytes``, and on gloo the data's XXH3-128 -- and hands the engine views
(``load_tensors``, which copies) or, for an engine that loads files only, the safetensors file. An ask not served in
time, a refusal, a failed rendezvous or broadcast: ``WeightsError`` (the sampler keeps its weights). The engine gets
the version broadcast, which may be newer than the notice's. LoRA adapters: refused (full weights only).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import xxhash
import zmq

from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError, decode, encode
from cascade_rl.protocol.messages import WeightsReady, WeightsRefused
from cascade_rl.protocol.weights_group import WeightsGroup, WeightsJoin

from .common import WeightsError
from .layout import Weights, layout
from .stream import bind_router, serve_in_thread

log = logging.getLogger(__name__)

FORMAT, SCHEME = "nccl", "nccl+tcp"  # its notices: WeightsReady.format, and the URI's scheme
NCCL_URI = re.compile(r"^nccl\+tcp://(?P<addr>.+:\d+)/(?P<version>\d+)\?timeout=(?P<timeout>[0-9.e+-]+)$")
MAX_GROUPS = 8  # groups the publisher keeps for reuse (a group whose member died is dropped after this many more)


def backend_for(option: str, device: torch.device) -> str:
    """``auto``: NCCL for weights on CUDA, else gloo."""
    if option == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if option == "nccl" and not torch.cuda.is_available():
        raise WeightsError("weights_options.nccl.backend=nccl needs CUDA; this process has none (use gloo or auto)")
    return option


def make_group(backend: str, store, prefix: str, rank: int, size: int, timeout_s: float):
    """A process group of ``size`` on ``store`` under ``prefix``, outside the default group. gloo's rendezvous
    happens here (it waits for every rank, up to ``timeout_s``); NCCL's at the first collective."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"{prefix}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, size, options)


def broadcast(pg, buf: torch.Tensor, chunk: int) -> None:
    """``buf`` from rank 0 to every rank, in pieces of ``chunk`` bytes (the same calls on every rank)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for start in range(0, buf.numel(), chunk):
        pg.broadcast([buf[start : start + chunk]], opts).wait()
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


# --------------------------------------------------------------------------- publisher


@dataclass
class Staged:
    """A published version's bytes (the file's data section), header and checksums; ``busy`` while broadcast."""

    version: int
    buf: torch.Tensor
    header: bytes
    checksum: str = ""  # XXH3-128 of buf, hashed at its first broadcast (gloo only: a GPU buffer is not hashed)
    busy: bool = False


@dataclass
class Ask:
    identity: bytes  # the ROUTER identity to answer
    version: int
    group: str  # the group the asker holds ("" none)


@dataclass
class Group:
    prefix: str
    members: tuple[str, ...]  # member ids in rank order (rank i + 1)
    pg: object = None


class NcclTransport:
    def __init__(self, run_id: str, keep: int = 2, endpoint: str = "tcp://0.0.0.0:0", host: str = "",
                 gather_ms: int = 200, timeout_s: float = 60.0, backend: str = "auto", chunk_mb: int = 64) -> None:
        """``endpoint``: where the ROUTER binds (port 0: a free one; the store takes another free port);
        ``host``: the name samplers connect to (stream.py); ``gather_ms``: how long a round waits for askers;
        ``timeout_s``: the longest wait of a rendezvous and of a broadcast (a sampler's for its answer: twice it);
        ``backend``: auto, nccl or gloo; ``keep``: staging buffers kept for reuse (>= 2); ``chunk_mb``: MiB per
        broadcast."""
        if keep < 2:
            raise ValueError(f"nccl: keep must be >= 2 (one buffer broadcast while the next is written), got {keep}")
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"nccl: backend must be auto, nccl or gloo, got {backend!r}")
        self.keep, self.gather_s, self.timeout_s = keep, gather_ms / 1000, timeout_s
        self.option, self.backend, self.chunk = backend, "", chunk_mb << 20
        self.counts = {"rounds": 0, "groups": 0, "failed": 0, "malformed": 0, "refused": 0}
        self.last_round: dict = {}  # version, members, new_group, seconds of the last broadcast
        self._id = f"{run_id[-24:]}-{uuid.uuid4().hex[:8]}"  # group prefixes: unique to this publisher
        self._serial = itertools.count(1)
        self._staged: list[Staged] = []
        self._newest: Staged | None = None
        self._pending: dict[str, Ask] = {}  # member -> its ask, for the next round
        self._first_ask = 0.0
        self._groups: dict[tuple[str, ...], Group] = {}  # members -> group, oldest first
        self._served: dict[int, set[str]] = {}  # the members served each version, the last two versions
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))  # every group's rendezvous
        self._ctx = zmq.Context(io_threads=1)
        self._thread, self.endpoint, self.host, self.port = serve_in_thread(self._ctx, self._serve, endpoint,
                                                                            "weights-nccl", host)

    def publish(self, weights: Weights, version: int) -> WeightsReady:
        """Copy ``weights`` (a module, a state dict or a ``TensorSource``) into a staging buffer; samplers are
        served it from the thread. Returns once the copy is done."""
        lay = layout(weights)
        if not self.backend:
            self.backend = backend_for(self.option, lay.device)
        device = torch.device("cpu")
        if self.backend == "nccl":
            device = lay.device if lay.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        nbytes, start = lay.nbytes - len(lay.header), len(lay.header)
        with self._lock:  # a buffer neither broadcast nor the newest, of the right size, is reused
            free = [s for s in self._staged if not s.busy and s is not self._newest
                    and s.buf.numel() == nbytes and s.buf.device == device]
            if free:
                self._staged.remove(free[0])
        buf = free[0].buf if free else torch.empty(nbytes, dtype=torch.uint8, device=device)
        for t, offset in lay.tensors():
            buf[offset - start : offset - start + t.numel()].copy_(t)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)  # the broadcast thread reads it on another stream
        staged = Staged(version, buf, bytes(lay.header))
        with self._lock:
            self._staged.append(staged)
            self._newest = staged
            spare = [s for s in self._staged if not s.busy and s is not staged]
            for s in spare[: max(0, len(self._staged) - self.keep)]:
                self._staged.remove(s)
        return WeightsReady(version=version, uri=f"nccl+tcp://{self.host}:{self.port}/{version}"
                            f"?timeout={self.timeout_s:g}", format=FORMAT, nbytes=nbytes,
                            checksum=xxhash.xxh3_128(staged.header).hexdigest())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        auth.release(self._ctx)
        self._ctx.term()
        self._groups.clear()
        self._staged.clear()
        self._newest = None

    # ------------------------------------------------------------------ server thread

    def _serve(self, endpoint: str, bound: queue.Queue) -> None:
        if (sock := bind_router(self._ctx, endpoint, bound, "nccl")) is None:
            return
        try:
            while not self._stop.is_set():
                if sock.poll(self._wait_ms()):
                    self._take(sock)
                if self._due():
                    self._round(sock)
        finally:
            sock.close(linger=0)

    def _wait_ms(self) -> int:
        if not self._pending:
            return 100  # the stop flag is checked at least every 100 ms
        return max(0, min(100, int((self._first_ask + self.gather_s - time.monotonic()) * 1000) + 1))

    def _due(self) -> bool:
        """A round starts ``gather_ms`` after the first ask, or as soon as the askers are a cached group, each
        holding it, and include every member served in the last two versions' rounds (else groups that parted
        would never merge again: each complete on its own, each its own broadcast)."""
        if not self._pending:
            return False
        group = self._groups.get(tuple(sorted(self._pending)))
        recent = set().union(*self._served.values())
        if group is not None and recent <= set(group.members) and all(
                a.group == group.prefix for a in self._pending.values()):
            return True
        return time.monotonic() >= self._first_ask + self.gather_s

    def _take(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)
        identity, version = frames[0].bytes, -1
        try:
            ask = decode(frames[1:], (WeightsJoin,))
            version = ask.version
            newest = self._newest
            if newest is None or ask.version > newest.version:
                self.counts["refused"] += 1
                served = "nothing yet" if newest is None else f"v{newest.version}"
                self._send(sock, identity, WeightsRefused(version, f"version {version} is not published ({served})"))
                return
            if self.backend not in ask.backends:  # e.g. a sampler process without CUDA: it would fail the round
                self.counts["refused"] += 1
                reason = (f"this trainer broadcasts over {self.backend}, which the asker cannot receive (it can: "
                          f"{'/'.join(ask.backends)}): set weights_options.nccl.backend=gloo")
                self._send(sock, identity, WeightsRefused(version, reason))
                return
            if not self._pending:
                self._first_ask = time.monotonic()
            self._pending[ask.member] = Ask(identity, ask.version, ask.group)
        except ProtocolError as e:
            self.counts["malformed"] += 1
            reason = f"malformed request: {str(e):.300}"
            log.warning("weights nccl: %s", reason)
            self._send(sock, identity, WeightsRefused(-1, reason))
        except Exception as e:  # never let one request stop the server
            log.exception("weights nccl: request failed")
            self._send(sock, identity, WeightsRefused(version, f"publisher error: {e}"))

    def _round(self, sock: zmq.Socket) -> None:
        """Tell every asker its rank in the group of exactly the askers (reused or new), then broadcast the
        newest version to them."""
        asks, self._pending = self._pending, {}
        members = tuple(sorted(asks))
        with self._lock:
            staged = self._newest
            staged.busy = True
        t0 = time.monotonic()
        group = self._groups.pop(members, None)
        new = group is None or any(a.group != group.prefix for a in asks.values())
        if new:
            group = Group(f"{self._id}-{next(self._serial)}", members)
            for key in [k for k in self._groups if set(k) & set(members)]:  # stale: its members hold the new one
                del self._groups[key]
        try:
            if self.backend == "gloo" and not staged.checksum:
                staged.checksum = xxhash.xxh3_128(staged.buf.numpy()).hexdigest()
            header = np.frombuffer(staged.header, np.uint8)
            told = [self._send(sock, asks[member].identity, WeightsGroup(
                version=staged.version, store=f"{self.host}:{self.store.port}", group=group.prefix, rank=rank,
                size=len(members) + 1, backend=self.backend, nbytes=staged.buf.numel(), chunk=self.chunk,
                checksum=staged.checksum, header=header)) for rank, member in enumerate(members, start=1)]
            if not all(told):  # an asker that gave up (its socket closed) would never join: no rendezvous
                raise WeightsError(f"{told.count(False)} asker(s) gone before the round")
            if group.pg is None:
                group.pg = make_group(self.backend, self.store, group.prefix, 0, len(members) + 1, self.timeout_s)
                self.counts["groups"] += 1
            broadcast(group.pg, staged.buf, self.chunk)
        except Exception as e:
            self.counts["failed"] += 1
            log.warning("weights nccl: v%d to %s failed (group %s dropped): %s", staged.version, members,
                        group.prefix, e)
            return
        finally:
            with self._lock:
                staged.busy = False
        self._groups[members] = group  # newest last
        while len(self._groups) > MAX_GROUPS:
            del self._groups[next(iter(self._groups))]
        self._served.setdefault(staged.version, set()).update(members)
        for v in sorted(self._served)[:-2]:
            del self._served[v]
        self.counts["rounds"] += 1
        self.last_round = {"version": staged.version, "members": members, "new_group": new,
                           "seconds": time.monotonic() - t0}

    def _send(self, sock: zmq.Socket, identity: bytes, msg) -> bool:
        try:
            sock.send_multipart([identity, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # the asker is gone (ROUTER_MANDATORY) or not reading
            log.warning("weights nccl: could not answer an asker (gone)")
            return False

"""The ``nccl`` weight transport's receiver (a sampler's side; the publisher and the design: nccl.py).

``load(engine, notice, run_id)``: ask the trainer's ROUTER for ``notice.version`` (``WeightsJoin``), join the process
group the answer names (``WeightsGroup``; reused while the publisher reuses it), receive the broadcast into a buffer
kept per engine and publisher (on the engine's GPU for NCCL), check it against the notice and the answer, and hand
the engine views of it. Every failure is a ``WeightsError``: the sampler keeps its weights and applies a later notice.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import uuid
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash
import zmq

from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError, decode, encode
from cascade_rl.protocol.messages import WeightsReady, WeightsRefused
from cascade_rl.protocol.weights_group import WeightsGroup, WeightsJoin

from .common import WeightsError, notice_uri, receive_dir
from .layout import SAFETENSORS_DTYPES
from .nccl import NCCL_URI, broadcast, make_group
from .stream import _keep_newest

log = logging.getLogger(__name__)


@dataclass
class Held:
    """One engine's standing with one publisher: its member id, the group it holds, and its receive buffer."""

    member: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    prefix: str = ""
    pg: object = None
    store: object = None
    store_addr: str = ""  # HOST:PORT of ``store``
    buf: torch.Tensor | None = None


HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {publisher HOST:PORT -> Held}


def load(engine, notice: WeightsReady, run_id: str) -> None:
    """Ask the publisher for ``notice.version``, receive the broadcast, check it, hand it to ``engine``."""
    m = notice_uri(NCCL_URI, notice, f"nccl+tcp://HOST:PORT/{notice.version}?timeout=S", full_only="nccl")
    addr, timeout_s = m["addr"], _seconds(m["timeout"], notice.uri)
    held = HELD.setdefault(engine, {}).setdefault(addr, Held())
    backends = ["gloo", "nccl"] if torch.cuda.is_available() else ["gloo"]
    reply = ask(addr, WeightsJoin(notice.version, held.member, held.prefix, backends), 2 * timeout_s)  # a round
    # in progress first (a rendezvous, a broadcast: each up to timeout_s), then ours
    try:  # told a rank: take part whatever the checks below say, or the round fails for everyone in it
        buf = receive(held, reply, timeout_s, getattr(engine, "device", None))
    except Exception as e:  # the group is unusable: the next ask makes a new one
        held.prefix, held.pg = "", None
        raise WeightsError(f"nccl weights v{reply.version} from {addr}: broadcast failed: {e}") from None
    if reply.version < notice.version:
        raise WeightsError(f"nccl weights: asked for v{notice.version}, sent v{reply.version}")
    entries, header = parse_header(reply), reply.header.tobytes()
    if reply.version == notice.version and xxhash.xxh3_128(header).hexdigest() != notice.checksum:
        raise WeightsError(f"nccl weights v{notice.version}: the header served is not the one announced")
    if reply.checksum and buf.is_cpu and xxhash.xxh3_128(buf.numpy()).hexdigest() != reply.checksum:
        raise WeightsError(f"nccl weights v{reply.version} from {addr} fail their checksum")
    hand(engine, buf, entries, header, reply.version, run_id)
    log.info("weights v%d: received by %s broadcast (%d bytes, rank %d of %d)", reply.version, reply.backend,
             reply.nbytes, reply.rank, reply.size)


def _seconds(text: str, uri: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WeightsError(f"weights uri {uri!r}: timeout {text!r} is not a number of seconds") from None


def ask(addr: str, join: WeightsJoin, timeout_s: float) -> WeightsGroup:
    """The publisher's answer to ``join`` (``WeightsError`` if refused, malformed or not served in time)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.connect(sock, f"tcp://{addr}")
    try:
        sock.send_multipart(encode(join))
        if not sock.poll(int(timeout_s * 1000)):
            raise WeightsError(f"nccl weights v{join.version}: not served by {addr} within {timeout_s:g}s: is the "
                               "trainer up, its host reachable, and weights_options.nccl.timeout_s long enough?")
        try:
            reply = decode(sock.recv_multipart(copy=False), (WeightsGroup, WeightsRefused))
        except ProtocolError as e:
            raise WeightsError(f"nccl weights publisher {addr} sent a malformed reply: {e}") from None
    finally:
        sock.close(linger=0)
    if isinstance(reply, WeightsRefused):
        raise WeightsError(f"nccl weights v{join.version}: publisher refused: {reply.reason}")
    return reply


def parse_header(reply: WeightsGroup) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, start, end) in the data section, every entry checked against ``reply.nbytes``."""
    raw = reply.header.tobytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (start, end) = SAFETENSORS_DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), \
                e["data_offsets"]
            size = dtype.itemsize
            for d in shape:
                size *= d
            if not (0 <= start <= end <= reply.nbytes and end - start == size and start % dtype.itemsize == 0):
                raise ValueError(f"{name}: {e['dtype']} {list(shape)} at [{start}, {end}) of {reply.nbytes} bytes")
            out[name] = (dtype, shape, start, end)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise WeightsError(f"nccl weights v{reply.version}: header refused: {str(e)[:200]}") from None
    return out


def receive(held: Held, reply: WeightsGroup, timeout_s: float, device) -> torch.Tensor:
    """Join (or reuse) the group ``reply`` names and receive the broadcast into ``held``'s buffer."""
    if reply.backend == "nccl":
        device = device if isinstance(device, torch.device) and device.type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if reply.group != held.prefix or held.pg is None:
        held.prefix, held.pg = "", None  # the old group is not used again (the publisher dropped it too)
        if held.store is None or held.store_addr != reply.store:  # a restarted trainer hosts another store
            host, port = reply.store.rsplit(":", 1)
            held.store_addr = reply.store
            held.store = dist.TCPStore(host, int(port), is_master=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
        held.pg = make_group(reply.backend, held.store, reply.group, reply.rank, reply.size, timeout_s)
        held.prefix = reply.group
    if held.buf is None or held.buf.numel() != reply.nbytes or held.buf.device != device:
        held.buf = torch.empty(reply.nbytes, dtype=torch.uint8, device=device)
    broadcast(held.pg, held.buf, reply.chunk)
    return held.buf


def hand(engine, buf: torch.Tensor, entries: dict, header: bytes, version: int, run_id: str) -> None:
    """The received weights to the engine: views (``load_tensors`` copies them), else a safetensors file by path."""
    if hasattr(engine, "load_tensors"):
        engine.load_tensors({name: buf[s:e].view(dtype).reshape(shape)
                             for name, (dtype, shape, s, e) in entries.items()}, version)
        return
    path = receive_dir(run_id) / f"policy-v{version:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(buf.cpu().numpy().tobytes())
    os.replace(tmp, path)
    _keep_newest(path.parent, path, 2)
    engine.load_weights(str(path), version)

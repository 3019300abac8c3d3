"""Every weight transport by name: its publisher (the trainer's side) and its receiver (a sampler's side).

    transport = TRANSPORTS[cfg.weights_transport](run_id=..., **cfg.weights_options[cfg.weights_transport])  # the trainer
    notice = transport.publish(policy, version)                                         # -> WeightsReady
    load(engine, notice, run_id)                                                        # a sampler

A notice names no transport: a sampler finds the receiver by the notice's ``format`` and its URI's scheme
(``receiver``), each pair registered once. ``shm`` and ``stream`` land a verified local safetensors file
(``resolve``) that the engine loads by path (``load_file``); ``cuda_ipc`` hands the engine views of the trainer's
GPU buffer; ``delta`` applies the elements that changed to the copy the sampler keeps, or loads the full file
(delta.py); ``nccl`` broadcasts each version to the samplers that ask for it over a process group of
its own (nccl.py). ``bench/weight_transport.py`` times them against a memory copy; ``bench/delta_weights.py`` delta vs stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.registry import Registry

from . import cuda_ipc, delta, nccl, nccl_receiver, shm, stream
from .common import WeightsError

RESOLVE_TIMEOUT_S = 30.0  # a sampler's longest wait for each reply of the publisher (stream)


@dataclass(frozen=True)
class Receiver:
    """A sampler's side of one transport."""

    format: str  # WeightsReady.format of the transport's notices
    scheme: str  # the scheme of their URI
    load: Callable[[Any, WeightsReady, str], None]  # fn(engine, notice, run_id): the engine holds the notice's weights
    resolve: Callable[[WeightsReady, str, float], str] | None = None  # fn(notice, run_id, timeout_s) -> a local
    # file, checked against the notice (transports that land a safetensors file)


TRANSPORTS = Registry("weight transport")  # name -> publisher class(run_id, keep=2, **options) with
# publish(weights, version) -> WeightsReady and close()
RECEIVERS = Registry("weight transport")  # name -> its Receiver


def register(name: str, publisher: type, receiver: Receiver) -> None:
    """Register both sides of transport ``name`` (a second transport of that name, or of the same notice format
    and scheme, is refused)."""
    if any((r.format, r.scheme) == (receiver.format, receiver.scheme) for r in RECEIVERS.values()):
        raise ValueError(f"weight transport {name!r}: notices of format {receiver.format!r} and scheme "
                         f"{receiver.scheme!r} are another transport's")
    TRANSPORTS.register(name)(publisher)
    RECEIVERS.register(name)(receiver)


def receiver(notice: WeightsReady) -> Receiver:
    """The receiver of ``notice``'s transport (``WeightsError`` naming the known ones if none is registered)."""
    same_format = [r for r in RECEIVERS.values() if r.format == notice.format]
    if not same_format:
        known = sorted({r.format for r in RECEIVERS.values()})
        raise WeightsError(f"weights format {notice.format!r} not supported; known: {known}")
    scheme = notice.uri.split("://", 1)[0] if "://" in notice.uri else ""
    for r in same_format:
        if r.scheme == scheme:
            return r
    known = sorted(r.scheme for r in same_format)
    raise WeightsError(f"weights uri {notice.uri!r}: scheme not resolvable here; known: {known}")


def load(engine, notice: WeightsReady, run_id: str) -> None:
    """Apply ``notice`` to ``engine`` by its transport's receiver (``TornRead``: the engine holds a mix)."""
    receiver(notice).load(engine, notice, run_id)


def resolve(notice: WeightsReady, run_id: str = "", timeout_s: float = RESOLVE_TIMEOUT_S) -> str:
    """Local path of the safetensors file announced by ``notice``, after checking size and checksum.
    ``run_id`` names the folder streamed weights land in; ``timeout_s`` bounds each wait for the
    publisher (stream)."""
    found = receiver(notice)
    if found.resolve is None:
        raise WeightsError(f"weights format {notice.format!r} not supported")
    return found.resolve(notice, run_id, timeout_s)


def load_file(engine, notice: WeightsReady, run_id: str) -> None:
    """``shm`` and ``stream``: a verified local safetensors file, loaded by path; a LoRA run's (``notice.adapter``)
    is an adapter, which the engine applies over its base (weights/adapters.py)."""
    path = resolve(notice, run_id)
    if notice.adapter:
        if not hasattr(engine, "load_adapter"):
            raise WeightsError(f"version {notice.version} is a LoRA adapter and the {type(engine).__name__} cannot "
                               "load adapters")
        engine.load_adapter(path, notice.version, notice.adapter)
    else:
        engine.load_weights(path, notice.version)


register("shm", shm.ShmTransport, Receiver(shm.FORMAT, shm.SCHEME, load_file, shm.resolve))
register("stream", stream.StreamTransport, Receiver(stream.FORMAT, stream.SCHEME, load_file, stream.resolve))
register("cuda_ipc", cuda_ipc.CudaIpcTransport, Receiver(cuda_ipc.FORMAT, cuda_ipc.SCHEME, cuda_ipc.load))
register("delta", delta.DeltaTransport, Receiver(delta.FORMAT, delta.SCHEME, delta.load))
register("nccl", nccl.NcclTransport, Receiver(nccl.FORMAT, nccl.SCHEME, nccl_receiver.load))

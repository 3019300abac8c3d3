"""The ``weights_options`` section of the launch schema: the options of each weight transport, one dataclass per
transport, checked where declared (``__post_init__``: supervisor/config.py ``validate`` builds each section once).
The trainer hands the chosen transport's section to its constructor as keyword arguments:

    cascade-rl launch tiny weights_transport=stream weights_options.stream.chunk_mb=8 host=10.0.0.1

``TRANSPORTS[weights_transport](run_id=..., **weights_options[weights_transport])`` (the transport registry).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _check_keep(transport: str, keep: int) -> None:
    if keep < 1:
        raise ValueError(f"weights_options.{transport}.keep must be >= 1, got {keep}")


@dataclass
class ShmOptions:
    """``shm``: each version a safetensors file under /dev/shm (one machine)."""

    keep: int = 2
    """Versions kept as files (at most this many in /dev/shm, the one being written included; 2 is the least that
    lets a sampler finish reading one version while the next is written)."""

    def __post_init__(self) -> None:
        _check_keep("shm", self.keep)


@dataclass
class StreamOptions:
    """``stream``: the file in chunks over ZeroMQ (hosts without a shared file system)."""

    keep: int = 2
    """Versions kept in memory to serve (host memory ~ (keep + 1) x the model's bytes)."""
    endpoint: str = "tcp://0.0.0.0:0"
    """Where the trainer's ROUTER binds (port 0: a free one)."""
    host: str = ""
    """The name samplers connect to. Empty: this node's address in a Ray run, else the run's ``host``, else the
    bound address or this machine's hostname."""
    chunk_mb: int = 16
    """MiB in one reply frame."""

    def __post_init__(self) -> None:
        _check_keep("stream", self.keep)
        if self.chunk_mb < 1:
            raise ValueError(f"weights_options.stream.chunk_mb must be >= 1, got {self.chunk_mb}")


@dataclass
class CudaIpcOptions:
    """``cuda_ipc``: samplers read the trainer's GPU buffers in place (trainer and samplers on one GPU)."""

    keep: int = 2
    """GPU byte buffers (version v goes to buffer v % keep; 2 = double buffering: a sampler still copying one
    version never sees the next written over it)."""

    def __post_init__(self) -> None:
        _check_keep("cuda_ipc", self.keep)


@dataclass
class DeltaOptions:
    """``delta``: each version as the elements that changed since the one before (weights/delta.py), over a stream
    ROUTER that also serves every version's full file (a sampler that fell behind or refused a delta loads it)."""

    keep: int = 2
    """Versions served in memory, full file and delta (>= 2: the delta of v is taken against v-1's file; host
    memory ~ (keep + 1) x the model's bytes, as the stream's)."""
    endpoint: str = "tcp://0.0.0.0:0"
    """Where the trainer's ROUTER binds (port 0: a free one)."""
    host: str = ""
    """The name samplers connect to (as ``stream.host``)."""
    chunk_mb: int = 16
    """MiB in one reply frame."""
    zlib_level: int = 0
    """zlib level for a delta's index bytes, kept only where it saves an eighth of them; 0: never compress (at 50m
    level 1 saved ~20% of a delta's bytes for ~80 ms of the trainer's publish: worth it below ~200 Mb/s links)."""

    def __post_init__(self) -> None:
        if self.keep < 2:
            raise ValueError(f"weights_options.delta.keep must be >= 2 (the delta of v is taken against v-1), "
                             f"got {self.keep}")
        if self.chunk_mb < 1:
            raise ValueError(f"weights_options.delta.chunk_mb must be >= 1, got {self.chunk_mb}")
        if not 0 <= self.zlib_level <= 9:
            raise ValueError(f"weights_options.delta.zlib_level must be in 0..9, got {self.zlib_level}")


@dataclass
class NcclOptions:
    """``nccl``: each version broadcast by the trainer (rank 0) to the samplers that ask for it, over a
    torch.distributed process group of its own (weights/nccl.py): NCCL for samplers on other GPUs, gloo on CPUs."""

    keep: int = 2
    """Staging copies of the weights kept for reuse (>= 2: one being broadcast while the trainer publishes the next;
    memory ~ keep x the model's bytes, on the trainer's GPU with NCCL)."""
    endpoint: str = "tcp://0.0.0.0:0"
    """Where the trainer's ROUTER binds, which samplers ask to be served at (port 0: a free one). The group's
    TCPStore listens on another free port, and the backend opens its own connections (gloo: GLOO_SOCKET_IFNAME,
    NCCL: NCCL_SOCKET_IFNAME choose the interface)."""
    host: str = ""
    """The name samplers connect to (as ``stream.host``)."""
    gather_ms: int = 200
    """How long a round waits for askers after the first (unless every member of a group already held has asked):
    a sampler that asks later is served in a round of its own."""
    timeout_s: float = 60.0
    """The longest wait of a group's rendezvous and of a broadcast (a sampler waits twice this for its answer: a round
    in progress first); past it the sampler keeps its weights (WeightsError) and the group is dropped."""
    backend: str = "auto"
    """auto (NCCL when the trainer's weights are on CUDA, else gloo), nccl or gloo."""
    chunk_mb: int = 64
    """MiB per broadcast call (the receivers get the version in this many pieces)."""

    def __post_init__(self) -> None:
        if self.keep < 2:
            raise ValueError(f"weights_options.nccl.keep must be >= 2 (one copy broadcast while the next is "
                             f"written), got {self.keep}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"weights_options.nccl.backend must be auto, nccl or gloo, got {self.backend!r}")
        if self.gather_ms < 0 or self.timeout_s <= 0 or self.chunk_mb < 1:
            raise ValueError(f"weights_options.nccl: gather_ms >= 0, timeout_s > 0 and chunk_mb >= 1, got "
                             f"{self.gather_ms}, {self.timeout_s}, {self.chunk_mb}")


@dataclass
class WeightsOptions:
    """One section per built-in transport; only the chosen one (``weights_transport``) is used."""

    shm: ShmOptions = field(default_factory=ShmOptions)
    """Options of weights_transport=shm."""
    stream: StreamOptions = field(default_factory=StreamOptions)
    """Options of weights_transport=stream."""
    cuda_ipc: CudaIpcOptions = field(default_factory=CudaIpcOptions)
    """Options of weights_transport=cuda_ipc."""
    delta: DeltaOptions = field(default_factory=DeltaOptions)
    """Options of weights_transport=delta."""
    nccl: NcclOptions = field(default_factory=NcclOptions)
    """Options of weights_transport=nccl."""

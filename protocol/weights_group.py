"""Wire types of the ``nccl`` weight transport (weights/nccl.py): a sampler asks the trainer's ROUTER to be
served a version, and is told which process group to join for its broadcast. A refusal is ``WeightsRefused``
(protocol/messages.py), as on the stream's ROUTER.

Kept out of messages.py only so that two people could add them at once; they belong with the other weights
messages there.
"""

from __future__ import annotations

import re
from dataclasses import field

import numpy as np

from .codec import array, message

MEMBER = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")  # a receiver's id: printable, short (it names a group's member)


@message("weights_join")
class WeightsJoin:
    """sampler → trainer's nccl ROUTER: serve me weights ``version`` (or a newer one) in the next broadcast.
    ``member``: this receiver's id, the same for every ask of one engine in one process; ``group``: the prefix of
    the process group it holds with this publisher ("" none), which the publisher reuses when the same members
    ask again; ``backends``: those it can receive over (nccl only where its process has CUDA)."""

    version: int
    member: str
    group: str = ""
    backends: list[str] = field(default_factory=lambda: ["gloo"])

    def validate(self) -> str:
        if self.version < 0:
            return f"version {self.version}"
        if not MEMBER.match(self.member):
            return f"member id {self.member[:80]!r}: want 1-64 of [A-Za-z0-9._:-]"
        if len(self.group) > 64:
            return f"group name of {len(self.group)} characters"
        return "" if len(self.backends) <= 4 else f"{len(self.backends)} backends"


@message("weights_group")
class WeightsGroup:
    """trainer's nccl ROUTER → sampler: join process group ``group`` (a prefix on the trainer's store at ``store``,
    HOST:PORT) as ``rank`` of ``size`` over ``backend`` (a group the sampler holds already: reused), then receive
    weights ``version``: ``nbytes`` bytes broadcast by rank 0 in pieces of ``chunk`` bytes, the data section of
    the safetensors file whose header (the u64 length and the JSON) is ``header``. ``checksum``: XXH3-128 (hex) of
    those bytes, "" when they are not hashed (staged on a GPU)."""

    version: int
    store: str
    group: str
    rank: int
    size: int
    backend: str
    nbytes: int
    chunk: int
    checksum: str
    header: np.ndarray = array("uint8")

    def validate(self) -> str:
        if self.version < 0 or self.nbytes < 0 or self.chunk < 1:
            return f"version {self.version}, nbytes {self.nbytes}, chunk {self.chunk}"
        if not 1 <= self.rank < self.size:
            return f"rank {self.rank} of {self.size} (rank 0 is the publisher)"
        if self.backend not in ("gloo", "nccl"):
            return f"backend {self.backend[:16]!r}"
        return "" if 1 <= len(self.group) <= 64 else f"group name of {len(self.group)} characters"

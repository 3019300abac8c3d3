"""How many groups a step dispatches: replacements for filtered groups, and over-dispatch from the running keep
rate (``orchestrator.over_dispatch``): rules, no IO.

    rate = KeepRate()
    n = to_dispatch(missing=wanted - kept, in_flight=len(waiting), keep_rate=rate.value, most=cfg.over_dispatch)
    ...
    rate.add(kept=len(settled), settled=len(done))

A step needs ``prompts_per_step`` kept groups. Without over-dispatch (``most`` = 1) it keeps exactly what it still
needs in flight: a group filtered for uniform rewards is replaced as soon as it is settled, not when the step's
last group is. With ``most`` > 1 it keeps what it still needs divided by the fraction of groups kept so far
(dynamic filtering's running rate), at most ``most`` times it, so the replacements a filtered group would need are
already sampling; what is still in flight when the step is complete is cancelled as surplus (orchestrator/core.py
``cancel``): sampled for nothing, the price of not waiting for refills.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

WINDOW = 256  # settled groups the keep rate is taken over (the last ones: the rate drifts as the policy learns)


PRIOR = 4  # groups' worth of "all kept" the rate starts from: one filtered group does not triple a step


@dataclasses.dataclass
class KeepRate:
    """The fraction of the last ``WINDOW`` settled groups that were kept, after ``PRIOR`` kept ones (1.0 before any
    settled)."""

    settled: deque = dataclasses.field(default_factory=lambda: deque(maxlen=WINDOW))

    @property
    def value(self) -> float:
        return (sum(self.settled) + PRIOR) / (len(self.settled) + PRIOR)

    def add(self, kept: int, settled: int) -> None:
        """``settled`` groups settled, ``kept`` of them kept (the others filtered or stale)."""
        self.settled.extend([1] * kept + [0] * (settled - kept))


def to_dispatch(missing: int, in_flight: int, keep_rate: float, most: float) -> int:
    """Groups to dispatch now: enough that the ``in_flight`` ones are expected to yield the ``missing`` kept groups
    (``missing / keep_rate``, at most ``most`` x ``missing``; ``most`` <= 1: ``missing`` itself), less those in
    flight."""
    if missing <= 0:
        return 0
    wanted = missing if most <= 1 else min(math.ceil(missing / max(keep_rate, 1e-6)), math.ceil(most * missing))
    return max(0, wanted - in_flight)

"""A step's groups to the trainer in parts, as they are scored (``orchestrator.stream_tokens``): rules, no IO.

    parts = Assembly(wanted=16, dp=2, stream_tokens=4096)
    for ready in parts.add(kept_groups):      # as groups are scored and kept
        send(ready.groups, ready.index, ready.last)

The trainer runs each part's forward and backward as it comes and steps the optimizer after the last
(learner/step.py), so training overlaps the tail of the step's sampling and scoring, and a straggling group
holds only the update. A part holds whole groups, at least ``stream_tokens`` tokens of them (prompt and
response), and a multiple of ``dp`` groups (each data-parallel rank takes an equal share of every part); the
last part is whatever completes the step. ``stream_tokens = 0``: one part, the whole step (a barrier). Each
part is split among the data-parallel ranks (``shares``): as many groups each, their tokens balanced, so no rank
waits for another with the longer rows; each rank is sent its own share (no broadcast from rank 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .groups import Group


@dataclasses.dataclass
class Part:
    """Groups sent together: the ``index``-th part of the step, ``last`` when it completes it."""

    groups: list[Group]
    index: int
    last: bool


def tokens(g: Group) -> int:
    """What a group costs the trainer: its rows' prompt and response tokens."""
    return sum(len(r.prompt_ids) + len(r.response_ids) for r in g.rollouts.values())


@dataclasses.dataclass
class Assembly:
    wanted: int  # groups the step trains on
    dp: int = 1  # the trainer's data-parallel ranks (divides ``wanted``)
    stream_tokens: int = 0  # tokens that make a part (0: the whole step in one)
    pending: list[Group] = dataclasses.field(default_factory=list)  # kept, not sent yet
    sent: int = 0  # groups sent
    parts: int = 0  # parts sent
    order: Callable[[Group], int] | None = None  # pending groups are taken in this order (the dispatch order: a
    # batch's rows do not depend on which group happened to be scored first)

    def __post_init__(self) -> None:
        if self.wanted < 1 or self.dp < 1 or self.wanted % self.dp:
            raise ValueError(f"a step of {self.wanted} groups on {self.dp} data-parallel ranks")

    @property
    def done(self) -> bool:
        return self.sent == self.wanted

    def add(self, kept: list[Group]) -> list[Part]:
        """``kept`` groups (scored, kept for the step) in; the parts to send now out, in order."""
        self.pending += kept
        if self.order is not None:
            self.pending.sort(key=self.order)
        if self.sent + len(self.pending) > self.wanted:
            raise ValueError(f"{self.sent + len(self.pending)} groups kept for a step of {self.wanted}")
        out = []
        while self.pending:
            if self.sent + len(self.pending) == self.wanted:
                take = len(self.pending)  # the step is complete: everything, the last part
            elif self.stream_tokens:
                take = self._enough()
            else:
                take = 0
            if not take:
                break
            out.append(self._part(take))
        return out

    def _enough(self) -> int:
        """The fewest pending groups (a multiple of ``dp``) holding ``stream_tokens``; 0 if they do not yet."""
        total = 0
        for i, g in enumerate(self.pending, 1):
            total += tokens(g)
            if total >= self.stream_tokens and i % self.dp == 0:
                return i
        return 0

    def _part(self, take: int) -> Part:
        groups, self.pending = self.pending[:take], self.pending[take:]
        self.sent += take
        self.parts += 1
        return Part(groups, self.parts - 1, self.done)


def shares(groups: list[Group], dp: int) -> list[list[Group]]:
    """``groups`` (a multiple of ``dp``) as ``dp`` shares of as many groups each, their tokens balanced: the
    longest group first to the share with the fewest tokens among those not yet full (each share in the groups'
    order)."""
    per = len(groups) // dp
    if per * dp != len(groups):
        raise ValueError(f"{len(groups)} groups do not split among {dp} data-parallel ranks")
    load, taken = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(groups)), key=lambda i: -tokens(groups[i])):
        rank = min((r for r in range(dp) if len(taken[r]) < per), key=lambda r: load[r])
        taken[rank].append(i)
        load[rank] += tokens(groups[i])
    return [[groups[i] for i in sorted(t)] for t in taken]

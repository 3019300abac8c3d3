"""A step's rows as the trainer holds them: ``Part`` as they came (packed: every per-token tensor the rows' tokens
one after another), ``Batch`` right-padded (a micro-batch, what the model and the losses take).

    part = Part.from_message(msg).to(device)      # packed, on the trainer's device
    for sl in part.groups(micro_batch_groups):    # whole groups
        mb = part.rows(sl)                        # a Batch, as wide as its own longest row
    batch = Batch.from_message(msg)               # every row at once, padded to the longest

A step's longest row pays only for its own micro-batch: the others are as wide as theirs, and nothing is padded
in host memory or moved padded to the device (at the paper's lengths the engine's routes alone are 276 bytes a
token: a part padded to its longest 49K row would be several times the tokens it holds).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cascade_rl.protocol.messages import TrainBatch
from cascade_rl.protocol.rows import offsets

PER_TOKEN = ("input_ids", "response_mask", "loss_mask", "inf_logprobs", "teacher_logprobs", "routes")


def _tensors(obj) -> dict[str, torch.Tensor]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), torch.Tensor)}


@dataclasses.dataclass
class Batch:
    """Rows ordered group by group, right-padded to the longest."""

    input_ids: torch.Tensor  # [N, L] long
    lengths: torch.Tensor  # [N] real tokens per row (the wire's: a row may end on context tokens)
    response_mask: torch.Tensor  # [N, L] bool: response tokens
    loss_mask: torch.Tensor  # [N, L] bool: response tokens that carry loss (not of a masked group)
    inf_logprobs: torch.Tensor  # [N, L]
    rewards: torch.Tensor  # [N]
    group_size: int
    teacher_logprobs: torch.Tensor | None = None  # [N, L], MOPD
    routes: torch.Tensor | None = None  # [N, L, MoE layers, top_k] int16, the engine's experts (-1: none)
    segment_starts: torch.Tensor | None = None  # [N, S] where each row's later segments start (-1: none; §14)

    @classmethod
    def from_message(cls, msg: TrainBatch) -> Batch:
        """Every row of the message, padded to the longest (host memory; ``to`` moves them)."""
        part = Part.from_message(msg)
        return part.rows(slice(0, len(part.rewards)))

    @property
    def attention_mask(self) -> torch.Tensor:
        return (torch.arange(self.input_ids.shape[1], device=self.lengths.device)[None, :]
                < self.lengths[:, None]).long()

    def to(self, device: torch.device) -> Batch:
        """Every tensor on ``device``."""
        return dataclasses.replace(self, **{k: v.to(device, non_blocking=True) for k, v in _tensors(self).items()})

    def rows(self, sl: slice) -> Batch:
        """Rows ``sl`` (whole groups) as a batch of their own, as wide as their longest row."""
        width = int(self.lengths[sl].max()) if len(self.lengths[sl]) else 0  # one sync a micro-batch
        return dataclasses.replace(self, **{k: v[sl, :width] if k in PER_TOKEN else v[sl]
                                            for k, v in _tensors(self).items()})

    def groups(self, per_chunk: int):
        """Micro-batches of ``per_chunk`` whole groups (0: all of them), as row slices."""
        return _groups(len(self.rewards) // self.group_size, self.group_size, per_chunk)


@dataclasses.dataclass
class Part:
    """A ``TrainBatch`` as tensors, packed as it came: per-token fields [T, ...], T = sum(lengths)."""

    input_ids: torch.Tensor  # [T] long
    lengths: torch.Tensor  # [N] long
    response_mask: torch.Tensor  # [T] bool
    loss_mask: torch.Tensor  # [T] bool: response tokens of rows that carry loss
    inf_logprobs: torch.Tensor  # [T]
    rewards: torch.Tensor  # [N]
    group_size: int
    starts: list[int]  # [N + 1] where each row starts in the per-token tensors (host: slicing needs no sync)
    teacher_logprobs: torch.Tensor | None = None  # [T]
    routes: torch.Tensor | None = None  # [T, MoE layers, top_k] int16
    segment_starts: torch.Tensor | None = None  # [N, S]

    @classmethod
    def from_message(cls, msg: TrainBatch) -> Part:
        lengths = np.asarray(msg.lengths, np.int64)
        loss_mask = np.array(msg.response_mask, bool)
        if msg.loss_masked is not None:
            loss_mask &= ~np.repeat(np.asarray(msg.loss_masked, bool), lengths)

        def tensor(values):  # the decoded frames are read-only: torch gets its own copy
            return None if values is None else torch.from_numpy(np.array(values))

        return cls(
            input_ids=torch.from_numpy(msg.input_ids.astype(np.int64)),
            lengths=torch.from_numpy(lengths),
            response_mask=tensor(msg.response_mask),
            loss_mask=torch.from_numpy(loss_mask),
            inf_logprobs=tensor(msg.inf_logprobs),
            rewards=tensor(msg.rewards),
            group_size=msg.group_size,
            starts=offsets(lengths).tolist(),
            teacher_logprobs=tensor(msg.teacher_logprobs),
            routes=tensor(msg.routes),
            segment_starts=tensor(msg.segment_starts),
        )

    def to(self, device: torch.device) -> Part:
        """Every tensor on ``device`` (the trainer's: the message arrives in host memory), still packed."""
        return dataclasses.replace(self, **{k: v.to(device, non_blocking=True) for k, v in _tensors(self).items()})

    def rows(self, sl: slice) -> Batch:
        """Rows ``sl`` (whole groups) right-padded to their own longest, on the part's device."""
        a, b = self.starts[sl.start], self.starts[sl.stop]
        sizes = [self.starts[i + 1] - self.starts[i] for i in range(sl.start, sl.stop)]
        width = max(sizes, default=0)
        lengths, n = self.lengths[sl], len(sizes)
        full = all(size == width for size in sizes)  # no row shorter: each field a view
        if not full:  # where each token goes in the padded [n * width], found once for every field
            dest = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).flatten().nonzero()[:, 0]

        def padded(values, fill=0):
            if values is None:
                return None
            rest = values.shape[1:]
            if full:
                return values[a:b].view(n, width, *rest)
            out = values.new_full((n * width, *rest), fill)
            return out.index_copy_(0, dest, values[a:b]).view(n, width, *rest)

        return Batch(
            input_ids=padded(self.input_ids), lengths=lengths, response_mask=padded(self.response_mask, False),
            loss_mask=padded(self.loss_mask, False), inf_logprobs=padded(self.inf_logprobs),
            rewards=self.rewards[sl], group_size=self.group_size, teacher_logprobs=padded(self.teacher_logprobs),
            routes=padded(self.routes, -1),
            segment_starts=None if self.segment_starts is None else self.segment_starts[sl])

    def groups(self, per_chunk: int):
        """Micro-batches of ``per_chunk`` whole groups (0: all of them), as row slices."""
        return _groups(len(self.rewards) // self.group_size, self.group_size, per_chunk)


def _groups(n_groups: int, group_size: int, per_chunk: int):
    per_chunk = per_chunk or n_groups
    for g0 in range(0, n_groups, per_chunk):
        yield slice(g0 * group_size, min(n_groups, g0 + per_chunk) * group_size)

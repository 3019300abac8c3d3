"""Rows of several segments: an agent that rewrote its history (docs/ARCHITECTURE.md §14) leaves one row per
trajectory whose later segments each start afresh (their own prompt, the model's tokens after it). Each segment is
its own sequence for the model: no token attends across a segment start, positions restart. The row stays one row
of its group for everything else (its reward, its advantage, the group's token mean), so GRPO's groups keep their
shape.

    split = Split.of(input_ids, lengths, response_mask, routes, segment_starts)   # [N, L] -> [N', L']
    logprobs, entropy = policy(split.input_ids, split.lengths, split.target_mask, routes=split.routes)
    logprobs = split.join(logprobs)                                                # [N', L'] -> [N, L]

A batch without segments (``segment_starts`` None) never comes here: nothing is copied.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass
class Split:
    """Each segment of each row as a row of its own, and where its tokens came from."""

    input_ids: Tensor  # [N', L'] right-padded
    lengths: Tensor  # [N']
    target_mask: Tensor  # [N', L']
    routes: Tensor | None  # [N', L', layers, k]
    source_rows: Tensor  # [N'] the row each segment is of
    offsets: Tensor  # [N'] where it starts in its row
    shape: tuple[int, int]  # the rows' [N, L]

    @classmethod
    def of(cls, input_ids: Tensor, lengths: Tensor, target_mask: Tensor, routes: Tensor | None,
           starts: Tensor) -> Split:
        """``starts`` [N, S]: the positions where each row's later segments begin (-1: none)."""
        pieces = []  # (row, start, end)
        for r, (n, row_starts) in enumerate(zip(lengths.tolist(), starts.tolist())):
            cuts = [0, *(s for s in row_starts if 0 < s < n), n]
            pieces += [(r, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        width = max(b - a for _, a, b in pieces)
        rows = torch.tensor([p[0] for p in pieces], device=input_ids.device)
        offsets = torch.tensor([p[1] for p in pieces], device=input_ids.device)
        piece_lengths = torch.tensor([b - a for _, a, b in pieces], device=input_ids.device)
        cols = offsets[:, None] + torch.arange(width, device=input_ids.device)[None, :]  # [N', L'] source columns
        inside = torch.arange(width, device=input_ids.device)[None, :] < piece_lengths[:, None]
        cols = torch.where(inside, cols, 0)
        gather = (rows[:, None].expand_as(cols), cols)
        pad = torch.zeros((), dtype=input_ids.dtype, device=input_ids.device)
        mask = target_mask[gather] & inside
        mask[:, 0] = False  # a segment's first token has no prediction (its prompt's first token, never the model's)
        split_routes = None
        if routes is not None:
            split_routes = torch.where(inside[..., None, None], routes[gather], torch.full_like(routes[gather], -1))
        return cls(torch.where(inside, input_ids[gather], pad), piece_lengths, mask, split_routes, rows, offsets,
                   tuple(input_ids.shape))

    def join(self, values: Tensor | None) -> Tensor | None:
        """Per-token values of the segments [N', L'] back in their rows' places [N, L] (0 where none)."""
        if values is None:
            return None
        out = values.new_zeros(self.shape)
        width = values.shape[1]
        cols = self.offsets[:, None] + torch.arange(width, device=values.device)[None, :]
        inside = torch.arange(width, device=values.device)[None, :] < self.lengths[:, None]
        rows = self.source_rows[:, None].expand_as(cols)
        return out.index_put((rows[inside], cols[inside]), values[inside])


def forward_rows(model, input_ids: Tensor, lengths: Tensor, target_mask: Tensor, starts: Tensor | None,
                 routes: Tensor | None = None, **kwargs) -> tuple[Tensor, Tensor | None]:
    """``model(input_ids, lengths, target_mask, routes=routes, **kwargs)`` (a ``Policy``), each segment of a row its
    own sequence when ``starts`` marks any (else the call as it is)."""
    if starts is None or not bool((starts >= 0).any()):
        return model(input_ids, lengths, target_mask, routes=routes, **kwargs)
    split = Split.of(input_ids, lengths, target_mask, routes, starts)
    logprobs, entropy = model(split.input_ids, split.lengths, split.target_mask, routes=split.routes, **kwargs)
    return split.join(logprobs), split.join(entropy)

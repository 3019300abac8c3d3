"""A ``TrainBatch``'s rows, packed: every per-token array holds the rows' tokens one after another, and
``lengths`` [N] says where each row ends. Pure numpy, no IO.

    offsets(lengths)                 # [N + 1] where each row starts in the packed arrays (and where the last ends)
    pad(batch.inf_logprobs, lengths) # [N, max(lengths)] right-padded with 0 (the trainer's micro-batches)
    msg = from_padded(step=0, group_size=4, input_ids=ids, response_mask=mask, ...)  # from right-padded arrays

Padding never travels: a step's rows at the paper's lengths are long-tailed (a few rows of 49K tokens among many
of 2K), and the engine's routes cost layers x top_k x 2 bytes a token (Nemotron-3-Nano: 276), so a right-padded
batch would ship mostly padding.
"""

from __future__ import annotations

import numpy as np

from .messages import TrainBatch


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Row lengths [N] -> [N + 1] int64 starts (0 first, the total last)."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def pad(values: np.ndarray, lengths: np.ndarray, fill=0, width: int | None = None) -> np.ndarray:
    """Packed [T, ...] -> right-padded [N, width, ...] (width: the longest row unless given), ``fill`` after each
    row's tokens."""
    lengths = np.asarray(lengths, np.int64)
    width = int(lengths.max(initial=0)) if width is None else width
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit a width of {width}")
    out = np.full((len(lengths), width, *values.shape[1:]), fill, values.dtype)
    out[np.arange(width)[None, :] < lengths[:, None]] = values  # row-major: the rows' tokens in order
    return out


def flatten(padded: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Right-padded [N, L, ...] -> packed [sum(lengths), ...] (each row's first ``lengths[i]`` entries)."""
    lengths = np.asarray(lengths, np.int64)
    return np.ascontiguousarray(padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]])


def padded_lengths(response_mask: np.ndarray) -> np.ndarray:
    """Each right-padded row's tokens when it ends with its last response token (single-turn rows)."""
    positions = np.arange(1, response_mask.shape[1] + 1)
    return np.where(response_mask, positions, 0).max(axis=1, initial=0).astype(np.int32)


def from_padded(*, input_ids: np.ndarray, response_mask: np.ndarray, inf_logprobs: np.ndarray,
                lengths: np.ndarray | None = None, teacher_logprobs: np.ndarray | None = None,
                routes: np.ndarray | None = None, **fields) -> TrainBatch:
    """A ``TrainBatch`` from right-padded [N, L] arrays (``lengths``: each row's tokens; default: up to its last
    response token); the other fields (step, group_size, rewards, versions, ...) as they are."""
    lengths = padded_lengths(np.asarray(response_mask, bool)) if lengths is None else np.asarray(lengths, np.int32)
    packed = {name: None if value is None else flatten(np.asarray(value), lengths)
              for name, value in dict(input_ids=input_ids, response_mask=response_mask, inf_logprobs=inf_logprobs,
                                      teacher_logprobs=teacher_logprobs, routes=routes).items()}
    return TrainBatch(lengths=lengths, **packed, **fields)

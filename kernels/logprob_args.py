"""The arguments every ``linear_logprobs`` implementation takes: modeling/logprobs.py's chunked torch path and
kernels/logprob.py's Triton kernel check them the same way. Here, in kernels/, because the dependency arrow runs
learner → kernels only (docs/ARCHITECTURE.md §1); plain torch, so importing it loads no Triton."""

from __future__ import annotations

from torch import Tensor


def check_args(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> None:
    """Raise ValueError unless hidden is [N, H], weight [V, H], targets [N] and chunk_tokens >= 1."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"want hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != weight's {weight.shape[1]}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

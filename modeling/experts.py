"""Which code runs the experts of an HF Qwen3-MoE model: ``model.moe_impl`` = grouped | hf | torch | triton.

    use_moe_impl(model, "triton")       # before training; a no-op for dense models

- ``grouped`` (the default): kernels/moe.py's ``experts_grouped``, transformers' grouped_mm path with
  ``index_select`` / ``index_add`` gathers instead of advanced indexing (whose backward, an accumulating
  ``index_put_``, was 10 % of a tiny-model training step on CPU): a training step 1.12x faster at the
  tiny model, 1.07x at 50m.
- ``hf``: transformers' own experts implementation (5.19 defaults to ``grouped_mm``:
  ``torch._grouped_mm`` forward and backward; 1.25x the torch reference at the tiny demo shape).
- ``torch``: kernels/moe.py's torch reference (sort by expert, padded bmm; no Python loop).
- ``triton``: kernels/moe.py's Triton kernels (kernels/moe_blocked.py: block-padded permutation,
  grouped GEMMs with fused SwiGLU, combine; forward and backward). CUDA; on CPU only in Triton's
  interpreter (``TRITON_INTERPRET=1``, tests).

Only the experts step is replaced (through transformers' experts-implementation registry), by
the experts the torch engine runs too (kernels/moe.py ``EXPERTS``, HF's weight layout);
HF's router, its top-k renormalisation and its router-logit outputs stay as they are, so
the four give the same numbers (tests/test_experts.py).
"""

from __future__ import annotations

from torch import nn

from ..kernels.moe import moe_experts  # triton only when impl="triton" runs (kernels/moe_blocked.py)
from .choices import MoeImpl

MOE_IMPLS = tuple(MoeImpl)
_REGISTERED: set[str] = set()


def _registered(impl: str) -> str:
    """The experts-implementation name under which ``impl`` is registered with transformers."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = f"cascade_{impl}"
    if name not in _REGISTERED:
        def experts(self, hidden_states, top_k_index, top_k_weights):  # HF's argument order
            return moe_experts(hidden_states, top_k_weights, top_k_index, self.gate_up_proj, self.down_proj,
                               impl=impl)

        ALL_EXPERTS_FUNCTIONS.register(name, experts)
        _REGISTERED.add(name)
    return name


def use_moe_impl(model: nn.Module, impl: str) -> nn.Module:
    """Run ``model``'s experts with ``impl``; models without experts are left alone."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"model.moe_impl={impl!r}: choose one of {MOE_IMPLS}")
    if impl == "hf" or not getattr(model.config, "num_experts", 0):
        return model
    model.set_experts_implementation(_registered(impl))
    return model

"""Which code runs the experts of an HF MoE model: ``model.moe_impl`` = grouped | hf | torch | triton.

    use_moe_impl(model, "triton")       # before training; a no-op for dense models

Every family of kernels/moe_families.py ``FAMILIES`` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3, Nemotron-H):
the family gives the experts' activation (SwiGLU, or Nemotron-H's squared ReLU without a gate).

- ``grouped`` (the default): kernels/moe.py's ``experts_grouped``, transformers' grouped_mm path with
  gathers and unique-index copies instead of advanced indexing (whose backward, an accumulating
  ``index_put_``, was 10 % of a tiny-model training step on CPU, and atomic adds on CUDA): a training step
  1.12x faster at the tiny model, 1.07x at 50m (measured with an ``index_add`` backward, since replaced by
  gathers for the same bits on every CUDA run).
- ``hf``: transformers' own experts implementation (5.19 defaults to ``grouped_mm``:
  ``torch._grouped_mm`` forward and backward; 1.25x the torch reference at the tiny demo shape).
- ``torch``: kernels/moe.py's torch reference (sort by expert, padded bmm; no Python loop).
- ``triton``: kernels/moe.py's Triton kernels (kernels/moe_blocked.py: block-padded permutation,
  grouped GEMMs with the activation fused, combine; forward and backward). CUDA; on CPU only in Triton's
  interpreter (``TRITON_INTERPRET=1``, tests).

Only the experts step is replaced (through transformers' experts-implementation registry), by
the experts the torch engine runs too (kernels/moe.py ``EXPERTS``, HF's weight layout);
HF's router, its top-k renormalisation, its router-logit outputs, the shared expert and Nemotron-H's latent
projections stay as they are, so the four give the same numbers (tests/test_experts.py,
tests/test_moe_families.py). transformers hands an experts function the experts module: ``gate_up_proj``
[E, 2I, H] for gated experts, ``up_proj`` [E, I, H] for those registered ``has_gate=False`` (Nemotron-H).
A model with experts of a type not in ``FAMILIES`` (gpt-oss) keeps transformers' own, with a warning.
"""

from __future__ import annotations

import logging

from torch import nn

from ..kernels.moe import moe_experts  # triton only when impl="triton" runs (kernels/moe_blocked.py)
from ..kernels.moe_families import moe_family
from .choices import MoeImpl

MOE_IMPLS = tuple(MoeImpl)
_REGISTERED: set[str] = set()
log = logging.getLogger(__name__)


def _registered(impl: str, activation: str) -> str:
    """The experts-implementation name under which ``impl`` with ``activation`` is registered with transformers."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = f"cascade_{impl}_{activation}"
    if name not in _REGISTERED:
        def experts(self, hidden_states, top_k_index, top_k_weights):  # HF's argument order
            first = self.gate_up_proj if self.has_gate else self.up_proj
            return moe_experts(hidden_states, top_k_weights, top_k_index, first, self.down_proj, impl=impl,
                               activation=activation)

        ALL_EXPERTS_FUNCTIONS.register(name, experts)
        _REGISTERED.add(name)
    return name


def use_moe_impl(model: nn.Module, impl: str) -> nn.Module:
    """Run ``model``'s experts with ``impl``; models without experts are left alone."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"model.moe_impl={impl!r}: choose one of {MOE_IMPLS}")
    family = moe_family(model.config)
    if impl == "hf":
        return model
    if family is None:
        if any(type(m).__name__.endswith("Experts") for m in model.modules()):
            log.warning("model.moe_impl=%s: model_type %r is not a kernels/moe_families.py family; its experts stay "
                        "transformers' own", impl, model.config.model_type)
        return model
    model.set_experts_implementation(_registered(impl, family.activation))
    return model

"""The MoE families, as data: what an HF config's MoE block does, in the terms of kernels/moe.py, for every reader
(the trainer's experts, modeling/experts.py; the routing replay, modeling/routing.py; the torch engine's MoE block)::

    family = moe_family(hf_config)           # None: no MoE layer (or a model type not described here)
    y = moe_block(x, family, block_weights(hf_block, family), impl="grouped")   # router + experts + shared expert

``MoeFamily`` says how the router scores, selects and weighs (``routing``: kernels/moe.py ``Routing``, with the
score-correction bias where ``correction_bias`` says), what the routed experts compute (``activation``, ``gated``),
and what the block adds around them (a shared expert, its sigmoid gate, latent projections). ``FAMILIES`` maps an HF
``model_type`` to the function that reads one from its config. Adding a family is one entry here and its case in
tests/test_moe_families.py (the description's block against transformers' own MoE block, values and gradients).

Served (transformers 5.19):
- ``qwen3_moe``: softmax top-k (``norm_topk_prob``), SwiGLU experts, no shared expert.
- ``qwen3_next``, ``qwen3_5_moe`` (its ``text_config``): the same router (Qwen3.5 always renormalises: its router
  has no ``norm_topk_prob``), SwiGLU experts, a SwiGLU shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
- ``deepseek_v3``: sigmoid_group_topk (``DeepseekV3TopkRouter``: the same code as Nemotron-H's, op for op),
  SwiGLU experts, an ungated SwiGLU shared expert of ``n_shared_experts`` experts' width.
- ``nemotron_h``: sigmoid_group_topk with the correction bias, ``routed_scaling_factor``, squared-ReLU experts
  without a gate (HF ``up_proj [E, I, H]``), a squared-ReLU shared expert, and optional latent projections
  (``moe_latent_size``: the experts run at the latent width between ``fc1_latent_proj`` and ``fc2_latent_proj``;
  the router and the shared expert see the full hidden state).

Not served: ``gpt_oss``. Its router (a linear layer with a bias, top-k of the logits, softmax over the k) would be a
small entry, but its experts are not these kernels' experts: biases on both projections, the weights stored
transposed ([E, H, 2I]), gate and up units interleaved, and a clamped SwiGLU (``(clamp(up) + 1) · g·σ(α·g)`` with
g clamped); and its block names its router ``router``, not ``gate``. It keeps transformers' own experts.

Run: ``.venv/bin/pytest -q tests/test_moe_families.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .moe import ACTIVATIONS, GATED, Impl, Routing, moe_experts, route


@dataclass(frozen=True)
class MoeFamily:
    """One MoE family's block, as data (every field is read by ``moe_block``; the routing by R3 too)."""

    routing: Routing  # how the router scores, selects and weighs (kernels/moe.py ROUTERS), with the config's k
    activation: str  # the routed experts' activation, a kernels/moe.py ``ACTIVATIONS`` name (swiglu | relu2)
    gated: bool  # the experts' first projection holds gate then up rows: HF's ``gate_up_proj [E, 2I, H]``;
    #              else HF's ``up_proj [E, I, H]`` (``@use_experts_implementation(has_gate=False)``)
    num_experts: int  # routed experts per MoE layer
    correction_bias: bool = False  # the router holds a score-correction bias [E] (``gate.e_score_correction_bias``,
    #                                a buffer): added to the scores for the choice only, never to the weights
    shared_expert: str | None = None  # the block's attribute holding a shared expert (an HF MLP run on every token
    #                                   and added to the routed output), or None: none
    shared_activation: str = "swiglu"  # the shared expert's activation (gated: gate_proj and up_proj; relu2: up_proj)
    shared_gate: bool = False  # the shared expert's output is scaled by sigmoid(shared_expert_gate(x)) (Qwen3-Next)
    latent: bool = False  # the experts run at a latent width: x → fc1_latent_proj → experts → fc2_latent_proj
    #                       (Nemotron-H ``moe_latent_size``); the router and the shared expert see x itself


# --- reading a family from an HF config ---------------------------------------------------------------------------

# HF ``hidden_act`` of a family's experts -> our activation: gated families use the act on their gate units
_GATED_ACTS = {"silu": "swiglu"}
_PLAIN_ACTS = {"relu2": "relu2"}


def _activation(act: str, gated: bool, model_type: str) -> str:
    table = _GATED_ACTS if gated else _PLAIN_ACTS
    if act not in table:
        raise NotImplementedError(f"{model_type}: experts with hidden_act={act!r} are not served by kernels/moe.py "
                                  f"(gated: {sorted(_GATED_ACTS)}, not gated: {sorted(_PLAIN_ACTS)})")
    return table[act]


def _qwen3_moe(c) -> MoeFamily:
    return MoeFamily(Routing(c.num_experts_per_tok, c.norm_topk_prob), _activation(c.hidden_act, True, "qwen3_moe"),
                     True, c.num_experts)


def _qwen3_next(c) -> MoeFamily:
    # Qwen3.5-MoE's router renormalises always (no norm_topk_prob in its config or router)
    return MoeFamily(Routing(c.num_experts_per_tok, getattr(c, "norm_topk_prob", True)),
                     _activation(c.hidden_act, True, c.model_type), True, c.num_experts,
                     shared_expert="shared_expert", shared_activation=_activation(c.hidden_act, True, c.model_type),
                     shared_gate=True)


def _sigmoid_routing(c) -> Routing:
    return Routing(c.num_experts_per_tok, c.norm_topk_prob, "sigmoid_group_topk", c.n_group, c.topk_group,
                   float(c.routed_scaling_factor))


def _deepseek_v3(c) -> MoeFamily:
    act = _activation(c.hidden_act, True, "deepseek_v3")
    return MoeFamily(_sigmoid_routing(c), act, True, c.n_routed_experts, correction_bias=True,
                     shared_expert="shared_experts", shared_activation=act)


def _nemotron_h(c) -> MoeFamily | None:
    if "moe" not in c.layers_block_type:
        return None
    if c.mlp_bias:  # Nano has none; the shared expert's and the latent projections' biases are not carried here
        raise NotImplementedError("nemotron_h with mlp_bias=True: the MoE block's biases are not served")
    act = _activation(c.mlp_hidden_act, False, "nemotron_h")
    return MoeFamily(_sigmoid_routing(c), act, False, c.n_routed_experts, correction_bias=True,
                     shared_expert="shared_experts", shared_activation=act, latent=c.moe_latent_size is not None)


FAMILIES: dict[str, Callable[[object], MoeFamily | None]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe_text": _qwen3_next,
    "deepseek_v3": _deepseek_v3,
    "nemotron_h": _nemotron_h,
}


def moe_family(config) -> MoeFamily | None:
    """The MoE family of an HF config (a composite config's text model's: Qwen3.5's ``text_config``); None for a
    model without MoE layers, or of a model type not in ``FAMILIES``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    read = FAMILIES.get(text.model_type)
    return None if read is None else read(text)


# --- the block ------------------------------------------------------------------------------------------------------


class MoeWeights(NamedTuple):
    """A block's tensors in HF's layout (views of its parameters where HF stores them so: gradients reach them)."""

    router: Tensor  # [E, H]
    gate_up: Tensor  # [E, 2I, L] (gated) or [E, I, L]; L = H, or the latent width
    down: Tensor  # [E, L, I]
    bias: Tensor | None = None  # [E] the router's correction bias (``MoeFamily.correction_bias``)
    shared_up: Tensor | None = None  # [2S, H] (gate rows then up rows) or [S, H]: the shared expert's first projection
    shared_down: Tensor | None = None  # [H, S]
    shared_gate: Tensor | None = None  # [1, H]: sigmoid gate of the shared expert's output
    latent_in: Tensor | None = None  # [L, H]: x to the experts' latent width (``MoeFamily.latent``)
    latent_out: Tensor | None = None  # [H, L]: back


def block_weights(block: nn.Module, family: MoeFamily) -> MoeWeights:
    """The tensors of an HF MoE block (``gate``, ``experts``, and the family's shared expert / latent layers)."""
    experts = block.experts
    shared = getattr(block, family.shared_expert) if family.shared_expert else None
    shared_up = None
    if shared is not None:
        gated_shared = GATED[family.shared_activation]
        up = shared.up_proj.weight
        shared_up = torch.cat([shared.gate_proj.weight, up]) if gated_shared else up
    return MoeWeights(
        router=block.gate.weight,
        gate_up=experts.gate_up_proj if family.gated else experts.up_proj,
        down=experts.down_proj,
        bias=block.gate.e_score_correction_bias if family.correction_bias else None,
        shared_up=shared_up,
        shared_down=None if shared is None else shared.down_proj.weight,
        shared_gate=block.shared_expert_gate.weight if family.shared_gate else None,
        latent_in=block.fc1_latent_proj.weight if family.latent else None,
        latent_out=block.fc2_latent_proj.weight if family.latent else None,
    )


def moe_block(x: Tensor, family: MoeFamily, w: MoeWeights, impl: Impl = "grouped") -> Tensor:
    """The family's MoE block on x [..., H]: our router (with the correction bias), our experts (``impl``), the
    latent projections around them and the shared expert beside them; HF's block of that family to rounding."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, ids = route(flat, w.router, family.routing, w.bias)
    inner = flat if w.latent_in is None else F.linear(flat, w.latent_in)
    y = moe_experts(inner, weights, ids, w.gate_up, w.down, impl, family.activation)
    if w.latent_out is not None:
        y = F.linear(y, w.latent_out)
    if w.shared_up is not None:
        shared = F.linear(ACTIVATIONS[family.shared_activation](F.linear(flat, w.shared_up), -1), w.shared_down)
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(flat, w.shared_gate)) * shared
        y = y + shared
    return y.view(x.shape)

"""Loading an HF causal LM the way the trainer and the teachers run it: dtype, attention, experts, device.

    device = role_device(cfg, "trainer")                    # protocol/devices.py: cpu, or cuda:LOCAL_RANK
    model = load_model(cfg.model.path, cfg, device)         # model.dtype, model.attn_impl, model.moe_impl

One function for every role that runs the trainer's forward (the trainer, its frozen
reference, the teacher servers, offline evaluation), so a teacher's log-probs of a
checkpoint are the trainer's, on the CPU in the tests and on a GPU (docs/ARCHITECTURE.md §10).
"""

from __future__ import annotations

import torch
from torch import nn

from cascade_rl.protocol.devices import MODEL_LOADING, torch_dtype

from .attention import resolve_attn_impl
from .experts import use_moe_impl


def load_model(path: str, cfg, device: torch.device | str = "cpu") -> nn.Module:
    """The HF model at ``path`` in ``model.dtype`` with ``model.attn_impl`` (auto: varlen on CUDA, sdpa on the
    CPU) and ``model.moe_impl`` experts, on ``device``."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    attn = resolve_attn_impl(cfg.model.attn_impl, device)
    with MODEL_LOADING:  # one load at a time in a process (roles are threads under launch --inline)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.model.dtype),
                                                     attn_implementation=attn)
        return use_moe_impl(model, cfg.model.moe_impl).to(device)


# How HF configs name their routed-expert count: Qwen3-MoE/Qwen3-Next num_experts, Nemotron-H/DeepSeek-V3
# n_routed_experts, gpt-oss/Mixtral num_local_experts.
EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer of an HF config (0: a dense model), whichever field its family uses."""
    return next((int(n) for f in EXPERT_COUNT_FIELDS if (n := getattr(config, f, None))), 0)


def describe(model: nn.Module) -> str:
    """Where and how ``model`` runs, for logs and heartbeats: 'cuda:0 (NVIDIA H200) bfloat16 varlen experts=...'."""
    p = next(model.parameters())
    name = f" ({torch.cuda.get_device_name(p.device)})" if p.device.type == "cuda" else ""
    experts = getattr(model.config, "_experts_implementation", None) if num_experts(model.config) else None
    return (f"{p.device}{name} {str(p.dtype).removeprefix('torch.')} {model.config._attn_implementation}"
            + (f" experts={experts}" if experts else ""))

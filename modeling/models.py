"""Loading an HF causal LM the way the trainer and the teachers run it: dtype, attention, experts, device.

    device = role_device(cfg, "trainer")                    # protocol/devices.py: cpu, or cuda:LOCAL_RANK
    model = load_model(cfg.model.path, cfg, device)         # model.dtype, model.attn_impl, model.moe_impl

One function for every role that runs the trainer's forward (the trainer, its frozen
reference, the teacher servers, offline evaluation), so a teacher's log-probs of a
checkpoint are the trainer's, on the CPU in the tests and on a GPU (docs/ARCHITECTURE.md §10).

A LoRA checkpoint (``trainer.lora``: peft's ``adapter_config.json`` + ``adapter_model.safetensors``, no full
weights; weights/adapters.py) loads as the plain HF model it stands for: its base (the config's
``base_model_name_or_path``) loaded the same way, the adapter applied by peft and merged into the weights
(``merge_adapter``), so every reader of a checkpoint takes an adapter checkpoint unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cascade_rl.protocol.devices import MODEL_LOADING, torch_dtype
from cascade_rl.weights.adapters import CONFIG_FILE, base_of, is_adapter

from .attention import resolve_attn_impl
from .experts import use_moe_impl


def load_model(path: str, cfg, device: torch.device | str = "cpu") -> nn.Module:
    """The HF model at ``path`` in ``model.dtype`` with ``model.attn_impl`` (auto: varlen on CUDA, sdpa on the
    CPU) and ``model.moe_impl`` experts, on ``device``."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    attn = resolve_attn_impl(cfg.model.attn_impl, device)
    adapter = path if is_adapter(path) else None
    if adapter is not None:  # a LoRA checkpoint: its base, merged with it (the plain HF model it stands for)
        path = adapter_base(adapter)
    with MODEL_LOADING:  # one load at a time in a process (roles are threads under launch --inline)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.model.dtype),
                                                         attn_implementation=attn)
        except OSError as e:
            if adapter is None:
                raise
            raise ValueError(f"LoRA adapter {adapter}: its base model {path!r} does not load ({e}); set "  # a hub id
                             f"base_model_name_or_path in {Path(adapter) / CONFIG_FILE} to the base model's "
                             "directory") from e
        if adapter is not None:
            model = merge_adapter(model, adapter)
        return use_moe_impl(model, cfg.model.moe_impl).to(device)


def adapter_base(adapter: str | Path) -> str:
    """The base model directory (or hub id) of the LoRA adapter directory ``adapter``; ValueError, saying what to
    do, when its ``adapter_config.json`` names none or a directory that is not there."""
    base = base_of(adapter)
    fix = (f"set base_model_name_or_path in {Path(adapter) / CONFIG_FILE} to the base model's directory, or use "
           "a merged export made where the base exists (cascade-rl export --merge CHECKPOINT --out DIR)")
    if not base:
        raise ValueError(f"LoRA adapter {adapter}: its {CONFIG_FILE} names no base model; {fix}")
    local = Path(base).expanduser()
    # a hub id ("org/name") is left to transformers; anything that looks like a path must be a directory here
    if not local.is_dir() and (local.is_absolute() or base.startswith((".", "~")) or local.exists()
                               or len(local.parts) != 2):
        raise ValueError(f"LoRA adapter {adapter}: its base model {base!r} is not a directory here; {fix}")
    return str(local) if local.is_dir() else base


def merge_adapter(model: nn.Module, adapter: str | Path) -> nn.Module:
    """``model`` (the adapter's base, as loaded) with the LoRA adapter at ``adapter`` merged into its weights
    (peft's ``merge_and_unload``: W0 + scale * B @ A in W0's dtype): the plain HF model, no peft layer left."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()


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

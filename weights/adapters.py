"""LoRA adapters as they travel and as they are saved: peft's own files, read and applied without peft.

An adapter is a directory peft's ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load as they are:

    adapter_config.json          peft's LoraConfig (``r``, ``lora_alpha``, ``target_modules``, ...)
    adapter_model.safetensors    {"base_model.model.<module>.lora_A.weight": [r, in], "...lora_B.weight": [out, r]}

A weight version of a LoRA run (``trainer.lora``) is the second file alone: the transports ship it as they ship
full weights (same checksum, same version checks), and the notice (``WeightsReady.adapter``) carries the first
file's content. ``write_dir`` makes the pair a directory again on the sampler's side.

An engine that cannot load adapters applies one by merging (``merge``): W = W0 + scale * B @ A on each adapted
module's weight, from the base's own W0 (kept by the engine), never from the previous version's merge.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: the supervisor reads adapter directories (is_adapter, base_of) without it
    from torch import Tensor

# the attention and MLP projections of the HF families cascade-rl runs (Qwen, Llama, Nemotron-H's attention and
# shared experts): a LoRA run's targets unless trainer.lora.targets names others (learner/lora.py; vLLM's
# lora_target_modules, samplers/vllm_engine.py)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."  # peft's prefix of every tensor name in adapter_model.safetensors
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a peft adapter directory (not a full model)."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(path: str | Path) -> dict:
    """The adapter's ``adapter_config.json``."""
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def base_of(path: str | Path) -> str:
    """The base model an adapter directory was trained on (its config's ``base_model_name_or_path``)."""
    return str(read_config(path).get("base_model_name_or_path") or "")


def scale(config: dict) -> float:
    """The factor on B @ A: ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``)."""
    r = int(config["r"])
    return float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r)


def file_name(module: str, which: str) -> str:
    """The name peft gives module ``module``'s ``lora_A`` or ``lora_B`` (``which``) in adapter_model.safetensors."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def pairs(tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Module name (the HF model's, e.g. ``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r])."""
    out: dict[str, list] = {}
    for name, t in tensors.items():
        body = name.removeprefix(PREFIX)
        for i, which in enumerate(("A", "B")):
            suffix = f".lora_{which}.weight"
            if body.endswith(suffix):
                out.setdefault(body.removesuffix(suffix), [None, None])[i] = t
                break
        else:
            raise ValueError(f"adapter tensor {name!r} is not a LoRA A or B weight")
    missing = [m for m, (a, b) in out.items() if a is None or b is None]
    if missing:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {missing[:3]}")
    return {m: (a, b) for m, (a, b) in out.items()}


def delta(a: Tensor, b: Tensor, factor: float) -> Tensor:
    """``factor * B @ A`` in fp32: the change an adapter makes to one module's weight [out, in]."""
    return (b.float() @ a.float()) * factor


def merge(base: dict[str, Tensor], tensors: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """The adapted modules' weights, ``{"<module>.weight": W0 + scale * B @ A}`` in each W0's dtype and device,
    from ``base`` (the base model's weights by HF name: every adapted module's ``.weight``)."""
    factor = scale(config)
    out = {}
    for module, (a, b) in pairs(tensors).items():
        key = f"{module}.weight"
        if key not in base:
            raise ValueError(f"the adapter adapts {module!r}, which this model does not have")
        w0 = base[key]
        out[key] = (w0.float() + delta(a.to(w0.device), b.to(w0.device), factor)).to(w0.dtype)
    return out


def write_dir(out: str | Path, config: dict, weights_file: str | Path) -> Path:
    """An adapter directory at ``out`` from a config and an ``adapter_model.safetensors`` file (hard-linked where
    the filesystem allows, else copied), written whole before it appears (renamed into place)."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    target = tmp / WEIGHTS_FILE
    target.unlink(missing_ok=True)
    try:
        os.link(weights_file, target)
    except OSError:
        import shutil

        shutil.copyfile(weights_file, target)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out

"""LoRA RL (``trainer.lora``): peft's adapters on the trainer's HF model, trained, shipped and saved alone.

    model = attach(load_model(cfg.model.path, cfg), cfg.trainer.lora, cfg.model.path)   # peft, in place
    with adapters_off(model): ...                                                        # the base: the KL reference
    AdapterSource(policy)          # what a weight transport publishes: adapter_model.safetensors, peft's names
    save_adapter(out, policy, ...)  # adapter_config.json + adapter_model.safetensors (PeftModel.from_pretrained)

peft injects its ``LoraLayer``s into the model itself (``inject_adapter_in_model``), so the model keeps its HF class,
its layers and everything the policy, FSDP2 and context parallelism know of it; only the adapters require grad, so
the optimizer holds only them. The adapters are fp32 beside a bf16 base (``upcast``): they are their own master
weights, as verl and NeMo-RL keep them; in bf16 the small updates of a step would round away. peft casts a layer's
input to its adapter's dtype and the adapter's output back to the base's, so the forward mixes them as it is.

What peft cannot adapt here is refused with the reason (``LoraError``): transformers 5 fuses the routed experts of an
MoE layer into 3-D parameters (``mlp.experts.gate_up_proj``), which peft adapts only as ``target_parameters``, a
form vLLM 0.32 does not load; the adapters go on the attention and the dense (or shared-expert) MLP projections.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from cascade_rl.weights import adapters
from cascade_rl.weights.layout import file_order

from .parallel import Gathered

DEFAULT_TARGETS = adapters.DEFAULT_TARGETS  # a model's default targets: those of these it has
ADAPTER = "default"  # peft's adapter name in the trainer's model


class LoraError(ValueError):
    """A ``trainer.lora`` setting this model cannot take, with the reason and what to change."""


def enabled(settings) -> bool:
    return bool(settings is not None and settings.rank > 0)


def attached(model: nn.Module) -> bool:
    """Whether ``attach`` put adapters on ``model``."""
    return hasattr(model, "peft_config")


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` of the model but the LM head, by name."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def expert_names(model: nn.Module) -> set[str]:
    """The last name of every routed-experts module (fused 3-D parameters, not ``nn.Linear``)."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if name.endswith("experts") and any(p.dim() == 3 for p in m.parameters(recurse=False))}


def targets(model: nn.Module, settings) -> list[str]:
    """The module names (last component) the adapters go on; ``LoraError`` for a target that matches nothing, an
    expert target, or a rank larger than an adapted layer."""
    linears = linear_modules(model)
    by_last: dict[str, list[nn.Linear]] = {}
    for name, m in linears.items():
        by_last.setdefault(name.rsplit(".", 1)[-1], []).append(m)
    asked = list(settings.targets)
    if not asked:
        chosen = [t for t in DEFAULT_TARGETS if t in by_last]
        if not chosen:
            raise LoraError(f"none of the default LoRA targets {list(DEFAULT_TARGETS)} is a Linear layer of this "
                            f"model: name them in trainer.lora.targets (its Linear layers: {sorted(by_last)})")
    else:
        experts = expert_names(model)
        for t in asked:
            if t in experts or t.endswith("experts"):
                raise LoraError(f"trainer.lora.targets: {t!r} are fused routed experts (3-D parameters): peft adapts "
                                "them only as target_parameters, which vLLM cannot load; adapt the attention and "
                                "dense or shared-expert MLP projections")
            if t not in by_last:
                raise LoraError(f"trainer.lora.targets: {t!r} matches no Linear layer of this model; its Linear "
                                f"layers are {sorted(by_last)}")
        chosen = asked
    for t in chosen:
        smallest = min(min(m.in_features, m.out_features) for m in by_last[t])
        if settings.rank > smallest:
            raise LoraError(f"trainer.lora.rank={settings.rank} is larger than {t} ({smallest} features on its "
                            "smaller side): a rank that large adapts nothing more; lower trainer.lora.rank")
    return chosen


def peft_config(model: nn.Module, settings, base_path: str):
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets(model, settings), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=str(base_path))


def attach(model: nn.Module, settings, base_path: str) -> nn.Module:
    """peft's LoRA layers injected into ``model`` in place (B = 0: the model computes the base's function);
    every base parameter frozen."""
    from peft import inject_adapter_in_model

    if adapters.is_adapter(base_path):
        raise LoraError(f"model.path {base_path} is a LoRA adapter (of {adapters.base_of(base_path) or 'a base'}), "
                        "not a full model: merge it first (cascade-rl export --merge) or set model.path to its base")
    config = peft_config(model, settings, base_path)
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:  # e.g. a Mamba layer's out_proj, which peft refuses to adapt
        raise LoraError(f"trainer.lora.targets={list(config.target_modules)}: peft refuses them on this model: "
                        f"{err}") from None
    upcast(model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def upcast(model: nn.Module) -> None:
    """Every LoRA parameter in fp32, whatever the base's dtype. peft builds the adapters in their base layer's dtype
    and only ``PeftModel`` (``autocast_adapter_dtype``) upcasts them; ``inject_adapter_in_model`` does not, so on a
    bf16 base they would train in bf16. New parameters, set in place of the old (before the optimizer sees any)."""
    for prefix, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if ".lora_" in f"{prefix}.{name}" and p.is_floating_point() and p.dtype != torch.float32:
                setattr(module, name, nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))


def config_dict(model: nn.Module) -> dict:
    """The adapter's ``adapter_config.json`` content (JSON types only)."""
    config = model.peft_config[ADAPTER].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def file_name(param_name: str, prefix: str = "") -> str:
    """A LoRA parameter's name in the trainer's model (``prefix``: the policy's ``model.``) -> its name in peft's
    adapter_model.safetensors (the adapter's name dropped)."""
    return adapters.PREFIX + param_name.removeprefix(prefix).replace(f".{ADAPTER}.", ".")


def lora_parameters(module: nn.Module, prefix: str = "") -> dict[str, tuple[str, Tensor]]:
    """File name -> (the module's parameter name, the parameter) of every LoRA parameter."""
    return {file_name(n, prefix): (n, p) for n, p in module.named_parameters() if ".lora_" in n}


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """The base model's function: every LoRA layer of ``module`` switched off for the span (no copy of anything)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    grads = {p: p.requires_grad for m in layers for p in m.parameters()}
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, g in grads.items():  # enable_adapters(False) froze them; the active adapter's flags as they were
            p.requires_grad_(g)


class BaseReference(nn.Module):
    """The KL reference of a LoRA run: the policy itself with its adapters off (no second model in memory)."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: its parameters are the policy's

    def forward(self, *args, **kwargs):
        with adapters_off(self.policy):
            return self.policy(*args, **kwargs)


class AdapterSource(Gathered):
    """The adapter as a ``TensorSource`` (weights/layout.py) in peft's file names and its fp32: what each weight
    version ships. Under FSDP2 each tensor is gathered when read (learner/parallel.py ``Gathered``)."""

    def __init__(self, policy: nn.Module, prefix: str = "model.") -> None:
        params = lora_parameters(policy, prefix)
        self._tensors = {k: p for k, (_, p) in params.items()}
        self.specs = {k: (p.dtype, tuple(p.shape)) for k, p in self._tensors.items()}
        self.metadata: dict[str, str] = {"format": "pt"}
        self.device = next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor, gathered, on the CPU (a collective under FSDP2)."""
        names = file_order(self.specs)
        return {n: t.cpu().contiguous() for n, t in zip(names, self.read(names), strict=True)}


def save_adapter(out: Path, state: dict[str, Tensor], config: dict) -> None:
    """``out``/adapter_config.json and adapter_model.safetensors, as peft's ``save_pretrained`` writes them."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / adapters.CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(state, str(out / adapters.WEIGHTS_FILE), metadata={"format": "pt"})


def load_adapter(policy: nn.Module, path: Path, prefix: str = "model.") -> None:
    """The adapter tensors of an adapter directory into the policy's LoRA parameters (every rank: each copies its
    own shard of the full tensor under FSDP2)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / adapters.WEIGHTS_FILE))
    params = lora_parameters(policy, prefix)
    if missing := sorted(set(params) - set(state)):
        raise LoraError(f"{path}: the adapter lacks {missing[:3]}: it was trained with other trainer.lora targets")
    with torch.no_grad():
        for name, (_, p) in params.items():
            full = state[name].to(device=p.device, dtype=p.dtype)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


class AdapterWriter:
    """What ``checkpoint.save`` writes in place of an HF model for a LoRA run: the adapter directory."""

    def __init__(self, state: dict[str, Tensor], config: dict) -> None:
        self.state, self.config = state, config

    def save_pretrained(self, out, state_dict=None) -> None:
        save_adapter(Path(out), self.state, self.config)

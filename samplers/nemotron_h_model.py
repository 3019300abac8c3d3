"""Inference-only Nemotron-H (transformers ``nemotron_h``: Mamba-2, attention and MoE layers) in plain PyTorch, with
the interface of samplers/torch_model.py's ``Transformer`` where the torch engine calls it.

    model = NemotronH.from_pretrained("models/tiny-nh")                     # an HF directory
    cache = model.new_cache(slots=64, max_len=512)                           # samplers/state_cache.py HybridCache
    logits = model(prompts, positions, cache.prefill(slots, src), last=lengths - 1)  # [G, V]
    logits = model.decode(tokens, pos, cache)                                # [B, V], rows = slots 0..B-1

Semantics are those of transformers 5.19 (models/nemotron_h/modeling_nemotron_h.py): every layer is
``x + mixer(norm(x))`` with one mixer, by ``layers_block_type``:

- ``linear_attention``, Mamba-2 (``Mamba2``): in_proj to the gate z, xBC and dt; a causal depthwise conv (kernel
  ``conv_kernel``) and silu on xBC, split into x, B, C; dt = softplus(dt + dt_bias) floored at ``time_step_min``;
  A = -exp(A_log); the selective scan with a D skip (samplers/state_cache.py: chunked for a prefill, the one-step
  recurrence for decode); the gated RMSNorm of Zamba2 (norm(y · silu(z)) per group of ``inner / n_groups``
  channels, then the weight); out_proj.
- ``full_attention``: grouped-query attention, no RoPE (the Mamba layers carry position), scaled by
  head_dim**-0.5, on the engine's KV cache (attention layers indexed compactly).
- ``moe``: kernels/moe.py's routing and experts for the family kernels/moe_families.py reads from the config (a
  sigmoid router in fp32 whose correction bias chooses but does not weigh, group-limited top-k, the weights
  renormalised and scaled by ``routed_scaling_factor``; squared-ReLU experts without a gate, HF's layout
  ``up_proj [E, I, H]``, ``down_proj [E, H, I]``), between the optional latent projections, plus the shared expert
  (a squared-ReLU MLP).
- ``mlp``: a squared-ReLU MLP.

RMSNorm multiplies the weight in fp32 before casting back (unlike Qwen3's). The LM head is never tied to the
embeddings (HF's class ties nothing, whatever ``tie_word_embeddings`` says). Module and parameter names are HF's
without the ``model.`` prefix, so ``load_hf_state_dict`` / ``hf_state_dict`` only rename, except on-disk
checkpoints (``save_pretrained``: ``backbone.`` prefix, one up/down tensor per expert), which are merged.
kernels/cpu_decode.cpp does not know this model (``cpu_kernels_refusal``); it runs on torch ops everywhere.
``tests/test_nemotron_h_engine.py`` checks it against transformers in fp32.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.moe import ACTIVATIONS, moe_experts, route
from ..kernels.moe_families import MoeFamily, moe_family
from .kv_cache import KVCache
from .models import UnservedModelError
from .state_cache import HybridCache, KVShape, Pass, StateCache
from .torch_model import RecordsRoutes, read_safetensors

MIXERS = ("linear_attention", "full_attention", "moe", "mlp")  # HF's layers_block_type values


@dataclasses.dataclass(frozen=True)
class NemotronHArgs:
    vocab_size: int
    dim: int
    layer_types: tuple[str, ...]  # one of MIXERS per layer
    eps: float  # every RMSNorm's (HF's layer_norm_epsilon)
    max_position_embeddings: int
    # attention
    n_heads: int
    n_kv_heads: int
    head_dim: int
    # Mamba-2
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int  # B and C groups (each serves mamba_heads / n_groups heads), also the gated norm's groups
    state_size: int
    conv_kernel: int
    chunk_size: int  # the prefill's scan chunk
    dt_min: float  # dt's floor (HF's mixer: time_step_limit = (time_step_min, inf))
    use_bias: bool  # in_proj / out_proj biases
    use_conv_bias: bool
    # MLP layers and the shared expert (squared ReLU)
    intermediate_size: int
    mlp_bias: bool
    # MoE
    n_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None  # experts run in this width between fc1/fc2 latent projections (None: hidden size)
    moe: MoeFamily | None  # kernels/moe_families.py: the router (with its correction bias), the experts' activation

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layers_of("moe")

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, cfg) -> NemotronHArgs:
        """From a transformers ``NemotronHConfig``; refuses what this model does not implement."""
        if cfg.model_type != "nemotron_h":
            raise UnservedModelError(cfg.model_type)
        for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if getattr(cfg, name) != want:
                raise NotImplementedError(f"{name}={getattr(cfg, name)!r}: only {want!r}")
        if cfg.attention_bias:
            raise NotImplementedError("attention_bias=True")
        if set(cfg.layers_block_type) - set(MIXERS):
            raise NotImplementedError(f"layer types {sorted(set(cfg.layers_block_type) - set(MIXERS))}")
        return cls(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, layer_types=tuple(cfg.layers_block_type),
            eps=cfg.layer_norm_epsilon, max_position_embeddings=cfg.max_position_embeddings,
            n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
            mamba_heads=cfg.mamba_num_heads, mamba_head_dim=cfg.mamba_head_dim, n_groups=cfg.n_groups,
            state_size=cfg.ssm_state_size, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
            dt_min=cfg.time_step_min, use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias,
            intermediate_size=cfg.intermediate_size, mlp_bias=cfg.mlp_bias,
            n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_intermediate_size=cfg.moe_shared_expert_intermediate_size, latent_size=cfg.moe_latent_size,
            moe=moe_family(cfg),
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """NemotronHRMSNorm: normalised in fp32, times the weight in fp32, then cast to x's dtype."""
    return (weight.float() * F.rms_norm(x.float(), x.shape[-1:], None, eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Zamba2RMSNormGated: y · silu(z) in fp32, RMS-normalised per group of ``group`` channels, cast to y's dtype,
    times the weight."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        h = y.float() * F.silu(z.float())
        h = F.rms_norm(h.unflatten(-1, (-1, self.group)), (self.group,), None, self.eps).flatten(-2)
        return self.weight * h.to(y.dtype)


class Mamba2(nn.Module):
    """The Mamba-2 mixer; its scan is the cache pass's ``ssm`` (samplers/state_cache.py), on Mamba layer
    ``index`` of the state cache."""

    def __init__(self, a: NemotronHArgs, index: int) -> None:
        super().__init__()
        self.index = index
        self.heads, self.head_dim, self.groups = a.mamba_heads, a.mamba_head_dim, a.n_groups
        self.state_size = a.state_size
        self.inner, self.conv_dim, self.chunk_size, self.dt_min = a.mamba_inner, a.conv_dim, a.chunk_size, a.dt_min
        self.in_proj = nn.Linear(a.dim, self.inner + self.conv_dim + self.heads, bias=a.use_bias)  # z | xBC | dt
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, a.conv_kernel, groups=self.conv_dim,
                                bias=a.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, a.eps)
        self.out_proj = nn.Linear(self.inner, a.dim, bias=a.use_bias)

    def forward(self, x: Tensor, p: Pass, lengths: Tensor | None) -> Tensor:
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = p.ssm(self.index, self, xbc, dt, lengths)  # fp32 [B, T, inner]
        return self.out_proj(self.norm(y, z).to(x.dtype))


class Attention(nn.Module):
    """Grouped-query attention without RoPE on attention layer ``index`` of the KV cache."""

    def __init__(self, a: NemotronHArgs, index: int) -> None:
        super().__init__()
        self.index, self.n_heads, self.n_kv_heads, self.head_dim = index, a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: Tensor, p: Pass, lengths: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        return self.o_proj(p.attend(self.index, q, k, v))


class MLP(nn.Module):
    """up, squared ReLU, down (an ``mlp`` layer, and the MoE layers' shared expert)."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor, p: Pass | None = None, lengths: Tensor | None = None) -> Tensor:
        return self.down_proj(ACTIVATIONS["relu2"](self.up_proj(x), -1))


class Router(nn.Module):
    """The router's weight and its score-correction bias (fp32, as HF keeps it: ``_keep_in_fp32_modules_strict``)."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):  # model.to(dtype) leaves the bias in fp32
        super()._apply(fn, recurse)
        self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self


class Experts(nn.Module):
    """Routed experts in HF's layout, which kernels/moe.py takes as is: ``up_proj [E, I, H]``, ``down_proj
    [E, H, I]``."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))


class MoE(nn.Module):
    """Routed squared-ReLU experts (kernels/moe.py: routing and activation by the family, ``args.moe``; experts by
    ``impl``, an ``EXPERTS`` name) between the latent projections, plus the shared expert."""

    def __init__(self, a: NemotronHArgs, impl: str) -> None:
        super().__init__()
        self.routing, self.activation, self.impl = a.moe.routing, a.moe.activation, impl
        width = a.latent_size or a.dim
        self.gate = Router(a.dim, a.n_experts)
        self.experts = Experts(a.n_experts, width, a.moe_intermediate_size)
        self.shared_experts = MLP(a.dim, a.shared_intermediate_size, a.mlp_bias)
        latent = a.latent_size is not None
        self.fc1_latent_proj = nn.Linear(a.dim, width, bias=a.mlp_bias) if latent else nn.Identity()
        self.fc2_latent_proj = nn.Linear(width, a.dim, bias=a.mlp_bias) if latent else nn.Identity()
        self.keep_routes = False  # NemotronH.record_routes: keep the last forward's experts in ``routes``
        self.routes: Tensor | None = None  # [..., top_k] int64, x's leading shape

    def forward(self, x: Tensor, p: Pass | None = None, lengths: Tensor | None = None) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = route(flat, self.gate.weight, self.routing, self.gate.e_score_correction_bias)  # fp32
        h = self.fc1_latent_proj(flat)
        if h.shape[0]:  # no tokens: no call (a grouped_mm of no rows)
            h = moe_experts(h, weights, ids, self.experts.up_proj, self.experts.down_proj, self.impl,
                            self.activation)
        y = self.fc2_latent_proj(h).view_as(x)
        if self.keep_routes:
            self.routes = ids.view(*x.shape[:-1], ids.shape[-1])
        return y + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, a: NemotronHArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(a.dim, a.eps)
        self.mixer = mixer

    def forward(self, x: Tensor, p: Pass, lengths: Tensor | None) -> Tensor:
        return x + self.mixer(self.norm(x), p, lengths)


def mixer(a: NemotronHArgs, layer: int, moe_impl: str) -> nn.Module:
    """Layer ``layer``'s mixer; Mamba and attention layers know their index among their own kind (their cache)."""
    kind = a.layer_types[layer]
    index = a.layer_types[:layer].count(kind)
    return MIXER_TYPES[kind](a, index, moe_impl)


MIXER_TYPES = {  # HF layer type -> (args, index among its kind, experts impl) -> the mixer
    "linear_attention": lambda a, i, impl: Mamba2(a, i),
    "full_attention": lambda a, i, impl: Attention(a, i),
    "moe": lambda a, i, impl: MoE(a, impl),
    "mlp": lambda a, i, impl: MLP(a.dim, a.intermediate_size, a.mlp_bias),
}


class NemotronH(RecordsRoutes, nn.Module):
    Args = NemotronHArgs
    cpu_kernels_refusal = ("kernels/cpu_decode.cpp knows Qwen3's layers only (RoPE attention, softmax router, SwiGLU "
                           "experts), not Nemotron-H's Mamba-2 layers, sigmoid group router or squared-ReLU experts")

    def __init__(self, args: NemotronHArgs, moe_impl: str = "grouped") -> None:
        super().__init__()
        self.args = args
        self.embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(mixer(args, i, moe_impl), args) for i in range(args.n_layers))
        self.norm_f = RMSNorm(args.dim, args.eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.keep_routes = False

    def use_cpu_kernels(self) -> NemotronH:
        raise ValueError(f"no C++ CPU kernels for Nemotron-H: {self.cpu_kernels_refusal}")

    def new_cache(self, slots: int, max_len: int, dtype=torch.float32, device="cpu", kv=KVCache) -> HybridCache:
        """The engine's cache for this model: K/V of the attention layers (``kv``: its class, static or paged),
        conv windows and SSM states of the Mamba layers."""
        a = self.args
        kv = kv(KVShape(len(a.layers_of("full_attention")), a.n_kv_heads, a.head_dim), slots, max_len, dtype, device)
        state = StateCache(len(a.layers_of("linear_attention")), slots, a.conv_dim, a.conv_kernel, a.mamba_heads,
                           a.mamba_head_dim, a.state_size, dtype, device)
        return HybridCache(kv, state)

    def moe_blocks(self) -> list[MoE]:
        return [b.mixer for b in self.layers if isinstance(b.mixer, MoE)]

    def forward(self, tokens: Tensor, positions: Tensor, p: Pass, last: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, V]`` of right-padded ``tokens [B, T]``; with ``last [B]`` (each row's last position:
        its length - 1, which the Mamba layers' states stop at) only those, ``[B, V]``. ``positions`` place the
        tokens in the KV cache (no RoPE)."""
        x = self.embeddings(tokens)
        lengths = None if last is None else last + 1
        for block in self.layers:
            x = block(x, p, lengths)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]
        return self.lm_head(self.norm_f(x))

    def decode(self, tokens: Tensor, positions: Tensor, cache: HybridCache, kv_len: int | None = None) -> Tensor:
        """Logits ``[B, V]`` of one new token per slot ``0..B-1`` (``tokens [B]`` at ``positions [B]``): its K/V
        written into the cache, the slots' Mamba states advanced one step. ``kv_len`` given, no device->host read."""
        p = cache.decode(positions, int(positions.max()) + 1 if kv_len is None else kv_len)
        return self(tokens[:, None], positions[:, None], p)[:, -1]

    # --- weights in HF names ---

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32, device="cpu", **kw) -> NemotronH:
        from transformers import AutoConfig

        with torch.device("meta"):
            model = cls(cls.Args.from_hf(AutoConfig.from_pretrained(path)), **kw)
        model = model.to_empty(device=device).to(dtype)
        model.load_hf_state_dict(read_safetensors(path))
        return model.eval()

    @torch.no_grad()
    def load_hf_state_dict(self, hf: dict[str, Tensor]) -> None:
        """Copy an HF state dict (in-memory names, or save_pretrained's) into this model in place; missing or
        unknown names raise RuntimeError."""
        ours, state = to_native(hf), self.state_dict()
        if missing := sorted(state.keys() - ours.keys()):
            raise RuntimeError(f"weights lack {', '.join(hf_name(n) for n in missing[:8])}")
        if extra := sorted(ours.keys() - state.keys()):
            raise RuntimeError(f"unexpected weights: {[hf_name(n) for n in extra[:8]]}")
        for name, t in state.items():
            t.copy_(ours[name])

    def hf_state_dict(self) -> dict[str, Tensor]:
        """This model's weights (and the routers' correction biases) in HF's in-memory names."""
        return {hf_name(n): t for n, t in self.state_dict().items()}


def hf_name(ours: str) -> str:
    return ours if ours.startswith("lm_head.") else f"model.{ours}"


EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")  # save_pretrained's per-expert tensors


def to_native(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF names (``model.`` in memory, ``backbone.`` on disk) -> ours; per-expert tensors stacked into HF's
    in-memory ``[E, ...]``; multi-token-prediction weights (``mtp.*``, which HF ignores too) dropped."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = defaultdict(dict)
    for name, t in hf.items():
        if name.startswith("mtp."):
            continue
        name = re.sub(r"^(model|backbone)\.", "", name)
        if m := EXPERT.fullmatch(name):
            experts[f"{m[1]}.{m[3]}"][int(m[2])] = t
        else:
            out[name] = t
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[j] for j in range(len(per_expert))])
    return out

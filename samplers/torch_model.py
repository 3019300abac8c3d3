"""Inference-only Qwen3 and Qwen3-MoE in plain PyTorch, with a static KV cache (gpt-fast style).

    model = Transformer.from_pretrained("models/tiny")               # an HF directory
    cache = KVCache(model.args, slots=64, max_len=512)
    logits = model(prompts, positions, cache.prefill(slots, src), last=lengths - 1)  # [G, V]
    logits = model.decode(tokens, pos, cache)  # [B, V], rows = slots 0..B-1 (one C++ op with use_cpu_kernels)

Semantics are those of transformers 5.19 (models/qwen3*/modeling_*.py): RMSNorm
in fp32 then scaled in the model dtype, q_norm/k_norm per head before RoPE
(default rope type, cos/sin from an fp32 table), grouped-query attention
scaled by head_dim**-0.5, SwiGLU, and for MoE a softmax router whose top-k
weights are renormalised (``norm_topk_prob``). ``tests/test_torch_model.py``
checks the logits against transformers to 1e-5 in fp32.

The weights are kept fused for speed: q|k|v in one matrix, gate|up in one, the
q and k norm weights in one ``[heads + kv_heads, head_dim]`` table, experts as
``w13 [E, H, 2I]`` and ``w2 [E, I, H]`` (HF's ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` transposed: the input dim first, as grouped matmuls
want). ``load_hf_state_dict`` / ``hf_state_dict`` convert from / to HF names,
both the in-memory layout (fused experts, what ``safetensors.torch.save_model``
writes) and the on-disk one of ``save_pretrained`` (one tensor per expert).

The MoE block is kernels/moe.py's (routing, experts, their weight layout; the trainer runs the same code):
``MoE`` holds the router and the experts in our layout and picks its experts implementation by name (``impl``;
the engine's pick is ``choose_experts``): "grouped" (pairs sorted by expert, one grouped matmul per projection: k/E
of the arithmetic; no host read, so a CUDA graph can hold it) or "dense" (every expert on every token, weighted by
a routing that is zero outside the top-k: no sort, E/k times the arithmetic), for devices whose ``_grouped_mm``
lacks the dtype (CUDA's kernel serves bf16 on sm_90 / sm_100; elsewhere torch falls back to a loop over groups
that reads the offsets on the host).

``use_cpu_kernels()`` (fp32 on CPU; what the engine does there) swaps in the C++
kernels of kernels/cpu_decode.cpp: the MoE block (routing, per-expert GEMMs run
in parallel, combine) and RMS norm as one op each, and ``decode`` as one op for
the whole step, so no Python runs between a step's ops.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from ..kernels import cpu_decode
from ..kernels.moe import EXPERTS, Routing, moe_experts, select_experts, swiglu
from .kv_cache import Attend, KVCache
from .models import MODELS, SERVED_MODEL_TYPES, UnservedModelError  # the latter two also read here (supervisor)

MODEL_TYPES = ("qwen3", "qwen3_moe")  # the HF model_types this file implements (samplers/models.py maps them here)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (every layer of Qwen3; the non-MoE layers of Qwen3-MoE)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg) -> ModelArgs:
        """From a transformers ``Qwen3Config`` / ``Qwen3MoeConfig``; refuses what this model does not implement."""
        if cfg.model_type not in SERVED_MODEL_TYPES:
            raise UnservedModelError(cfg.model_type)
        if cfg.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {cfg.model_type!r} is implemented by {MODELS[cfg.model_type]}, not here")
        rope = cfg.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r}: only the default RoPE")
        if getattr(cfg, "attention_bias", False):
            raise NotImplementedError("attention_bias=True")
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise NotImplementedError("sliding-window attention")
        n_experts = getattr(cfg, "num_experts", 0) or 0
        moe_layers = tuple(
            i for i in range(cfg.num_hidden_layers)
            if n_experts > 0 and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
        ) if cfg.model_type == "qwen3_moe" else ()
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope["rope_theta"],
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            n_experts=n_experts if moe_layers else 0,
            top_k=getattr(cfg, "num_experts_per_tok", 0) if moe_layers else 0,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) if moe_layers else 0,
            norm_topk_prob=getattr(cfg, "norm_topk_prob", True),
            moe_layers=moe_layers,
        )


# --- the static KV cache ------------------------------------------------------------------------


# --- the model --------------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / rms(x) over the last dim, times ``weight``: normalised in fp32 (as transformers does), scaled in
    x's dtype. One fused op in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    y = F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
    return y if weight is None else weight * y


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, hd] rotated by cos/sin [B, T, 1, hd] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_table(args: ModelArgs, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin ``[max_position_embeddings, head_dim]`` in fp32, as transformers' default RoPE computes them."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=device) / hd))
    freqs = torch.arange(args.max_position_embeddings, device=device).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_kernel = False  # Transformer.use_cpu_kernels: one C++ pass (fp32 on CPU)

    def forward(self, x: Tensor) -> Tensor:
        if self.cpu_kernel:
            return cpu_decode.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = a.n_heads, a.n_kv_heads, a.head_dim, a.rms_norm_eps
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.qk_norm = nn.Parameter(torch.ones(a.n_heads + a.n_kv_heads, a.head_dim))  # q_norm rows, then k_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, layer: int) -> Tensor:
        b, t, _ = x.shape
        h, kv = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x).view(b, t, h + 2 * kv, self.head_dim)
        # q and k are normed (per head) and rotated together: half the ops of doing them one by one
        qk = apply_rope(self.qk_norm * rms_norm(qkv[:, :, : h + kv], None, self.eps), cos, sin)
        return self.wo(attend(layer, qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + kv :]))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)  # gate | up
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w13(x), -1))


def choose_experts(device_type: str, dtype: torch.dtype, cuda_capability: tuple[int, int] | None = None,
                   cpu_kernels: bool = False, forced: str | None = None) -> str:
    """The engine's MoE experts, a pure function of (device, dtype, config): the C++ op ("cpu") with
    ``cpu_kernels``; else ``forced`` (``TorchEngine(moe_impl=)``, a kernels/moe.py ``EXPERTS`` name); on CUDA
    "grouped" where ``_grouped_mm`` has a kernel for the dtype (bf16 on sm_90 / sm_100: k/E of dense's FLOPs,
    1/16 for a 30B-A3B model), "dense" elsewhere (torch's fallback loops over the groups after reading the offsets
    on the host: no CUDA graph); "grouped" on CPU (torch's CPU kernel takes any float dtype)."""
    if forced is not None and forced not in EXPERTS:
        raise ValueError(f"moe_impl={forced!r}: choose one of {sorted(EXPERTS)}")
    if cpu_kernels:
        return "cpu"
    if forced is not None:
        return forced
    if device_type == "cuda":
        grouped = dtype == torch.bfloat16 and cuda_capability is not None and cuda_capability[0] in (9, 10)
        return "grouped" if grouped else "dense"
    return "grouped"


class MoE(nn.Module):
    """kernels/moe.py's MoE block on our layout: ``w13 [E, H, 2I]``, ``w2 [E, I, H]``, handed to it as the
    transposed views it takes (``gate_up [E, 2I, H]``, ``down [E, H, I]``; no copy). ``impl``: an ``EXPERTS`` name,
    or "cpu" (the C++ op: routing, experts and combine in one, softmax_topk and SwiGLU only)."""

    def __init__(self, a: ModelArgs, impl: str = "grouped") -> None:
        super().__init__()
        # the MoE family (kernels/moe.py ROUTERS, ACTIVATIONS): Qwen3-MoE's; another one is set here from ModelArgs
        self.routing, self.activation, self.impl = Routing(a.top_k, a.norm_topk_prob), "swiglu", impl
        self.router = nn.Linear(a.dim, a.n_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(a.n_experts, a.dim, 2 * a.moe_intermediate_size))  # gate | up
        self.w2 = nn.Parameter(torch.empty(a.n_experts, a.moe_intermediate_size, a.dim))
        self.keep_routes = False  # Transformer.record_routes: keep the last forward's experts in ``routes``
        self.routes: Tensor | None = None  # [..., top_k] int64, x's leading shape

    def forward(self, x: Tensor) -> Tensor:
        flat, k = x.reshape(-1, x.shape[-1]), self.routing.top_k
        if self.impl == "cpu":  # routing, experts and combine in one C++ op
            routes = flat.new_empty((flat.shape[0], k), dtype=torch.long) if self.keep_routes else None
            y = cpu_decode.moe_forward(flat, self.router.weight, self.w13, self.w2, k, self.routing.normalize,
                                       routes).view_as(x)
        else:
            weights, routes = select_experts(self.router(flat), self.routing)
            y = self.run_experts(flat, weights, routes).view_as(x)
        if self.keep_routes:
            self.routes = routes.view(*x.shape[:-1], k)
        return y

    def run_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """kernels/moe.py's experts ``impl`` on our weights, as the transposed views it takes (no copy)."""
        if not x.shape[0]:  # no tokens: no call (a grouped_mm of no rows)
            return torch.zeros_like(x)
        return moe_experts(x, weights, ids, self.w13.transpose(1, 2), self.w2.transpose(1, 2), self.impl,
                           self.activation)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, moe_impl: str) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(a.dim, a.rms_norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.rms_norm_eps)
        self.ffn = MoE(a, moe_impl) if layer in a.moe_layers else FeedForward(a.dim, a.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attend, self.layer)
        return x + self.ffn(self.ffn_norm(x))


class RecordsRoutes:
    """The engine's routes (R3) of a model whose ``moe_blocks()`` each keep their last forward's experts in
    ``routes`` while ``keep_routes`` is on: every model class of samplers/models.py."""

    def record_routes(self, on: bool = True):
        """Keep the experts every MoE layer picks for each token of the next forward (``last_routes``)."""
        self.keep_routes = on
        for m in self.moe_blocks():
            m.keep_routes, m.routes = on, None
        return self

    def last_routes(self) -> Tensor:
        """The experts of the last forward or decode step: int64 ``[B, T, MoE layers, top_k]`` (T = 1 for a
        decode step); ``record_routes`` must be on."""
        return torch.stack([m.routes for m in self.moe_blocks()], dim=-2)


class Transformer(RecordsRoutes, nn.Module):
    Args = ModelArgs  # its arguments, ``Args.from_hf(hf_config)`` (samplers/models.py)
    cpu_kernels_refusal = ""  # kernels/cpu_decode.cpp implements this model

    def __init__(self, args: ModelArgs, moe_impl: str = "grouped") -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, moe_impl) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.cpu_kernels = False  # use_cpu_kernels
        self.keep_routes = False  # record_routes
        cos, sin = rope_table(args)
        self.rope_cos = nn.Buffer(cos, persistent=False)
        self.rope_sin = nn.Buffer(sin, persistent=False)
        self.tie()

    def use_cpu_kernels(self) -> Transformer:
        """The C++ CPU kernels (kernels/cpu_decode.cpp, fp32): ``decode`` runs as one op, prefills use the
        MoE and RMS-norm kernels."""
        if self.rope_cos.device.type != "cpu" or self.embed.weight.dtype != torch.float32:
            raise ValueError("the C++ CPU kernels need an fp32 model on CPU")
        self.cpu_kernels = True
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.cpu_kernel = True
            elif isinstance(m, MoE):
                m.impl = "cpu"
        return self

    def moe_blocks(self) -> list[MoE]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoE)]

    def new_cache(self, slots: int, max_len: int, dtype=torch.float32, device="cpu", kv=KVCache) -> KVCache:
        """The engine's cache for this model: K/V of every layer (``kv``: its class, ``KVCache``'s arguments,
        or samplers/paged_kv.py's ``PagedKVCache`` with its pool bound)."""
        return kv(self.args, slots, max_len, dtype, device)

    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int | None = None) -> Tensor:
        """Logits ``[B, V]`` of one new token per slot ``0..B-1`` (``tokens [B]`` at ``positions [B]``), its
        K/V written into ``cache``. With the CPU kernels, one C++ op for the whole step. ``kv_len`` (> every
        position: the part of the cache attended to) given, no device->host read happens (a CUDA graph can
        capture the step); else it is read from ``positions``."""
        if not self.cpu_kernels:
            attend = cache.decode(positions, int(positions.max()) + 1 if kv_len is None else kv_len)
            return self(tokens[:, None], positions[:, None], attend)[:, -1]
        weights, no_router = [], self.embed.weight.new_empty(0)  # a dense layer has no router
        for block in self.layers:
            a, f = block.attn, block.ffn
            weights += [block.attn_norm.weight, a.wqkv.weight, a.qk_norm, a.wo.weight, block.ffn_norm.weight]
            weights += [f.router.weight, f.w13, f.w2] if isinstance(f, MoE) else [no_router, f.w13.weight, f.w2.weight]
        weights += [self.embed.weight, self.norm.weight, self.lm_head.weight]
        a = self.args
        routes = (tokens.new_empty((a.n_layers, len(tokens), a.top_k)) if self.keep_routes and a.moe_layers
                  else None)
        logits = cpu_decode.decode_forward(tokens, positions, weights, self.rope_cos, self.rope_sin, cache.k,
                                           cache.v, a.n_heads, max(a.top_k, 1), a.norm_topk_prob, a.rms_norm_eps,
                                           routes)
        if routes is not None:
            for layer, m in zip(a.moe_layers, self.moe_blocks()):
                m.routes = routes[layer][:, None]  # [B, 1, k]
        return logits

    def tie(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend, last: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, V]`` of ``tokens [B, T]`` at ``positions [B, T]``; with ``last [B]`` only those of
        position ``last[b]`` of each row, ``[B, V]`` (a prefill needs no other)."""
        x = self.embed(tokens)
        cos = self.rope_cos[positions].to(x.dtype)[:, :, None]
        sin = self.rope_sin[positions].to(x.dtype)[:, :, None]
        for block in self.layers:
            x = block(x, cos, sin, attend)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]
        return self.lm_head(self.norm(x))

    # --- weights in HF names ---

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32, device="cpu", **kw) -> Transformer:
        from transformers import AutoConfig

        with torch.device("meta"):
            model = cls(ModelArgs.from_hf(AutoConfig.from_pretrained(path)), **kw)
        model = model.to_empty(device=device).to(dtype)
        cos, sin = rope_table(model.args, device)  # buffers come out of to_empty uninitialised, ties untied
        model.rope_cos, model.rope_sin = cos, sin
        model.tie()
        model.load_hf_state_dict(read_safetensors(path))
        return model.eval()

    @torch.no_grad()
    def load_hf_state_dict(self, hf: dict[str, Tensor], partial: bool = False) -> None:
        """Copy an HF state dict into this model in place; missing or unknown names raise RuntimeError.
        ``partial``: ``hf`` holds only some weights (in-memory HF names: a LoRA adapter merged into the modules it
        adapts); each is copied into its part of our (fused) parameter, the others are left as they are."""
        if partial:
            return self._load_partial(hf)
        try:
            ours = to_native(hf, self.args)
        except KeyError as e:
            raise RuntimeError(f"weights lack {e.args[0]}") from e
        params = dict(self.named_parameters())
        if ours.keys() != params.keys():
            raise RuntimeError(f"weights do not fit: {sorted(ours.keys() ^ params.keys())[:8]}")
        for name, p in params.items():
            p.copy_(ours[name])

    def hf_state_dict(self) -> dict[str, Tensor]:
        """This model's weights in HF names and layouts (the in-memory ones: fused experts)."""
        return to_hf(dict(self.named_parameters()), self.args)

    def _load_partial(self, hf: dict[str, Tensor]) -> None:
        """``load_hf_state_dict(partial=True)``: ``to_hf``'s tensors are views of our parameters (slices of the
        fused q|k|v and gate|up, transposed experts), so each given tensor is copied into its view; the q and k
        norms, which our table repeats per head, into every head's row."""
        a = self.args
        views = self.hf_state_dict()
        norms = {}
        for i in range(a.n_layers):
            table = self.layers[i].attn.qk_norm
            p = f"model.layers.{i}.self_attn."
            norms[p + "q_norm.weight"], norms[p + "k_norm.weight"] = table[: a.n_heads], table[a.n_heads:]
        unknown = sorted(n for n in hf if n not in views)
        if unknown:
            raise RuntimeError(f"unexpected weights: {unknown[:8]}")
        for name, t in hf.items():
            view = norms.get(name, views[name])
            want = view.shape[1:] if name in norms else view.shape
            if tuple(t.shape) != tuple(want):
                raise RuntimeError(f"weights do not fit: {name} is {tuple(t.shape)}, this model's {tuple(want)}")
            view.copy_(t)  # broadcast over the heads for a norm


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of an HF directory (single or sharded safetensors) or of one safetensors file."""
    path = Path(path)
    if path.is_file():
        return load_file(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(path / f))
    return out


def to_native(hf: dict[str, Tensor], a: ModelArgs) -> dict[str, Tensor]:
    """HF names -> ours (fusing q|k|v, gate|up, experts). Raises KeyError for a missing name and
    RuntimeError for names left over."""
    hf = dict(hf)
    take = hf.pop
    embed = hf.pop("model.embed_tokens.weight", None)
    head = hf.pop("lm_head.weight", None)
    if embed is None:  # save_model keeps one of two tied tensors
        embed = head if a.tie_word_embeddings and head is not None else take("model.embed_tokens.weight")
    out = {"embed.weight": embed, "norm.weight": take("model.norm.weight")}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = head if head is not None else take("lm_head.weight")
    for i in range(a.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        out[q + "attn.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[q + "attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        qn, kn = take(p + "self_attn.q_norm.weight"), take(p + "self_attn.k_norm.weight")
        out[q + "attn.qk_norm"] = torch.cat([qn.expand(a.n_heads, -1), kn.expand(a.n_kv_heads, -1)])
        if i in a.moe_layers:
            out[q + "ffn.router.weight"] = take(p + "mlp.gate.weight")
            if p + "mlp.experts.gate_up_proj" in hf:  # in-memory layout: [E, 2I, H] and [E, H, I]
                out[q + "ffn.w13"] = take(p + "mlp.experts.gate_up_proj").transpose(1, 2)
                out[q + "ffn.w2"] = take(p + "mlp.experts.down_proj").transpose(1, 2)
            else:  # save_pretrained's layout: one gate/up/down per expert
                e = [f"{p}mlp.experts.{j}." for j in range(a.n_experts)]
                out[q + "ffn.w13"] = torch.stack(
                    [torch.cat([take(x + "gate_proj.weight"), take(x + "up_proj.weight")]).T for x in e])
                out[q + "ffn.w2"] = torch.stack([take(x + "down_proj.weight").T for x in e])
        else:
            out[q + "ffn.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            out[q + "ffn.w2.weight"] = take(p + "mlp.down_proj.weight")
    if hf:
        raise RuntimeError(f"unexpected weights: {sorted(hf)[:8]}")
    return out


def to_hf(ours: dict[str, Tensor], a: ModelArgs) -> dict[str, Tensor]:
    """Our names -> HF's in-memory state dict (the inverse of ``to_native`` for the fused-expert layout)."""
    hd, h, kv = a.head_dim, a.n_heads, a.n_kv_heads
    out = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"],
           "lm_head.weight": ours["embed.weight" if a.tie_word_embeddings else "lm_head.weight"]}
    for name, t in ours.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if not m:
            continue
        p, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "attn.wqkv.weight":
            for n, part in zip("qkv", t.split([h * hd, kv * hd, kv * hd])):
                out[p + f"self_attn.{n}_proj.weight"] = part
        elif rest == "attn.qk_norm":
            out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = t[0], t[h]
        elif rest == "ffn.w13.weight":
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = t.chunk(2)
        else:
            hf_name = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                       "attn.wo.weight": "self_attn.o_proj.weight", "ffn.w2.weight": "mlp.down_proj.weight",
                       "ffn.router.weight": "mlp.gate.weight", "ffn.w13": "mlp.experts.gate_up_proj",
                       "ffn.w2": "mlp.experts.down_proj"}[rest]
            out[p + hf_name] = t.transpose(1, 2) if rest in ("ffn.w13", "ffn.w2") else t
    return out

"""The MoE block, once, for the trainer and the torch engine: routing (``ROUTERS``), the expert activation
(``ACTIVATIONS``) and the experts (``EXPERTS``: grouped | dense | torch | triton), forward and backward::

    y = moe_forward(x, router_weight, gate_up, down, top_k, impl="grouped" | "dense" | "torch" | "triton")
    weights, ids = select_experts(router_logits, routing, bias)          # the engine's MoE block (bias: or None)
    y = moe_experts(x, weights, ids, gate_up, down, impl, activation)    # HF's Experts.forward, the engine

Who uses it: the trainer and the teachers through modeling/experts.py (``model.moe_impl``; HF's router, our
experts), the routing replay through ``weigh_experts`` (modeling/routing.py), the torch engine's ``MoE``
block (samplers/torch_model.py, and samplers/nemotron_h_model.py's with the sigmoid router and squared-ReLU experts:
our router and experts; ``choose_experts`` picks grouped or dense). The engine's
C++ CPU op (kernels/cpu_decode.cpp, ``impl="cpu"`` there) is a second implementation of softmax_topk + SwiGLU on
the engine's layout, checked against this one (tests/test_cpu_decode.py).

Weight layout (HF's, what every function here takes): ``x [N, H]``, ``router_weight [E, H]``, ``gate_up [E, 2I, H]``
(gate rows then up rows, HF's fused ``gate_up_proj``; an activation without a gate takes ``[E, I, H]``, ``up_proj``),
``down [E, H, I]``. The torch engine stores the transposes, ``w13 [E, H, 2I]`` and ``w2 [E, I, H]`` (the input dim
first, as grouped matmuls want) and passes ``w13.transpose(1, 2)``, ``w2.transpose(1, 2)``: views, no copy; the
kernels here transpose them back where they need the engine's order, so the engine's products see its own strides.

Routing (``Routing``: a family's router settings, ``ROUTERS``: the router families; kernels/moe_families.py reads
them from an HF config):
- ``softmax_topk`` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): softmax in fp32 over all experts, top-k, the k weights
  renormalised to sum to 1 (``norm_topk_prob``) and cast to the logits' dtype. Renormalised, that is a softmax over
  the k top logits alone (softmax is monotonic), which is how it is computed: HF's block to fp32 rounding.
- ``sigmoid_group_topk`` (Nemotron-H, DeepSeek-V3: HF's two routers are the same code): fp32 logits from fp32
  weights, sigmoid scores; the score-correction bias (``e_score_correction_bias``) is added for the choice only;
  experts in ``n_group`` groups, a group scored by its two best biased scores, the ``topk_group`` best groups kept
  and the top-k taken among their experts; the weights are the unbiased scores of the chosen experts, / (sum +
  1e-20) when ``normalize``, times ``scaling`` (``routed_scaling_factor``), fp32 as HF returns them.
Routing is discrete; the router gets its gradient through the k weights, by autograd. ``weigh`` gives a family's
weights for experts chosen elsewhere (the routing replay, R3: the trainer takes the engine's experts; the bias and
the group limit choose, they do not weigh).

A new family plugs in as data: a ``Router(select, weigh)`` in ``ROUTERS`` (the fields its settings need added to
``Routing``, with defaults), an activation in ``ACTIVATIONS`` when its experts differ (``act(h, dim)`` on the first
projection's output ``h``, its units along ``dim``; ``GATED`` says whether that projection holds gate and up rows),
and its description in kernels/moe_families.py. Served: ``swiglu`` (gated, ``gate_up [E, 2I, H]``) and ``relu2``
(Nemotron-H's squared ReLU, not gated: ``gate_up`` is HF's ``up_proj [E, I, H]``) in every impl, Triton included.
A family's shared expert and latent projections are dense layers of the block, not experts here. The C++ op knows
softmax_topk + SwiGLU only, so the engine must not pick it (``choose_experts``) for another family.

Experts (``EXPERTS``, ``moe_experts(..., impl)``), all y[n] = Σ_k w[n,k] · down_e(act(gate_up_e x[n])):
- ``grouped`` (the default; ``experts_grouped``): pairs sorted by expert, one grouped GEMM per projection, no host
  sync (CUDA graphs can hold it); k/E of dense's arithmetic.
- ``dense`` (``experts_dense``): every expert on every token, weighted by a routing that is zero outside the top-k:
  no sort, E/k times the arithmetic; the engine's decode on devices whose ``_grouped_mm`` lacks the dtype.
- ``torch`` (``experts_torch``): the reference, a capacity-padded bmm (one host sync).
- ``triton``: kernels/moe_blocked.py (block-padded layout, grouped GEMMs with the activation fused, SwiGLU or
  squared ReLU, forward and backward; its kernels in kernels/moe_triton.py). Imported on first use: this module
  does not import triton.
Every impl returns x's dtype; the sigmoid routers' fp32 weights are combined in fp32 (grouped, torch, triton) or
cast to x's dtype first (dense).

CPU fp32 fwd+bwd, one thread (bench/moe_kernels.py): the torch reference is 4.2x HF's eager loop at 32 experts
top-4 (H 512, I 256), 0.9x at the tiny demo model's 8 experts top-2, and 0.8x at both sizes the transformers default
``grouped_mm`` experts (torch._grouped_mm; its CPU kernels do fp32 forward and backward). In the engine on the tiny
MoE (8 experts top-2, bench/sampler_throughput.py's workload, 2 CPU cores, best of 5-7): grouped 0.32-0.36 s,
dense 0.47 s, dense as one [E·2I, H] linear 0.42 s, an expert-major padded bmm 0.44 s. One Nemotron-H MoE layer
(tiny model's: H 128, 8 squared-ReLU experts of 128 top-2, shared expert 256; router, experts and shared expert),
2,500 tokens, fwd+bwd, 1 thread, best of 30 (a loaded machine): HF's eager loop 35.6 ms, transformers'
``grouped_mm`` 33.3 ms, ours grouped 33.1 ms (torch reference 42.4 ms); 512 tokens: 11.1 / 7.1 / 7.5 / 7.5 ms.

Run: ``.venv/bin/pytest -q tests/test_moe_kernels.py tests/test_moe_families.py tests/test_experts.py
tests/test_torch_model.py``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

Impl = Literal["grouped", "dense", "torch", "triton"]


# --- routing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """How a token's router logits become its experts and their weights (a family's router settings)."""

    top_k: int  # experts per token
    normalize: bool = True  # the k weights renormalised to sum to 1 (HF's ``norm_topk_prob``)
    router: str = "softmax_topk"  # the family, a ``ROUTERS`` name: softmax_topk | sigmoid_group_topk
    n_group: int = 1  # expert groups (sigmoid_group_topk): experts e·E/n_group.. form group e
    topk_group: int = 1  # groups kept per token (sigmoid_group_topk): the top-k is taken among their experts only
    scaling: float = 1.0  # routed_scaling_factor: the k weights are multiplied by it after normalising


Bias = torch.Tensor | None  # a router's score-correction bias [E] (HF ``e_score_correction_bias``), or None


class Router(NamedTuple):
    """One router family: ``select(logits, routing, bias)`` -> (weights [N, k], expert ids [N, k]);
    ``weigh(logits, ids, routing)`` -> the weights [N, k] of experts chosen elsewhere (routing replay: the bias
    and the group limit choose experts, they never weigh them). ``fp32_logits``: the logits are computed in fp32
    from fp32 weights whatever x's dtype (``route``), as HF's sigmoid routers do."""

    select: Callable[[torch.Tensor, Routing, Bias], tuple[torch.Tensor, torch.Tensor]]
    weigh: Callable[[torch.Tensor, torch.Tensor, Routing], torch.Tensor]
    fp32_logits: bool = False


def softmax_topk(logits: torch.Tensor, routing: Routing, bias: Bias = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: softmax (fp32) over all experts, top-k; renormalised, a softmax over the top-k logits alone.
    Weights in the logits' dtype, as HF returns them."""
    if bias is not None:
        raise ValueError("router softmax_topk takes no score-correction bias")
    if routing.normalize:
        top, experts = logits.topk(routing.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float)
    else:
        weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float).topk(routing.top_k, dim=-1)
    return (weights if routing.scaling == 1.0 else weights * routing.scaling).to(logits.dtype), experts


def softmax_weights(logits: torch.Tensor, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Qwen3-MoE's fp32 weights of the given experts, as HF computes them: softmax (fp32), picked, renormalised."""
    picked = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    picked = picked / picked.sum(dim=-1, keepdim=True) if routing.normalize else picked
    return picked if routing.scaling == 1.0 else picked * routing.scaling


def sigmoid_group_topk(logits: torch.Tensor, routing: Routing, bias: Bias = None) -> tuple[torch.Tensor, ...]:
    """Nemotron-H and DeepSeek-V3 (HF ``NemotronHTopkRouter`` / ``DeepseekV3TopkRouter``, the same code, op for
    op): sigmoid scores (fp32); the choice on scores + bias: a group's score is the sum of its two best biased
    scores, the ``topk_group`` best groups are kept, the top-k taken among their experts; the weights are the
    unbiased scores of the chosen experts (``sigmoid_weights``), fp32 as HF returns them."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    n, experts = choice.shape
    groups = routing.n_group
    group_scores = choice.view(n, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    kept = group_scores.topk(routing.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(n, groups, experts // groups).reshape(n, experts)
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(routing.top_k, dim=-1, sorted=False)[1]
    return _scale_sigmoid(scores.gather(1, ids), routing), ids


def _scale_sigmoid(picked: torch.Tensor, routing: Routing) -> torch.Tensor:
    if routing.normalize:
        picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
    return picked * routing.scaling


def sigmoid_weights(logits: torch.Tensor, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The sigmoid routers' weights of the given experts: their unbiased scores, / (sum + 1e-20) when
    ``normalize``, times ``scaling`` (HF's formula, fp32)."""
    return _scale_sigmoid(logits.float().sigmoid().gather(1, ids), routing)


ROUTERS: dict[str, Router] = {
    "softmax_topk": Router(softmax_topk, softmax_weights),
    "sigmoid_group_topk": Router(sigmoid_group_topk, sigmoid_weights, fp32_logits=True),
}


def _router(routing: Routing) -> Router:
    if routing.router not in ROUTERS:
        raise ValueError(f"unknown router {routing.router!r}; choose one of {sorted(ROUTERS)}")
    return ROUTERS[routing.router]


def select_experts(logits: torch.Tensor, routing: Routing, bias: Bias = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], expert ids [N, k]) of router logits [N, E]; ``bias``: the score-correction bias [E]."""
    return _router(routing).select(logits, routing, bias)


def weigh_experts(logits: torch.Tensor, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The fp32 weights [N, k] the family gives experts ``ids`` [N, k] chosen elsewhere (R3)."""
    return _router(routing).weigh(logits, ids, routing)


def route(x: torch.Tensor, router_weight: torch.Tensor, routing: Routing,
          bias: Bias = None) -> tuple[torch.Tensor, ...]:
    """(router logits [N, E] = x @ router_weightᵀ, weights [N, k], expert ids [N, k]); the logits in fp32 for a
    family whose router computes them so (``Router.fp32_logits``), else in x's dtype."""
    if _router(routing).fp32_logits:
        x, router_weight = x.float(), router_weight.float()
    logits = F.linear(x, router_weight)
    return logits, *select_experts(logits, routing, bias)


# --- activations -----------------------------------------------------------------------------------------------


def swiglu(h: torch.Tensor, dim: int) -> torch.Tensor:
    """silu(gate) * up, ``h`` holding the gate units then the up units along ``dim`` (gate_up [E, 2I, H])."""
    gate, up = h.chunk(2, dim=dim)
    return F.silu(gate) * up


def relu2(h: torch.Tensor, dim: int) -> torch.Tensor:
    """Squared ReLU, relu(h)², not gated: the first projection is HF's ``up_proj`` [E, I, H] (Nemotron-H)."""
    return F.relu(h).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"swiglu": swiglu, "relu2": relu2}
GATED: dict[str, bool] = {"swiglu": True, "relu2": False}  # does the first projection hold gate and up rows


# --- experts -----------------------------------------------------------------------------------------------------


def expert_counts(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert [E] (int64) from the ascending expert ids: a binary search per expert. Not
    ``torch.bincount``, whose CUDA kernel reads the largest id back to the host to size its output (a sync)."""
    experts = torch.arange(num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    bounds = torch.searchsorted(sorted_ids, experts)
    return bounds.diff()


def experts_torch(x, topk_weights, topk_ids, gate_up, down, activation: str = "swiglu") -> torch.Tensor:
    """All experts as two bmm over a capacity-padded batch [E, C, H], C the largest expert load (one host sync);
    autograd gives the backward. E·C rows: about N·k when the load is balanced, E times that when one expert takes
    every token. Matches HF to fp32 rounding."""
    n, k = topk_ids.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts)
    slot = torch.empty_like(ids)  # position of each pair among its expert's pairs
    slot[order] = torch.arange(ids.numel(), device=ids.device) - (counts.cumsum(0) - counts)[ids[order]]
    capacity = int(counts.max())  # host sync: sizes the padded batch
    dest = ids * capacity + slot  # row of each pair in the flattened [E * C, H] batch
    # index_copy / index_select on flat rows: their backwards are index_select / index_add, no sort, no zeros per expert
    pair_x = x.unsqueeze(1).expand(n, k, hidden).reshape(n * k, hidden)
    xs = x.new_zeros(num_experts * capacity, hidden).index_copy(0, dest, pair_x).view(num_experts, capacity, hidden)
    # W @ xsᵀ rather than xs @ Wᵀ: the weight gradients then come out of bmm in the parameters' own layout; the
    # other way round autograd copies every weight gradient through a transpose (~20% of the step on CPU).
    act = ACTIVATIONS[activation](torch.bmm(gate_up, xs.transpose(1, 2)), 1)  # [E, I, C]
    out = torch.bmm(down, act)  # [E, H, C]; padding columns are zeros, never read
    pair_out = out.transpose(1, 2).reshape(-1, hidden).index_select(0, dest).view(n, k, hidden)
    return (pair_out * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # fp32 weights (sigmoid routers): sum in fp32


class _TokenRows(torch.autograd.Function):
    """``x.index_select(0, order // k)``: each token's row once per slot, in expert-sorted pair order. Backward:
    for each slot in turn, the rows' gradients gathered through the inverse permutation and added into an fp32
    accumulator (x's dtype if wider), rounded once: gathers and a fixed order, no atomics, the same bits on every
    run. ``index_select``'s own backward is an ``index_add`` with each token's index k times: on CUDA atomic adds
    in an arbitrary order (in bf16 a rounding per add), other bits on another run (seen on an H200)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.tokens, ctx.k = x.shape[0], k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        # argsort of a permutation is its inverse: the sorted row of pair n·k + slot, here [slot, n]
        rows = torch.argsort(order).view(ctx.tokens, ctx.k).t().contiguous()
        dx = grad.index_select(0, rows[0]).to(torch.promote_types(grad.dtype, torch.float))
        for slot in range(1, ctx.k):
            dx += grad.index_select(0, rows[slot])
        return dx.to(grad.dtype), None, None


def experts_grouped(x, topk_weights, topk_ids, gate_up, down, activation: str = "swiglu") -> torch.Tensor:
    """transformers' ``grouped_mm`` experts, with deterministic gathers: pairs sorted by expert, one grouped GEMM
    per projection (``torch.nn.functional.grouped_mm`` where the device has it, transformers' fallback
    elsewhere). x's rows are gathered by ``_TokenRows`` (forward ``index_select``; backward gathers through the
    inverse permutation, each token's k slots summed in slot order in fp32) and the outputs put back in (token, slot)
    order with ``index_copy``, every index once (its backward is ``index_select``, a gather). transformers indexes
    ``x[perm // k]`` and ``out[inv_perm]`` instead, whose backward is an accumulating ``index_put_``: on CPU that
    was 10 % of a tiny-model training step; and any accumulating index op (``index_put_``, ``index_add``) adds a
    token's k rows with atomics on CUDA, in an arbitrary order.

    The k outputs of a token are combined by one batched GEMM, ``[1, k] @ [k, H]`` per token: products and sum in
    fp32 (cuBLAS and the CPU kernels accumulate bf16 in fp32), one rounding to x's dtype at the end. (It was an
    ``index_add`` in x's dtype: in bf16 a rounding per product and per partial sum, and on CUDA atomic adds in an
    arbitrary order.) No index op here accumulates, forward or backward (tests/test_moe_kernels.py walks the
    autograd graph for one): sort, gathers, copies to unique indices, GEMMs and fixed-shape reductions, the same
    bits on every run (checked on CUDA by the same file). Costs one more [N·k, H] copy than the ``index_add``:
    fwd+bwd of one layer, CPU fp32, 2 threads (best of 60, a shared machine): 9.5 ms against 8.2 ms at the tiny
    model's shape (2,500 tokens, H 128, 8 experts top-2), no slower at 50m's (4,500 tokens, H 512). x's gradient by
    ``_TokenRows``' gathers rather than ``index_select``'s ``index_add``: 0.37 ms against 0.14 at the tiny shape,
    2.3 against 1.6 ms at 50m's (that backward alone, best of 200, a heavily loaded machine).

    No host sync: the per-expert offsets come from a binary search over the sorted ids (``torch.bincount`` syncs
    on CUDA). On CUDA, ``grouped_mm`` runs torch's CUTLASS grouped GEMM for bf16 on sm_90/sm_100; fp32 (and bf16
    elsewhere) takes torch's fallback, a loop of one ``mm`` per expert after copying the offsets to the host."""
    from transformers.integrations.moe import _grouped_mm  # dispatcher: torch's kernel, or transformers' fallback

    n, k = topk_ids.shape
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    offsets = expert_counts(sorted_ids, gate_up.shape[0]).cumsum(0).to(torch.int32)
    h = _grouped_mm(_TokenRows.apply(x, order, k), gate_up.transpose(1, 2), offs=offsets)
    out = _grouped_mm(ACTIVATIONS[activation](h, -1), down.transpose(1, 2), offs=offsets)  # [N·k, H], by expert
    pair_out = out.new_empty(out.shape).index_copy(0, order, out).view(n, k, out.shape[1])  # row n·k + slot
    # fp32 weights (the sigmoid routers') with bf16 experts: the combine in fp32, as HF's experts do it (no bf16
    # rounding of weights up to ``scaling``); one [N·k, H] fp32 copy, only then
    dtype = torch.promote_types(topk_weights.dtype, out.dtype)
    return torch.bmm(topk_weights.to(dtype).unsqueeze(1), pair_out.to(dtype)).squeeze(1).to(x.dtype)


def experts_dense(x, topk_weights, topk_ids, gate_up, down, activation: str = "swiglu") -> torch.Tensor:
    """Every expert on every token (bmm over experts), weighted by a routing that is zero outside the top-k: no
    sort and no host read, E/k times grouped's arithmetic. (Gathering each pair's expert matrices for a bmm was
    5-10x slower than this in the engine: the copies cost more than the arithmetic saved.)"""
    n_experts = gate_up.shape[0]
    dense_w = torch.zeros(x.shape[0], n_experts, dtype=x.dtype, device=x.device)
    dense_w = dense_w.scatter(1, topk_ids, topk_weights.to(x.dtype))  # the sigmoid routers' weights are fp32
    h = torch.bmm(x.expand(n_experts, -1, -1), gate_up.transpose(1, 2))  # [E, N, 2I] (SwiGLU) or [E, N, I]
    return torch.bmm(ACTIVATIONS[activation](h, -1) * dense_w.T[..., None], down.transpose(1, 2)).sum(0)


def experts_triton(x, topk_weights, topk_ids, gate_up, down, activation: str = "swiglu") -> torch.Tensor:
    """kernels/moe_blocked.py's Triton experts, imported here so that the other experts never import triton."""
    from .moe_blocked import experts_triton as triton_experts

    return triton_experts(x, topk_weights, topk_ids, gate_up, down, activation)


# --- public API --------------------------------------------------------------------------------------------------

EXPERTS: dict[str, Callable[..., torch.Tensor]] = {"grouped": experts_grouped, "dense": experts_dense,
                                                   "torch": experts_torch, "triton": experts_triton}


def moe_experts(x, topk_weights, topk_ids, gate_up, down, impl: Impl = "torch",
                activation: str = "swiglu") -> torch.Tensor:
    """y [N, H] = Σ_k topk_weights[n, k] · expert_{topk_ids[n, k]}(x[n]), in x's dtype: HF's Experts.forward
    (``gate_up`` [E, 2I, H] for a gated activation, HF's ``gate_up_proj``; [E, I, H] otherwise, its ``up_proj``)."""
    if impl not in EXPERTS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {sorted(EXPERTS)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
    return EXPERTS[impl](x, topk_weights, topk_ids, gate_up, down, activation)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int | Routing,
    impl: Impl = "torch",
    return_router_logits: bool = False,
    bias: Bias = None,
    activation: str = "swiglu",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A sparse MoE block's routed part on x [..., H] (HF Qwen3MoeSparseMoeBlock for ``top_k`` an int): route,
    run the experts, combine; router logits are [N, E] as in HF. ``top_k``: k for Qwen3-MoE's routing, or a
    family's ``Routing``; ``bias``: its score-correction bias [E].

    Differentiable in all four tensors (the router through the top-k weights)."""
    routing = top_k if isinstance(top_k, Routing) else Routing(top_k)
    flat = x.reshape(-1, x.shape[-1])
    logits, weights, ids = route(flat, router_weight, routing, bias)
    y = moe_experts(flat, weights, ids, gate_up, down, impl, activation).view(x.shape)
    return (y, logits) if return_router_logits else y

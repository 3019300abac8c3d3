"""The Triton experts of kernels/moe.py (``impl="triton"``): the block-padded algorithm, its autograd Function,
and a torch twin of every launcher. The layout and the kernels are in kernels/moe_triton.py.

    y = experts_triton(x, topk_weights, topk_ids, gate_up, down)        # HF's layout (kernels/moe.py)
    y = experts_blocked(x, w, ids, gate_up, down, stages=TORCH_STAGES)  # the same algebra on torch twins (CPU, ms)

  1. Layout (``plan_blocks``, torch ops, no host sync): pairs sorted by expert (stable), each expert's rows padded to a
     multiple of BLOCK_M, as vLLM's ``moe_align_block_size``. ``Plan.sorted_pair[r]`` is the pair (token·k + slot)
     held by padded row r, or -1 for padding; ``block_expert[b]`` is the expert owning rows [b·BLOCK_M, (b+1)·BLOCK_M)
     (-1 past the last used block: the buffer is sized for the worst case, S + min(E, S)·(BLOCK_M − 1) rows, so no
     count has to come back to the host; those programs exit at once); ``expert_start`` gives each expert's row
     range; ``pair_row`` is the inverse map. Every M tile thus belongs to one expert and reads one weight matrix.
  2. ``gate_up_act``: grouped GEMM reading x rows through ``sorted_pair // k`` (the permutation is fused into the
     load; padding rows read zeros), the activation in the epilogue: SwiGLU (gate and up tiles accumulated side by
     side) or squared ReLU (one tile, no gate). Writes ``act [P, I]`` and, when a gradient is needed, the
     pre-activations ``h`` ([P, 2I] for SwiGLU, [P, I] for squared ReLU).
  3. ``grouped_mm``: ``o = act @ down[e]ᵀ`` per M tile (any weight strides, so the same kernel serves the backward).
  4. ``combine``: un-permute + weighted sum, ``y[n] = Σ_k w[n,k] · o[pair_row[n,k]]``, one program per
     (token, H tile), fp32 accumulation, no atomics (deterministic).
  Backward (``torch.autograd.Function``): ``combine_bwd`` scatters ``d_o[row] = w · dy[n]`` into the padded layout and
  reduces ``dw[n,k] = <o[row], dy[n]>``; ``grouped_mm_act_bwd`` computes ``d_act = d_o @ down[e]`` with the
  activation's derivative in its epilogue (→ ``dh``, h's shape); ``dx`` = ``combine(grouped_mm(dh, gate_up[e]),
  w=None)``;
  ``grouped_wgrad`` computes per-expert weight gradients ``d gate_up[e] = dhₑᵀ x[tokens of e]`` and
  ``d down[e] = d_oₑᵀ actₑ``, each program looping over its expert's rows only (an expert with no rows writes zeros).
  Saved for backward: h, act, o (P·(3I + H) elements; P·(2I + H) for squared ReLU) plus the plan. Inputs fp32 or
  bf16; every GEMM accumulates in fp32 (``tl.dot``; fp32 inputs use ``input_precision="ieee"``); intermediates are
  stored in x's dtype.

The activation is fused into the kernels (``gate_up_act``, ``grouped_mm_act_bwd``; a constexpr, so one compiled
kernel per activation): ``FUSED_ACTIVATIONS`` = swiglu (Qwen3-MoE, DeepSeek-V3, Qwen3-Next) and relu2 (Nemotron-H,
not gated). ``fused_activation``, a pure function, refuses any other one: no silent fallback.
Each Triton launcher has a torch twin with the same signature (``TORCH_STAGES``, loops over experts, for tests only);
``experts_blocked(..., stages=TORCH_STAGES)`` runs the same autograd Function on them, which checks the backward
algebra on CPU in milliseconds.

Run: ``.venv/bin/pytest -q tests/test_moe_kernels.py`` (without CUDA the tests set ``TRITON_INTERPRET=1``; Triton
then runs the kernels in its numpy interpreter, fp32, small shapes, BLOCK_* = 16), and
``.venv/bin/python bench/moe_kernels.py [--quick]`` (GPU: loop vs grouped_mm vs torch reference vs Triton, bf16).

Tiles: ``launch_blocks(dtype)`` (kernels/moe_triton.py), one pure function that every launcher and the
ahead-of-time compile test (tests/test_triton_aot.py: every kernel, forward and backward, for sm_90 at
Nemotron-3-Nano- and Qwen3-30B-A3B-like shapes, bf16 and fp32) use.

Untested here: running on a GPU. The kernels were executed only by the interpreter (fp32) and compiled for sm_90
ahead of time (triton 3.6.0, 3.7.1, 3.9.0: shared memory within limits, no register spills; the squared-ReLU
variants, which that test does not build, once by hand with triton 3.9.0 at its shapes: at most 72 KB of shared
memory, 116 registers, no spills); bf16 numerics and all speed figures are pending a GPU run
(tests/test_moe_kernels.py runs on CUDA when there is one).
``impl="triton"`` on a CPU tensor without the interpreter raises.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .moe import ACTIVATIONS
from .moe_triton import (  # noqa: F401  (re-exported: the kernels' side, for tests and benchmarks)
    CUDA_BLOCKS,
    FUSED_ACTIVATIONS,
    INTERPRETED,
    INTERPRETER_BLOCKS,
    Blocks,
    Plan,
    _blocks,
    combine,
    combine_bwd,
    fused_activation,
    gate_up_act,
    grouped_mm,
    grouped_mm_act_bwd,
    grouped_wgrad,
    launch_blocks,
    plan_blocks,
)

# --- the torch twins of the Triton launchers (kernels/moe_triton.py; same signatures) ----------------------------


def _expert_rows(plan: Plan) -> list[tuple[int, int]]:
    bounds = plan.expert_start.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _pair_tokens(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    real = plan.sorted_pair >= 0
    return torch.where(real, plan.sorted_pair // plan.top_k, 0).long(), real


def gate_up_act_torch(x, gate_up, plan, save_h, activation="swiglu"):
    fused_activation(activation)  # the same refusal as the kernels
    token, real = _pair_tokens(plan)
    xs = x[token] * real[:, None]
    h = x.new_zeros(plan.sorted_pair.numel(), gate_up.shape[1])
    for e, (s, t) in enumerate(_expert_rows(plan)):
        h[s:t] = xs[s:t] @ gate_up[e].T
    return (h if save_h else None), ACTIVATIONS[activation](h, -1)


def grouped_mm_torch(a, w, plan):
    c = a.new_zeros(a.shape[0], w.shape[2])
    for e, (s, t) in enumerate(_expert_rows(plan)):
        c[s:t] = a[s:t] @ w[e]
    return c


def _swiglu_bwd(d_act, h):
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * F.silu(gate)], dim=-1)


ACTIVATION_BWD = {"swiglu": _swiglu_bwd, "relu2": lambda d_act, h: d_act * 2 * F.relu(h)}  # dh from d_act, h


def grouped_mm_act_bwd_torch(d_o, down, h, plan, activation="swiglu"):
    fused_activation(activation)
    return ACTIVATION_BWD[activation](grouped_mm_torch(d_o, down, plan), h)


def grouped_wgrad_torch(a, b, plan, num_experts, gather):
    token, real = _pair_tokens(plan)
    src = b[token] * real[:, None] if gather else b
    dw = a.new_zeros(num_experts, a.shape[1], b.shape[1])
    for e, (s, t) in enumerate(_expert_rows(plan)):
        dw[e] = a[s:t].T @ src[s:t]
    return dw


def combine_torch(o, weights, plan):
    picked = o[plan.pair_row.long()].view(plan.num_tokens, plan.top_k, -1).float()
    if weights is not None:
        picked = picked * weights.float().unsqueeze(-1)
    return picked.sum(dim=1).to(o.dtype)


def combine_bwd_torch(dy, o, weights, plan):
    rows = plan.pair_row.long()
    pair_dy = dy.float().repeat_interleave(plan.top_k, dim=0)
    d_o = torch.zeros_like(o)
    d_o[rows] = (pair_dy * weights.float().reshape(-1, 1)).to(o.dtype)
    return d_o, (o[rows].float() * pair_dy).sum(-1).view(plan.num_tokens, plan.top_k)


class Stages(NamedTuple):
    gate_up_act: Callable
    grouped_mm: Callable
    grouped_mm_act_bwd: Callable
    grouped_wgrad: Callable
    combine: Callable
    combine_bwd: Callable


TRITON_STAGES = Stages(gate_up_act, grouped_mm, grouped_mm_act_bwd, grouped_wgrad, combine, combine_bwd)
TORCH_STAGES = Stages(
    gate_up_act_torch, grouped_mm_torch, grouped_mm_act_bwd_torch, grouped_wgrad_torch, combine_torch,
    combine_bwd_torch,
)  # fmt: skip


# --- autograd ----------------------------------------------------------------------------------------------------


class _BlockedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, gate_up, down, plan: Plan, stages: Stages, save: bool, activation: str):
        h, act = stages.gate_up_act(x, gate_up, plan, save, activation)
        o = stages.grouped_mm(act, down.mT, plan)
        y = stages.combine(o, topk_weights, plan)
        if save:
            ctx.save_for_backward(x, topk_weights, gate_up, down, h, act, o)
        ctx.plan, ctx.stages, ctx.activation = plan, stages, activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_weights, gate_up, down, h, act, o = ctx.saved_tensors
        plan, st, (need_x, need_w, need_gu, need_down) = ctx.plan, ctx.stages, ctx.needs_input_grad[:4]
        d_o, dw = st.combine_bwd(dy.contiguous(), o, topk_weights, plan)
        dx = d_gate_up = d_down = None
        if need_x or need_gu:
            dh = st.grouped_mm_act_bwd(d_o, down, h, plan, ctx.activation)
            if need_x:
                dx = st.combine(st.grouped_mm(dh, gate_up, plan), None, plan)
            if need_gu:
                d_gate_up = st.grouped_wgrad(dh, x, plan, gate_up.shape[0], True)
        if need_down:
            d_down = st.grouped_wgrad(d_o, act, plan, down.shape[0], False)
        return dx, (dw.to(topk_weights.dtype) if need_w else None), d_gate_up, d_down, None, None, None, None


def experts_blocked(x, topk_weights, topk_ids, gate_up, down, stages: Stages = TRITON_STAGES, block_m: int = 0,
                    activation: str = "swiglu"):
    """The block-padded algorithm with the given stages (TRITON_STAGES, or TORCH_STAGES to test the algebra) and
    a fused activation (``FUSED_ACTIVATIONS``: swiglu, gate_up [E, 2I, H]; relu2, gate_up [E, I, H])."""
    fused_activation(activation)
    plan = plan_blocks(topk_ids, gate_up.shape[0], block_m or _blocks(x).m)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, gate_up, down))
    return _BlockedExperts.apply(x, topk_weights, gate_up, down, plan, stages, save, activation)


def experts_triton(x, topk_weights, topk_ids, gate_up, down, activation: str = "swiglu") -> torch.Tensor:
    """Triton kernels for the experts (routing already done); see the module docstring."""
    fused_activation(activation)  # refuses an activation the kernels do not fuse
    if not (x.is_cuda or INTERPRETED):
        raise RuntimeError(
            "moe impl='triton' needs a CUDA tensor, or TRITON_INTERPRET=1 set before cascade_rl.kernels.moe is "
            "imported (the interpreter: slow, for tests); use impl='torch' on CPU"
        )
    devices = {t.device for t in (x, topk_weights, topk_ids, gate_up, down)}
    if len(devices) > 1:  # a kernel handed a pointer into another device's memory faults, or reads garbage
        raise ValueError(f"moe impl='triton' needs every tensor on one device, got {sorted(map(str, devices))}")
    if not x.dtype == gate_up.dtype == down.dtype:
        raise TypeError(
            f"moe impl='triton' needs one dtype, got x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
        )
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    return experts_blocked(x, topk_weights.contiguous(), topk_ids, gate_up, down, TRITON_STAGES, 0, activation)

"""Qwen3-MoE sparse block (router + SwiGLU experts), forward and backward: a torch reference and Triton kernels.

One interface, two implementations, registered by name in ``EXPERTS``::

    y = moe_forward(x, router_weight, gate_up, down, top_k, impl="torch" | "triton")
    y = moe_experts(x, topk_weights, topk_ids, gate_up, down, impl=...)   # routing already done (HF's Experts.forward)

Shapes: ``x [N, H]``, ``router_weight [E, H]``, ``gate_up [E, 2I, H]`` (gate rows then up rows, HF's fused
``gate_up_proj``), ``down [E, H, I]``. Semantics are HF's ``Qwen3MoeSparseMoeBlock`` (transformers 5.19,
``norm_topk_prob=True``): logits = x @ routerᵀ, softmax in fp32 over all experts, top-k, the k weights
renormalised to sum to 1 and cast back to x's dtype, ``y[n] = Σ_k w[n,k] · down_e(silu(gate_e x) * up_e x)``.
Routing (softmax, top-k) is torch in both implementations; it is discrete, so the router gets its gradient through
the renormalised top-k weights, by torch autograd, from ``d w[n,k] = <expert output, dy[n]>``.

torch reference (``impl="torch"``, ``experts_torch``): the N·k (token, slot) pairs are sorted by expert and scattered
into a capacity-padded batch ``[E, C, H]`` with C = the largest expert load (one host sync), two ``bmm`` run all
experts at once (no Python loop), and the pairs are gathered back and weighted. Autograd does the backward. It costs
E·C rows, which is about N·k when the load is balanced and E times that when one expert takes every token. It
matches HF to fp32 rounding. CPU fp32 fwd+bwd, one thread (bench/moe_kernels.py): 4.2x HF's eager loop at 32
experts top-4 (H 512, I 256), 0.9x at the tiny demo model's 8 experts top-2, and 0.8x at both sizes the
transformers default ``grouped_mm`` experts (torch._grouped_mm; its CPU kernels do fp32 forward and backward).

Triton (``impl="triton"``, ``experts_triton``):
  1. Layout (``plan_blocks``, torch ops, no host sync): pairs sorted by expert (stable), each expert's rows padded to a
     multiple of BLOCK_M, as vLLM's ``moe_align_block_size``. ``Plan.sorted_pair[r]`` is the pair (token·k + slot)
     held by padded row r, or -1 for padding; ``block_expert[b]`` is the expert owning rows [b·BLOCK_M, (b+1)·BLOCK_M)
     (-1 past the last used block: the buffer is sized for the worst case, S + min(E, S)·(BLOCK_M − 1) rows, so no
     count has to come back to the host; those programs exit at once); ``expert_start`` gives each expert's row
     range; ``pair_row`` is the inverse map. Every M tile thus belongs to one expert and reads one weight matrix.
  2. ``gate_up_swiglu``: grouped GEMM reading x rows through ``sorted_pair // k`` (the permutation is fused into the
     load; padding rows read zeros), gate and up tiles accumulated side by side, SwiGLU in the epilogue. Writes
     ``act [P, I]`` and, when a gradient is needed, the pre-activations ``h [P, 2I]``.
  3. ``grouped_mm``: ``o = act @ down[e]ᵀ`` per M tile (any weight strides, so the same kernel serves the backward).
  4. ``combine``: un-permute + weighted sum, ``y[n] = Σ_k w[n,k] · o[pair_row[n,k]]``, one program per
     (token, H tile), fp32 accumulation, no atomics (deterministic).
  Backward (``torch.autograd.Function``): ``combine_bwd`` scatters ``d_o[row] = w · dy[n]`` into the padded layout and
  reduces ``dw[n,k] = <o[row], dy[n]>``; ``grouped_mm_swiglu_bwd`` computes ``d_act = d_o @ down[e]`` with the SwiGLU
  derivative in its epilogue (→ ``dh [P, 2I]``); ``dx`` = ``combine(grouped_mm(dh, gate_up[e]), w=None)``;
  ``grouped_wgrad`` computes per-expert weight gradients ``d gate_up[e] = dhₑᵀ x[tokens of e]`` and
  ``d down[e] = d_oₑᵀ actₑ``, each program looping over its expert's rows only (an expert with no rows writes zeros).
  Saved for backward: h, act, o (P·(3I + H) elements) plus the plan. Inputs fp32 or bf16; every GEMM accumulates
  in fp32 (``tl.dot``; fp32 inputs use ``input_precision="ieee"``); intermediates are stored in x's dtype.

Each Triton launcher has a torch twin with the same signature (``TORCH_STAGES``, loops over experts, for tests only);
``experts_blocked(..., stages=TORCH_STAGES)`` runs the same autograd Function on them, which checks the backward
algebra on CPU in milliseconds.

Run: ``.venv/bin/pytest -q tests/test_moe_kernels.py`` (without CUDA the tests set ``TRITON_INTERPRET=1``; Triton
then runs the kernels in its numpy interpreter, fp32, small shapes, BLOCK_* = 16), and
``.venv/bin/python bench/moe_kernels.py [--quick]`` (GPU: loop vs grouped_mm vs torch reference vs Triton, bf16).

Untested here: everything on a GPU. The kernels were only executed by the interpreter (fp32); bf16, compilation
for sm90, the CUDA block sizes in ``CUDA_BLOCKS`` and all speed figures are pending a GPU run. ``impl="triton"`` on
a CPU tensor without the interpreter raises.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

Impl = Literal["triton", "torch"]

# Kernels are JIT functions or interpreter functions depending on TRITON_INTERPRET when this module is imported.
INTERPRETED = bool(triton.knobs.runtime.interpret)


# --- routing (torch, shared) -----------------------------------------------------------------------------------


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF Qwen3MoeTopKRouter: (logits [N, E], renormalised top-k weights [N, k] in x's dtype, expert ids [N, k])."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


# --- torch reference ---------------------------------------------------------------------------------------------


def experts_torch(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """All experts as two bmm over a capacity-padded batch [E, C, H]; autograd gives the backward."""
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
    gate, up = torch.bmm(gate_up, xs.transpose(1, 2)).chunk(2, dim=1)  # [E, I, C] each
    out = torch.bmm(down, F.silu(gate) * up)  # [E, H, C]; padding columns are zeros, never read
    pair_out = out.transpose(1, 2).reshape(-1, hidden).index_select(0, dest).view(n, k, hidden)
    return (pair_out * topk_weights.unsqueeze(-1)).sum(dim=1)


# --- block-padded layout -----------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """Expert-major, block-padded layout of the N·k (token, slot) pairs; see the module docstring."""

    sorted_pair: torch.Tensor  # [P] int32: pair id (token * top_k + slot) of each padded row, -1 for padding
    block_expert: torch.Tensor  # [P / block_m] int32: expert owning each block of rows, -1 for unused blocks
    expert_start: torch.Tensor  # [E + 1] int32: expert e owns padded rows [expert_start[e], expert_start[e + 1])
    pair_row: torch.Tensor  # [N * top_k] int32: padded row of each pair (inverse of sorted_pair)
    top_k: int
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.pair_row.numel() // self.top_k


def plan_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Plan:
    """moe_align_block_size in torch ops (sort, bincount, cumsum, scatter): O(S log S), no host sync."""
    ids = topk_ids.reshape(-1).long()
    pairs, dev = ids.numel(), ids.device
    counts = torch.bincount(ids, minlength=num_experts)
    padded_end = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    expert_start = F.pad(padded_end, (1, 0))
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_ids]
    row = expert_start[sorted_ids] + rank
    # Worst case over all routings of this size, so that no count has to reach the host.
    rows = math.ceil((pairs + min(num_experts, pairs) * (block_m - 1)) / block_m) * block_m
    sorted_pair = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    sorted_pair[row] = order.int()
    pair_row = torch.empty(pairs, dtype=torch.int32, device=dev)
    pair_row[order] = row.int()
    block_first = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_first, right=True)
    block_expert = torch.where(block_first < padded_end[-1], block_expert, -1).int()
    return Plan(sorted_pair, block_expert, expert_start.int(), pair_row, topk_ids.shape[1], block_m)


# --- Triton kernels ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    m: int  # rows per block of the layout (the alignment unit) = M tile of the row GEMMs
    n: int  # N tile of grouped_mm
    gate_up_n: int  # N tile of gate_up_swiglu (two accumulators of this width)
    k: int  # K tile of the row GEMMs, and row step of grouped_wgrad (must divide m)
    wgrad_m: int  # output tiles of grouped_wgrad
    wgrad_n: int
    h: int  # columns per program of combine / combine_bwd
    num_warps: int
    num_stages: int


# Interpreter: smallest tiles tl.dot takes, so that tiny test shapes cross tile edges. CUDA: vLLM-like bf16 tiles
# for Hopper, not tuned (no GPU was available when this was written).
INTERPRETER_BLOCKS = Blocks(m=16, n=16, gate_up_n=16, k=16, wgrad_m=16, wgrad_n=16, h=16, num_warps=1, num_stages=1)
CUDA_BLOCKS = Blocks(m=64, n=128, gate_up_n=64, k=64, wgrad_m=128, wgrad_n=128, h=512, num_warps=8, num_stages=3)


def _blocks(t: torch.Tensor) -> Blocks:
    return CUDA_BLOCKS if t.is_cuda and not INTERPRETED else INTERPRETER_BLOCKS


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands


@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, w_ptr, h_ptr, act_ptr, sorted_pair_ptr, block_expert_ptr,
    H, INTER, top_k,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn, stride_am, stride_an,
    SAVE_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(sorted_pair_ptr + rows)
    real = pair >= 0
    token = tl.where(real, pair // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        xb = tl.load(x_ptr + token[:, None] * stride_xm + ks[None, :] * stride_xk,
                     mask=real[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + INTER) * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_gate = tl.dot(xb, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(xb, w_up, acc_up, input_precision=PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    mask = col_ok[None, :]
    tl.store(act_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an,
             act.to(act_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    if SAVE_H:
        h_rows = h_ptr + rows[:, None] * stride_hm
        tl.store(h_rows + cols[None, :] * stride_hn, acc_gate.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(h_rows + (cols[None, :] + INTER) * stride_hn, acc_up.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, w_ptr, c_ptr, h_ptr, block_expert_ptr,
    K, N,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn, stride_hm, stride_hn,
    SWIGLU_BWD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """c[rows] = a[rows] @ w[e] ([K, N] through strides). SWIGLU_BWD: c is d_act, the epilogue writes dh = [dg, du]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    mask = col_ok[None, :]
    if SWIGLU_BWD:  # N = I; h = [gate | up] pre-activations; act = silu(g) * u
        h_rows = h_ptr + rows[:, None] * stride_hm
        g = tl.load(h_rows + cols[None, :] * stride_hn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_rows + (cols[None, :] + N) * stride_hn, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        d_gate = acc * u * sig * (1.0 + g * (1.0 - sig))
        d_up = acc * g * sig
        c_rows = c_ptr + rows[:, None] * stride_cm
        tl.store(c_rows + cols[None, :] * stride_cn, d_gate.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_rows + (cols[None, :] + N) * stride_cn, d_up.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, dw_ptr, sorted_pair_ptr, expert_start_ptr,
    M, N, top_k,
    stride_ar, stride_am, stride_br, stride_bn, stride_de, stride_dm, stride_dn,
    GATHER_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dw[e] = a[rows of e]ᵀ @ b[src rows]; src = token of the row's pair (GATHER_B) or the row itself."""
    expert, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(expert_start_ptr + expert)
    end = tl.load(expert_start_ptr + expert + 1)
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cm_ok, cn_ok = cm < M, cn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):  # BLOCK_R divides the layout's block, so rows never leave [start, end)
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        a_t = tl.load(a_ptr + rows[None, :] * stride_ar + cm[:, None] * stride_am, mask=cm_ok[:, None], other=0.0)
        if GATHER_B:
            pair = tl.load(sorted_pair_ptr + rows)
            real = pair >= 0
            src = tl.where(real, pair // top_k, 0).to(tl.int64)
        else:
            real = rows >= 0
            src = rows
        b = tl.load(b_ptr + src[:, None] * stride_br + cn[None, :] * stride_bn,
                    mask=real[:, None] & cn_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
    tl.store(dw_ptr + expert.to(tl.int64) * stride_de + cm[:, None] * stride_dm + cn[None, :] * stride_dn,
             acc.to(dw_ptr.dtype.element_ty), mask=cm_ok[:, None] & cn_ok[None, :])  # fmt: skip


@triton.jit
def _combine_kernel(
    o_ptr, w_ptr, pair_row_ptr, y_ptr,
    H, top_k,
    stride_om, stride_oh, stride_wn, stride_wk, stride_yn, stride_yh,
    HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """y[n] = Σ_k w[n, k] · o[pair_row[n·top_k + k]] (w = 1 when not HAS_W), fp32 accumulation."""
    token, pid_h = tl.program_id(0), tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(top_k):
        row = tl.load(pair_row_ptr + token * top_k + k).to(tl.int64)
        v = tl.load(o_ptr + row * stride_om + cols * stride_oh, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_W:
            v *= tl.load(w_ptr + token * stride_wn + k * stride_wk).to(tl.float32)
        acc += v
    tl.store(y_ptr + token * stride_yn + cols * stride_yh, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _combine_bwd_kernel(
    dy_ptr, o_ptr, w_ptr, pair_row_ptr, do_ptr, dw_ptr,
    H, top_k,
    stride_dyn, stride_dyh, stride_om, stride_oh, stride_wn, stride_wk, stride_dom, stride_doh,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Per pair p = (n, k): d_o[row] = w[n, k] · dy[n] and dw[p] = <o[row], dy[n]>."""
    pair = tl.program_id(0)
    token, k = pair // top_k, pair % top_k
    row = tl.load(pair_row_ptr + pair).to(tl.int64)
    w = tl.load(w_ptr + token * stride_wn + k * stride_wk).to(tl.float32)
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        dy = tl.load(dy_ptr + token * stride_dyn + cols * stride_dyh, mask=col_ok, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + row * stride_om + cols * stride_oh, mask=col_ok, other=0.0).to(tl.float32)
        dot += dy * o
        tl.store(do_ptr + row * stride_dom + cols * stride_doh, (w * dy).to(do_ptr.dtype.element_ty), mask=col_ok)
    tl.store(dw_ptr + pair, tl.sum(dot, axis=0))


# --- launchers (Triton) and their torch twins (same signatures) --------------------------------------------------


def gate_up_swiglu(
    x: torch.Tensor, gate_up: torch.Tensor, plan: Plan, save_h: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(h [P, 2I] pre-activations or None, act [P, I] = silu(gate) * up) for every padded row."""
    b, (_, two_i, hidden) = _blocks(x), gate_up.shape
    inter, rows = two_i // 2, plan.sorted_pair.numel()
    act = x.new_empty(rows, inter)
    h = x.new_empty(rows, two_i) if save_h else act  # act doubles as an unused pointer when h is not saved
    grid = (rows // plan.block_m, triton.cdiv(inter, b.gate_up_n))
    _gate_up_swiglu_kernel[grid](
        x, gate_up, h, act, plan.sorted_pair, plan.block_expert, hidden, inter, plan.top_k,
        *x.stride(), *gate_up.stride(), *h.stride(), *act.stride(),
        SAVE_H=save_h, BLOCK_M=plan.block_m, BLOCK_N=b.gate_up_n, BLOCK_K=b.k, PRECISION=_precision(x),
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return (h if save_h else None), act


def _grouped_mm_launch(a, w, plan, out_cols, h=None):
    b, rows = _blocks(a), a.shape[0]
    k_dim, n_dim = w.shape[1], w.shape[2]
    c = a.new_empty(rows, out_cols)
    grid = (rows // plan.block_m, triton.cdiv(n_dim, b.n))
    _grouped_mm_kernel[grid](
        a, w, c, c if h is None else h, plan.block_expert, k_dim, n_dim,
        *a.stride(), *w.stride(), *c.stride(), *(c if h is None else h).stride(),
        SWIGLU_BWD=h is not None, BLOCK_M=plan.block_m, BLOCK_N=b.n, BLOCK_K=b.k, PRECISION=_precision(a),
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return c


def grouped_mm(a: torch.Tensor, w: torch.Tensor, plan: Plan) -> torch.Tensor:
    """c [P, N] = a[rows] @ w[e] per block of rows, w [E, K, N] with any strides (pass ``down.mT`` etc., no copy)."""
    return _grouped_mm_launch(a, w, plan, w.shape[2])


def grouped_mm_swiglu_bwd(d_o: torch.Tensor, down: torch.Tensor, h: torch.Tensor, plan: Plan) -> torch.Tensor:
    """dh [P, 2I] = SwiGLU'(h) applied to d_act = d_o @ down[e] (down [E, H, I])."""
    return _grouped_mm_launch(d_o, down, plan, 2 * down.shape[2], h=h)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, plan: Plan, num_experts: int, gather: bool) -> torch.Tensor:
    """dw [E, M, N] = a[rows of e]ᵀ @ b[src]; src = token of each row (gather, b = x [N, H]) or the row (b [P, N])."""
    blk, (m_dim, n_dim) = _blocks(a), (a.shape[1], b.shape[1])
    assert plan.block_m % blk.k == 0, "the row step must divide the layout's block"
    dw = a.new_empty(num_experts, m_dim, n_dim)
    grid = (num_experts, triton.cdiv(m_dim, blk.wgrad_m), triton.cdiv(n_dim, blk.wgrad_n))
    _grouped_wgrad_kernel[grid](
        a, b, dw, plan.sorted_pair, plan.expert_start, m_dim, n_dim, plan.top_k,
        *a.stride(), *b.stride(), *dw.stride(),
        GATHER_B=gather, BLOCK_M=blk.wgrad_m, BLOCK_N=blk.wgrad_n, BLOCK_R=blk.k, PRECISION=_precision(a),
        num_warps=blk.num_warps, num_stages=blk.num_stages,
    )  # fmt: skip
    return dw


def combine(o: torch.Tensor, weights: torch.Tensor | None, plan: Plan) -> torch.Tensor:
    """y [N, H] = Σ_k weights[n, k] · o[pair_row[n, k]] (weights None: plain sum)."""
    b, hidden = _blocks(o), o.shape[1]
    y = o.new_empty(plan.num_tokens, hidden)
    w = o if weights is None else weights
    _combine_kernel[(plan.num_tokens, triton.cdiv(hidden, b.h))](
        o, w, plan.pair_row, y, hidden, plan.top_k, *o.stride(), *w.stride()[:2], *y.stride(),
        HAS_W=weights is not None, BLOCK_H=b.h, num_warps=4 if o.is_cuda else 1,
    )  # fmt: skip
    return y


def combine_bwd(
    dy: torch.Tensor, o: torch.Tensor, weights: torch.Tensor, plan: Plan
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_o [P, H], zero on padding rows; dw [N, k] fp32) for y = combine(o, weights)."""
    b, hidden = _blocks(o), o.shape[1]
    d_o = torch.zeros_like(o)  # padding rows must be 0: the backward GEMMs read whole blocks
    dw = torch.empty(plan.pair_row.numel(), dtype=torch.float32, device=o.device)
    _combine_bwd_kernel[(plan.pair_row.numel(),)](
        dy, o, weights, plan.pair_row, d_o, dw, hidden, plan.top_k,
        *dy.stride(), *o.stride(), *weights.stride(), *d_o.stride(),
        BLOCK_H=b.h, num_warps=4 if o.is_cuda else 1,
    )  # fmt: skip
    return d_o, dw.view(plan.num_tokens, plan.top_k)


def _expert_rows(plan: Plan) -> list[tuple[int, int]]:
    bounds = plan.expert_start.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _pair_tokens(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    real = plan.sorted_pair >= 0
    return torch.where(real, plan.sorted_pair // plan.top_k, 0).long(), real


def gate_up_swiglu_torch(x, gate_up, plan, save_h):
    token, real = _pair_tokens(plan)
    xs = x[token] * real[:, None]
    h = x.new_zeros(plan.sorted_pair.numel(), gate_up.shape[1])
    for e, (s, t) in enumerate(_expert_rows(plan)):
        h[s:t] = xs[s:t] @ gate_up[e].T
    gate, up = h.chunk(2, dim=-1)
    return (h if save_h else None), F.silu(gate) * up


def grouped_mm_torch(a, w, plan):
    c = a.new_zeros(a.shape[0], w.shape[2])
    for e, (s, t) in enumerate(_expert_rows(plan)):
        c[s:t] = a[s:t] @ w[e]
    return c


def grouped_mm_swiglu_bwd_torch(d_o, down, h, plan):
    d_act = grouped_mm_torch(d_o, down, plan)
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * F.silu(gate)], dim=-1)


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
    gate_up_swiglu: Callable
    grouped_mm: Callable
    grouped_mm_swiglu_bwd: Callable
    grouped_wgrad: Callable
    combine: Callable
    combine_bwd: Callable


TRITON_STAGES = Stages(gate_up_swiglu, grouped_mm, grouped_mm_swiglu_bwd, grouped_wgrad, combine, combine_bwd)
TORCH_STAGES = Stages(
    gate_up_swiglu_torch, grouped_mm_torch, grouped_mm_swiglu_bwd_torch, grouped_wgrad_torch, combine_torch,
    combine_bwd_torch,
)  # fmt: skip


# --- autograd ----------------------------------------------------------------------------------------------------


class _BlockedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, gate_up, down, plan: Plan, stages: Stages, save: bool):
        h, act = stages.gate_up_swiglu(x, gate_up, plan, save)
        o = stages.grouped_mm(act, down.mT, plan)
        y = stages.combine(o, topk_weights, plan)
        if save:
            ctx.save_for_backward(x, topk_weights, gate_up, down, h, act, o)
        ctx.plan, ctx.stages = plan, stages
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_weights, gate_up, down, h, act, o = ctx.saved_tensors
        plan, st, (need_x, need_w, need_gu, need_down) = ctx.plan, ctx.stages, ctx.needs_input_grad[:4]
        d_o, dw = st.combine_bwd(dy.contiguous(), o, topk_weights, plan)
        dx = d_gate_up = d_down = None
        if need_x or need_gu:
            dh = st.grouped_mm_swiglu_bwd(d_o, down, h, plan)
            if need_x:
                dx = st.combine(st.grouped_mm(dh, gate_up, plan), None, plan)
            if need_gu:
                d_gate_up = st.grouped_wgrad(dh, x, plan, gate_up.shape[0], True)
        if need_down:
            d_down = st.grouped_wgrad(d_o, act, plan, down.shape[0], False)
        return dx, (dw.to(topk_weights.dtype) if need_w else None), d_gate_up, d_down, None, None, None


def experts_blocked(x, topk_weights, topk_ids, gate_up, down, stages: Stages = TRITON_STAGES, block_m: int = 0):
    """The block-padded algorithm with the given stages (TRITON_STAGES, or TORCH_STAGES to test the algebra)."""
    plan = plan_blocks(topk_ids, gate_up.shape[0], block_m or _blocks(x).m)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, gate_up, down))
    return _BlockedExperts.apply(x, topk_weights, gate_up, down, plan, stages, save)


def experts_triton(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Triton kernels for the experts (routing already done); see the module docstring."""
    if not (x.is_cuda or INTERPRETED):
        raise RuntimeError(
            "moe impl='triton' needs a CUDA tensor, or TRITON_INTERPRET=1 set before cascade_rl.kernels.moe is "
            "imported (the interpreter: slow, for tests); use impl='torch' on CPU"
        )
    if not x.dtype == gate_up.dtype == down.dtype:
        raise TypeError(
            f"moe impl='triton' needs one dtype, got x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
        )
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    return experts_blocked(x, topk_weights.contiguous(), topk_ids, gate_up, down, TRITON_STAGES)


# --- public API --------------------------------------------------------------------------------------------------

EXPERTS: dict[str, Callable[..., torch.Tensor]] = {"torch": experts_torch, "triton": experts_triton}


def moe_experts(x, topk_weights, topk_ids, gate_up, down, impl: Impl = "torch") -> torch.Tensor:
    """y [N, H] = Σ_k topk_weights[n, k] · expert_{topk_ids[n, k]}(x[n]): HF Qwen3MoeExperts.forward."""
    if impl not in EXPERTS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {sorted(EXPERTS)}")
    return EXPERTS[impl](x, topk_weights, topk_ids, gate_up, down)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    impl: Impl = "torch",
    return_router_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3MoeSparseMoeBlock on x [..., H]: route, run the experts, combine; router logits are [N, E] as in HF.

    Differentiable in all four tensors (the router through the renormalised top-k weights)."""
    flat = x.reshape(-1, x.shape[-1])
    logits, weights, ids = route(flat, router_weight, top_k)
    y = moe_experts(flat, weights, ids, gate_up, down, impl).view(x.shape)
    return (y, logits) if return_router_logits else y

"""The Triton side of kernels/moe.py's ``impl="triton"``: the block-padded layout the kernels read (``plan_blocks``),
the kernels and their launchers. The algorithm, the torch twins of every launcher and the autograd Function are in
kernels/moe_blocked.py (its docstring describes the stages); tests import everything from there."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe import GATED, expert_counts

# Kernels are JIT functions or interpreter functions depending on TRITON_INTERPRET when this module is imported.
INTERPRETED = bool(triton.knobs.runtime.interpret)


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
    """moe_align_block_size in torch ops (sort, binary search, cumsum, scatter): O(S log S), no host sync (the
    tests run it on the meta device, where anything data-dependent would raise)."""
    ids = topk_ids.reshape(-1).long()
    pairs, dev = ids.numel(), ids.device
    sorted_ids, order = torch.sort(ids, stable=True)
    counts = expert_counts(sorted_ids, num_experts)
    padded_end = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    expert_start = F.pad(padded_end, (1, 0))
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
    gate_up_n: int  # N tile of gate_up_act (two accumulators of this width for SwiGLU)
    k: int  # K tile of the row GEMMs, and row step of grouped_wgrad (must divide m)
    wgrad_m: int  # output tiles of grouped_wgrad
    wgrad_n: int
    h: int  # columns per program of combine / combine_bwd
    num_warps: int  # of the GEMM kernels
    num_stages: int  # software pipelining depth of the GEMM kernels' K loops (shared memory: stages × tiles)
    combine_warps: int  # of combine / combine_bwd


# Interpreter: smallest tiles tl.dot takes, so that tiny test shapes cross tile edges. CUDA (sm_90, by operand
# bits): vLLM-like tiles for bf16/fp16 (at most 96 KB of shared memory, <= 165 registers, no spills); fp32 (its
# ``ieee`` dots run on CUDA cores, twice the bytes per element) halves the K step and the wgrad tile's N: at most
# 48 KB, <= 155 registers, no spills (with bf16's tiles fp32 wgrad took 128 KB and 207 registers). Figures from
# tests/test_triton_aot.py (triton 3.6, 3.7.1 and 3.9 agree to a few registers); never timed: tune on a GPU.
INTERPRETER_BLOCKS = Blocks(m=16, n=16, gate_up_n=16, k=16, wgrad_m=16, wgrad_n=16, h=16, num_warps=1, num_stages=1,
                            combine_warps=1)
CUDA_BLOCKS = {
    16: Blocks(m=64, n=128, gate_up_n=64, k=64, wgrad_m=128, wgrad_n=128, h=512, num_warps=8, num_stages=3,
               combine_warps=4),
    32: Blocks(m=64, n=128, gate_up_n=64, k=32, wgrad_m=128, wgrad_n=64, h=512, num_warps=8, num_stages=3,
               combine_warps=4),
}


def launch_blocks(dtype: torch.dtype, interpreted: bool = INTERPRETED) -> Blocks:
    """The tiles every launcher uses for operands of ``dtype``: a pure function, so that the ahead-of-time
    compile test (tests/test_triton_aot.py) builds exactly what a GPU runs."""
    if interpreted:
        return INTERPRETER_BLOCKS
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"moe impl='triton' takes fp32, bf16 or fp16 tensors, not {dtype}")
    return CUDA_BLOCKS[dtype.itemsize * 8]


# The activations fused into the kernels' epilogues (``ACT`` / ``ACT_BWD``, kernels/moe.py ``ACTIVATIONS`` names).
FUSED_ACTIVATIONS = ("swiglu", "relu2")


def fused_activation(activation: str) -> bool:
    """Whether ``activation`` is gated (kernels/moe.py ``GATED``: its first projection holds gate then up rows);
    refuses one the kernels do not fuse (never a silent fallback)."""
    if activation not in FUSED_ACTIVATIONS:
        raise NotImplementedError(
            f"moe impl='triton' fuses {list(FUSED_ACTIVATIONS)} into its kernels, not {activation!r}"
        )
    return GATED[activation]


def _blocks(t: torch.Tensor) -> Blocks:
    return launch_blocks(t.dtype)


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands


@triton.jit
def _gate_up_act_kernel(
    x_ptr, w_ptr, h_ptr, act_ptr, sorted_pair_ptr, block_expert_ptr,
    H, INTER, top_k,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn, stride_am, stride_an,
    ACT: tl.constexpr, SAVE_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """act = ACT(x[token of row] @ w[e]ᵀ): "swiglu" (w rows: INTER gate then INTER up; two accumulators side by
    side) or "relu2" (w rows: INTER up; relu(h)²). SAVE_H: the pre-activations too (h [P, 2I] or [P, I])."""
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
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # relu2: the up projection's
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # swiglu only
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        xb = tl.load(x_ptr + token[:, None] * stride_xm + ks[None, :] * stride_xk,
                     mask=real[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_gate = tl.dot(xb, w_gate, acc_gate, input_precision=PRECISION)
        if ACT == "swiglu":
            w_up = tl.load(w_base + (cols[None, :] + INTER) * stride_wn + ks[:, None] * stride_wk, mask=w_mask,
                           other=0.0)  # fmt: skip
            acc_up = tl.dot(xb, w_up, acc_up, input_precision=PRECISION)
    if ACT == "swiglu":
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:  # relu2
        pos = tl.maximum(acc_gate, 0.0)
        act = pos * pos
    mask = col_ok[None, :]
    tl.store(act_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an,
             act.to(act_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    if SAVE_H:
        h_rows = h_ptr + rows[:, None] * stride_hm
        tl.store(h_rows + cols[None, :] * stride_hn, acc_gate.to(h_ptr.dtype.element_ty), mask=mask)
        if ACT == "swiglu":
            tl.store(h_rows + (cols[None, :] + INTER) * stride_hn, acc_up.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, w_ptr, c_ptr, h_ptr, block_expert_ptr,
    K, N,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn, stride_hm, stride_hn,
    ACT_BWD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """c[rows] = a[rows] @ w[e] ([K, N] through strides). ACT_BWD ("swiglu" | "relu2", "" for none): the product is
    d_act, and the epilogue writes dh, the activation's derivative at h applied ([dg, du] for swiglu)."""
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
    if ACT_BWD == "swiglu":  # N = I; h = [gate | up] pre-activations; act = silu(g) * u
        h_rows = h_ptr + rows[:, None] * stride_hm
        g = tl.load(h_rows + cols[None, :] * stride_hn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_rows + (cols[None, :] + N) * stride_hn, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        d_gate = acc * u * sig * (1.0 + g * (1.0 - sig))
        d_up = acc * g * sig
        c_rows = c_ptr + rows[:, None] * stride_cm
        tl.store(c_rows + cols[None, :] * stride_cn, d_gate.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_rows + (cols[None, :] + N) * stride_cn, d_up.to(c_ptr.dtype.element_ty), mask=mask)
    elif ACT_BWD == "relu2":  # N = I; act = relu(h)², d_h = 2 relu(h) d_act
        h = tl.load(h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn, mask=mask, other=0.0)
        d_h = acc * 2.0 * tl.maximum(h.to(tl.float32), 0.0)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, d_h.to(c_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
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
    token, pid_h = tl.program_id(0).to(tl.int64), tl.program_id(1)  # int64: N·H may pass 2³¹
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
    pair = tl.program_id(0).to(tl.int64)  # int64 offsets, as in _combine_kernel
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


# --- launchers (their torch twins, same signatures, are in kernels/moe.py) --------------------------------------------------


def gate_up_act(
    x: torch.Tensor, gate_up: torch.Tensor, plan: Plan, save_h: bool, activation: str = "swiglu"
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(h pre-activations or None, act [P, I]) for every padded row: act = silu(gate) * up, h [P, 2I] (swiglu,
    gate_up [E, 2I, H]) or relu(h)², h [P, I] (relu2, gate_up [E, I, H])."""
    b, (_, rows_w, hidden) = _blocks(x), gate_up.shape
    inter, rows = rows_w // (2 if fused_activation(activation) else 1), plan.sorted_pair.numel()
    act = x.new_empty(rows, inter)
    h = x.new_empty(rows, rows_w) if save_h else act  # act doubles as an unused pointer when h is not saved
    grid = (rows // plan.block_m, triton.cdiv(inter, b.gate_up_n))
    _gate_up_act_kernel[grid](
        x, gate_up, h, act, plan.sorted_pair, plan.block_expert, hidden, inter, plan.top_k,
        *x.stride(), *gate_up.stride(), *h.stride(), *act.stride(),
        ACT=activation, SAVE_H=save_h, BLOCK_M=plan.block_m, BLOCK_N=b.gate_up_n, BLOCK_K=b.k,
        PRECISION=_precision(x), num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return (h if save_h else None), act


def _grouped_mm_launch(a, w, plan, out_cols, h=None, activation=""):
    b, rows = _blocks(a), a.shape[0]
    k_dim, n_dim = w.shape[1], w.shape[2]
    c = a.new_empty(rows, out_cols)
    grid = (rows // plan.block_m, triton.cdiv(n_dim, b.n))
    _grouped_mm_kernel[grid](
        a, w, c, c if h is None else h, plan.block_expert, k_dim, n_dim,
        *a.stride(), *w.stride(), *c.stride(), *(c if h is None else h).stride(),
        ACT_BWD=activation, BLOCK_M=plan.block_m, BLOCK_N=b.n, BLOCK_K=b.k, PRECISION=_precision(a),
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return c


def grouped_mm(a: torch.Tensor, w: torch.Tensor, plan: Plan) -> torch.Tensor:
    """c [P, N] = a[rows] @ w[e] per block of rows, w [E, K, N] with any strides (pass ``down.mT`` etc., no copy)."""
    return _grouped_mm_launch(a, w, plan, w.shape[2])


def grouped_mm_act_bwd(
    d_o: torch.Tensor, down: torch.Tensor, h: torch.Tensor, plan: Plan, activation: str = "swiglu"
) -> torch.Tensor:
    """dh = act'(h) applied to d_act = d_o @ down[e] (down [E, H, I]): [P, 2I] for swiglu, [P, I] for relu2."""
    out_cols = down.shape[2] * (2 if fused_activation(activation) else 1)
    return _grouped_mm_launch(d_o, down, plan, out_cols, h=h, activation=activation)


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
        HAS_W=weights is not None, BLOCK_H=b.h, num_warps=b.combine_warps,
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
        BLOCK_H=b.h, num_warps=b.combine_warps,
    )  # fmt: skip
    return d_o, dw.view(plan.num_tokens, plan.top_k)

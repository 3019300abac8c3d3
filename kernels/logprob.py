"""Fused LM head → per-token log-prob (+ entropy) in Triton, forward and backward, never [N, V] in memory.

Same signature and numbers as ``modeling.logprobs.linear_logprobs`` (the chunked torch path, which is
this kernel's torch reference; ``linear_logprobs_reference`` is the naive one):

    logprob, entropy = linear_logprobs(hidden [N, H], weight [V, H], targets [N], temperature, chunk_tokens,
                                       with_entropy)        # fp32 [N] each; entropy None unless asked

``chunk_tokens`` is accepted and ignored: the kernels tile by their own block sizes.

Algorithm, with z = h · Wᵀ / T:

- Forward (``_forward_kernel``), grid (token blocks, vocab splits). A program takes BLOCK_N tokens and
  one contiguous range of vocab tiles; per tile it builds the [BLOCK_N, BLOCK_V] logits with ``tl.dot``
  over BLOCK_H slices of H (fp32 accumulation) and folds them into online statistics: running max m,
  s = Σ e^(z−m), a = Σ e^(z−m)·(z−m) (rescaled when m grows: a ← e^(m−m')·(a + (m−m')·s)) and the
  target's logit. Each split writes its (m, s, a, picked) [N]; a few torch ops over [splits, N] merge
  them: lse = M + log S, logprob = picked − lse, H = log S − A/S (= lse − Σ p·z, but without the
  cancellation of two large terms when logits are large). Splits exist only so that a few thousand
  tokens still fill the GPU; there are ~2 programs per SM.
- Backward recomputes each logits tile and forms ∂L/∂z = g_lp·(onehot(y) − p) + g_ent·(−p·(log p + H)),
  with 1/T folded into g_lp, g_ent [N]. The kernel computes only the dense part −p·(c + g_ent·z), with
  c = g_lp + g_ent·(H − lse) per token: three per-token values instead of five. The onehot part is N rows
  and is added in torch: ∂L/∂h_i += g_lp_i·W[y_i] (a gather) and ∂L/∂W[y_i] += g_lp_i·h_i
  (``index_put_(accumulate=True)``, sort-based on CUDA, so deterministic).
  * ``_grad_logits_kernel``, grid (token blocks, vocab tiles of one chunk): writes ∂z for a chunk of the
    vocabulary, [N, C] in the operands' dtype (C columns within DZ_CHUNK_BYTES, 256 MiB: ~10 chunks at 8,192
    tokens × 151,936 in bf16). Each chunk's two products run on cuBLAS: ∂L/∂h += ∂z · W[chunk] (added into an
    fp32 [N, H]) and ∂L/∂W[chunk] = ∂zᵀ · h. No atomics anywhere: deterministic.
  Three matmuls of N·V·H in the backward (one recomputation, two products). The first version kept ∂z in
  registers and accumulated ∂L/∂h and ∂L/∂W in fp32 global buffers read and written once per vocabulary tile
  or token block (two recomputations, ~480 GB of traffic at the size above): 249 ms on an H200, 17× its
  forward, which is what the chunks replace.

Memory: no [N, V] logits. Saved for backward: h, W, y, lse [N] and entropy [N] (fp32). Scratch: forward
4 × splits × N fp32; backward the ∂z chunk (≤ 256 MiB, or one 128-column tile per row where N alone is
larger), the fp32 accumulators ∂L/∂h [N, H] and ∂L/∂W [V, H] (then cast to W's dtype: 1.5 × V·H·4 bytes at
the end), one [N, H] product per chunk, plus N × H for the onehot part.

Dtypes: bf16/fp16 inputs (both the same) are loaded as such and multiplied on tensor cores with fp32
accumulation; ∂L/∂z is rounded to that dtype before its two matmuls (as in Liger and CCE), so bf16
gradients differ from the torch path (fp32 throughout) at bf16 precision. Anything else is computed in
fp32 with ``input_precision="ieee"`` (no TF32: matches the reference to ~1e-6, but far slower on GPU than
bf16; feed bf16 for speed). float64 is refused (use the torch path for gradcheck). Gradients come back
in the inputs' dtypes; log-probs and entropies are fp32. Targets must lie in [0, V) (not checked: a
check costs a device sync; an out-of-range target gives logprob = −lse).

Runs on CUDA (sm_80+ for bf16), or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``
set before this module is imported; slow, small shapes only, 16-wide tiles so that the tests cover
ragged edges and vocab splits). Checks and benchmark:

    .venv/bin/pytest tests/test_logprob_kernel.py          # interpreter on CPU, or CUDA when present
    .venv/bin/python bench/logprob_kernel.py [--quick]      # CUDA: time + peak memory vs torch paths

On an H200 (2026-12-04, the first version of the backward): the tests passed as far as they ran, and
BENCHMARKS.md has the figures. The chunked backward has not met a GPU yet: checked by the interpreter tests
(fp32, and bf16 with the dots upcast) and an ahead-of-time compile for sm_90 (tests/test_triton_aot.py, at the
launchers' own tiles, ``_tiles``). The tiles are untuned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from cascade_rl.kernels.logprob_args import check_args

# ---------------------------------------------------------------------------------------------------------
# Kernels

# Decided once, as triton does: ``@triton.jit`` reads TRITON_INTERPRET when it decorates, i.e. at import.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
_INTERPRETED = tl.constexpr(INTERPRETED)  # kernels may only read globals that are constexpr


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32. Under the interpreter bf16/fp16 operands go up to fp32 first: its tl.dot multiplies
    bf16 as the raw uint16 it stores them in (triton 3.9). bf16 × bf16 products are exact in fp32, so the
    numbers are those of the tensor-core path up to summation order."""
    if _INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _logits_tile(a_ptr, b_ptr, a_idx, b_idx, a_ok, b_ok, H, inv_t,
                 BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """a[a_idx] · b[b_idx]ᵀ / T, fp32 [BLOCK_A, BLOCK_B], out-of-range rows read as zeros. (h, W) gives the
    logits z, (W, h) gives zᵀ: the ∂L/∂W pass wants ∂L/∂zᵀ as a dot operand, and building it transposed is
    cheaper than tl.trans of a register tile (which spilled, compiled for sm_90)."""
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    a_rows = a_ptr + a_idx.to(tl.int64)[:, None] * H  # int64: V·H passes 2^31 for large heads
    b_rows = b_ptr + b_idx.to(tl.int64)[:, None] * H
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(a_rows + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + ks[None, :], mask=b_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.trans(b), acc, PRECISION)
    return acc * inv_t


@triton.jit
def _grad_logits_tile(z, valid, lse, c, g_ent, HAS_GENT: tl.constexpr):
    """The dense part of ∂L/∂z for one tile: −p·(c + g_ent·z), 0 where not ``valid``.

    ∂L/∂z = g_lp·(onehot − p) − g_ent·p·(log p + H) = g_lp·onehot − p·(c + g_ent·z) with the per-token
    c = g_lp + g_ent·(H − lse); the onehot part is added outside the kernels (a gather and a scatter of
    N rows). Fewer per-token values: in the transposed ∂L/∂W tile each one costs a broadcast column.
    """
    p = tl.exp(z - lse)
    if HAS_GENT:
        g = -p * (c + g_ent * z)
    else:
        g = -p * c
    return tl.where(valid, g, 0.0)


@triton.jit
def _forward_kernel(h_ptr, w_ptr, tgt_ptr, max_ptr, sum_ptr, ent_ptr, pick_ptr, N, V, H, inv_t, tiles_per_split,
                    WITH_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    # A finite start for the max: (m − m')·s must be 0·finite on the first tile, not −inf·0.
    m = tl.full((BLOCK_N,), -1e30, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    a = tl.zeros((BLOCK_N,), tl.float32)  # Σ e^(z−m)·(z−m)
    picked = tl.zeros((BLOCK_N,), tl.float32)
    v_lo = pid_s * tiles_per_split * BLOCK_V
    v_hi = tl.minimum(v_lo + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_t, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shifted = z - m_new[:, None]  # −inf on padding columns
        e = tl.exp(shifted)  # 0 there
        rescale = tl.exp(m - m_new)
        if WITH_ENTROPY:
            a = rescale * (a + (m - m_new) * s) + tl.sum(e * tl.where(col_ok[None, :], shifted, 0.0), axis=1)
        s = s * rescale + tl.sum(e, axis=1)
        m = m_new
        picked += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    out = pid_s * N + rows
    tl.store(max_ptr + out, m, mask=row_ok)
    tl.store(sum_ptr + out, s, mask=row_ok)
    tl.store(pick_ptr + out, picked, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(ent_ptr + out, a, mask=row_ok)


@triton.jit
def _load_token_stats(rows, row_ok, lse_ptr, c_ptr, gent_ptr, HAS_GENT: tl.constexpr):
    """Per-token inputs of the gradient tile; c = 0 (so a zero gradient) for rows past N."""
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.zeros_like(lse)
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
    return lse, c, g_ent


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, lse_ptr, c_ptr, gent_ptr, dz_ptr, N, V, H, inv_t, v_start, CHUNK,
                        HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """One [BLOCK_N, BLOCK_V] tile of the dense part of ∂L/∂z over the vocabulary chunk that starts at ``v_start``,
    into ∂z [N, CHUNK] in the operands' dtype (its column j is vocabulary entry v_start + j)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_start + local
    col_ok = (local < CHUNK) & (cols < V)
    lse, c, g_ent = _load_token_stats(rows, row_ok, lse_ptr, c_ptr, gent_ptr, HAS_GENT)
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_t, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION)
    ok = row_ok[:, None] & col_ok[None, :]
    g = _grad_logits_tile(z, ok, lse[:, None], c[:, None], g_ent[:, None], HAS_GENT)
    out = dz_ptr + rows.to(tl.int64)[:, None] * CHUNK + local[None, :]
    tl.store(out, g.to(dz_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------------
# Launch configuration

# fp32 × fp32 in full precision (TF32 would miss the torch path by ~1e-3); ignored for bf16/fp16 operands.
_DOT_PRECISION = "ieee"


@dataclass(frozen=True)
class _Tiles:
    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_V=self.block_v, BLOCK_H=self.block_h, PRECISION=_DOT_PRECISION,
                    num_warps=self.num_warps, num_stages=self.num_stages)


# Per pass, for sm_90. The forward's were chosen so that it compiles (ahead of time, tests/test_triton_aot.py)
# with a pipelined K loop and without register spills per cuobjdump (triton 3.6.0, 3.7.1 and 3.9.0); on an H200 it
# ran 8,192 tokens × 151,936 × 2,048 in 14.1 ms (bf16). The ∂z tile holds what the forward's does, less the online
# statistics: the same tiles. fp32 runs its ``ieee`` dots on CUDA cores: smaller tiles.
_GPU_TILES = {
    (16, "forward"): _Tiles(128, 128, 64, num_warps=8, num_stages=3),
    (16, "grad_logits"): _Tiles(128, 128, 64, num_warps=8, num_stages=3),
    (32, "forward"): _Tiles(64, 64, 32, num_warps=8, num_stages=3),
    (32, "grad_logits"): _Tiles(64, 64, 32, num_warps=8, num_stages=3),
}
# 16 is the smallest tl.dot tile, and small enough that the tests' shapes have ragged multi-tile edges.
_INTERPRETER_TILES = _Tiles(16, 16, 16, num_warps=1, num_stages=1)


def _tiles(dtype: torch.dtype, which: str) -> _Tiles:
    return _INTERPRETER_TILES if INTERPRETED else _GPU_TILES[dtype.itemsize * 8, which]


def _target_programs(device: torch.device) -> int:
    """How many programs the vocabulary splits aim for (forward, ∂L/∂h): two per SM; 4 under the interpreter,
    so that the tests' few token blocks still get split."""
    return 4 if INTERPRETED else 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _vocab_splits(n_token_blocks: int, n_vocab_tiles: int, programs: int) -> tuple[int, int]:
    """(splits, vocab tiles per split): enough splits for ~``programs`` programs, none of them empty."""
    want = max(1, min(n_vocab_tiles, math.ceil(programs / max(1, n_token_blocks))))
    per_split = math.ceil(n_vocab_tiles / want)
    return math.ceil(n_vocab_tiles / per_split), per_split


# The ∂z chunk's budget: 256 MiB, so ~10 chunks at 8,192 tokens × a 151,936 vocabulary in bf16, each product
# [8,192 × 16,384] · [16,384 × H] big enough for cuBLAS to run near peak.
DZ_CHUNK_BYTES = 256 * 2**20


def _chunk_columns(n: int, vocab: int, itemsize: int, block_v: int) -> int:
    """Vocabulary columns per ∂z chunk: a multiple of the tile, within DZ_CHUNK_BYTES (at least one tile), at most
    the vocabulary; two tiles under the interpreter, so that the tests cross chunk edges."""
    if INTERPRETED:
        return 2 * block_v
    fits = DZ_CHUNK_BYTES // max(1, n * itemsize) // block_v * block_v
    return max(block_v, min(fits, triton.cdiv(vocab, block_v) * block_v))


def _kernel_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    if torch.float64 in (hidden.dtype, weight.dtype):
        raise TypeError("float64 is not supported by the Triton kernel; use modeling.logprobs.linear_logprobs")
    if hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return hidden.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------------------
# Autograd


class _LinearLogprobsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        dtype = _kernel_dtype(hidden, weight)
        h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()  # no copies in the usual case
        y = targets.contiguous()
        (n, size), vocab = h.shape, w.shape[0]
        tiles = _tiles(dtype, "forward")
        token_blocks = triton.cdiv(n, tiles.block_n)
        splits, per_split = _vocab_splits(token_blocks, triton.cdiv(vocab, tiles.block_v), _target_programs(h.device))
        part = torch.empty(4, splits, n, dtype=torch.float32, device=h.device)  # max, sum, entropy acc, picked
        if n:
            _forward_kernel[(token_blocks, splits)](h, w, y, *part, n, vocab, size, 1.0 / temperature, per_split,
                                                    WITH_ENTROPY=with_entropy, **tiles.launch())
        m, s, a, picked = part.unbind(0)
        m_all = m.amax(0)  # merge the splits' online statistics: [splits, N] → [N]
        rescale = torch.exp(m - m_all)
        s_all = (s * rescale).sum(0)
        lse = m_all + s_all.log()
        logprob = picked.sum(0) - lse  # only the split holding the target wrote a nonzero logit
        if with_entropy:
            entropy = s_all.log() - (rescale * (a + (m - m_all) * s)).sum(0) / s_all
        else:
            entropy = lse.new_empty(0)
        ctx.save_for_backward(h, w, y, lse, entropy)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.set_materialize_grads(False)  # unused outputs reach backward as None: their terms are skipped
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, w, y, lse, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (want_h or want_w):
            return None, None, None, None, None
        (n, size), vocab = h.shape, w.shape[0]
        inv_t = 1.0 / ctx.temperature
        # ∂/∂(h·Wᵀ) = (1/T)·∂/∂z: scale the [N] upstream grads, not the tiles. c = g_lp + g_ent·(H − lse).
        g_lp = g_lp.float() * inv_t if g_lp is not None else None
        g_ent = g_ent.float().mul(inv_t).contiguous() if g_ent is not None else None
        c = torch.zeros_like(lse) if g_lp is None else g_lp.clone()
        if g_ent is not None:
            c.addcmul_(g_ent, entropy - lse)
        stats = (lse, c, g_ent if g_ent is not None else lse)  # lse stands in for a missing g_ent: never read
        tiles = _tiles(h.dtype, "grad_logits")
        chunk = _chunk_columns(n, vocab, h.element_size(), tiles.block_v)
        dz = torch.empty(n, chunk, dtype=h.dtype, device=h.device)
        grad_h = torch.zeros(n, size, dtype=torch.float32, device=h.device) if want_h else None
        grad_w = torch.empty(vocab, size, dtype=torch.float32, device=w.device) if want_w else None
        for v0 in range(0, vocab, chunk):
            width = min(chunk, vocab - v0)
            if n:
                grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(width, tiles.block_v))
                _grad_logits_kernel[grid](h, w, *stats, dz, n, vocab, size, inv_t, v0, chunk,
                                          HAS_GENT=g_ent is not None, **tiles.launch())
            d = dz[:, :width]  # the products on cuBLAS (fp32 accumulation inside), one rounding each
            if want_h:
                grad_h += d @ w[v0:v0 + width]
            if want_w:
                grad_w[v0:v0 + width] = d.t() @ h
        if want_h:
            if g_lp is not None:  # the onehot part: ∂L/∂h_i += g_lp_i · W[y_i]
                grad_h.addcmul_(w[y], g_lp[:, None])
            grad_h = grad_h.to(ctx.dtypes[0])
        if want_w:
            if g_lp is not None:  # ∂L/∂W[y_i] += g_lp_i · h_i; index_put_ accumulates by sorting on CUDA: deterministic
                grad_w.index_put_((y,), h * g_lp[:, None], accumulate=True)
            grad_w = grad_w.to(ctx.dtypes[1])
        return grad_h, grad_w, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log_softmax(hidden · weightᵀ / T)[targets] per token, and the entropy if asked; Triton, no [N, V] logits.

    Drop-in for ``modeling.logprobs.linear_logprobs`` (its torch reference): hidden [N, H], weight [V, H],
    targets [N] int in [0, V); returns fp32 (logprob [N], entropy [N] or None), differentiable once wrt
    hidden and weight. ``chunk_tokens`` is ignored. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    check_args(hidden, weight, targets, chunk_tokens)
    if not INTERPRETED and not (hidden.is_cuda and weight.is_cuda and targets.is_cuda):
        raise RuntimeError("kernels.logprob needs CUDA tensors, or TRITON_INTERPRET=1 set before it is imported "
                           "(CPU, slow); modeling.logprobs.linear_logprobs is the CPU path")
    with torch.autocast(hidden.device.type, enabled=False):
        logprob, entropy = _LinearLogprobsTriton.apply(hidden, weight, targets.long(), float(temperature),
                                                       with_entropy)
    return logprob, entropy if with_entropy else None

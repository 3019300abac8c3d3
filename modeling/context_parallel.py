"""Context parallelism: one packed sequence split across ranks, each holding ``T / cp`` of its tokens in every layer.

    ranks = parallel.init(world_size, device, context_parallel=2)     # learner/parallel.py: the groups, ranks.context
    Policy(model, ..., context_parallel=ranks.context)                 # modeling/policy.py: packs split, log-probs gathered

Why Ulysses (all-to-all over heads) rather than ring attention. Each rank holds a contiguous ``T / cp`` of the
pack's tokens; everything but attention and the Mamba mixer is per token. Attention swaps the split for two
all-to-alls a layer: from ``[T / cp tokens, all heads]`` to ``[all T tokens, H / cp heads]``, attends over the whole
pack with whatever kernel the model uses (FlashAttention varlen on GPUs with the pack's ``cu_seqlens``, a causal
SDPA a row on the CPU), and back. So every rank does the same work whatever the causal mask (a ring's ranks do not: the
last one attends to everything), the kernel and its varlen row boundaries are the 1-rank ones unchanged, and the
traffic is ``4 · T · hidden / cp`` a layer (q, k, v, out). Its limit is the head count: ``cp`` must divide the
query heads; K/V heads fewer than ``cp`` (Nemotron-3-Nano has 2) are repeated to the query's before the exchange.

The Mamba-2 mixers of a hybrid model (modeling/mamba.py) split like the sequence: a recurrence cannot be split by
heads before its input projection, and its state is small. Each rank
- gets the last ``K - 1`` conv inputs of the rank before it (a halo: one all-gather of ``[K - 1, conv_dim]``),
- scans its own tokens from a zero state (modeling/mamba.py's chunked scan, rows kept apart by ``seq_idx``),
- gathers every rank's end state and total decay (``[heads, P, N]`` and ``[heads]``: one all-gather a layer),
  combines those of the ranks before it into the state carried in (the scan's inter-chunk step, across ranks:
  ``H_r = exp(Σ a over rank r-1) · H_{r-1} + S_{r-1}`` while one row goes on, ``S_{r-1}`` where a row started),
- adds that state's contribution to the tokens of its first row: ``y_l += exp(Σ_{start ≤ i ≤ l} a_i) C_l H_r``.
Exact, not approximate: a 2-rank step equals the 1-rank one (tests/test_context_parallel.py).

Gradients. Every rank ends with the whole pack's log-probs (``replicated_sum``) and computes the same loss, so the
backward of that gather is the identity (times ``cp``, below), the all-to-all's is the inverse all-to-all, and an
all-gather's sums every rank's gradient of the gathered pieces and keeps its own. A weight's gradient on one rank is
then its tokens' share, times ``cp``: FSDP2's average over all ``dp · cp`` ranks is the sum of the shares averaged
over the data-parallel ranks (learner/parallel.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

NAME = "ulysses"  # the attention implementation registered with transformers (``register``)

ATTR = "_cascade_rl_context_parallel"


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The ranks that share one sequence: ``rank`` of ``size`` in ``group``; ``inner``: the attention kernel each
    rank runs on the whole pack after the exchange (the model's own implementation before ``install``)."""

    group: object
    rank: int
    size: int
    inner: str = "sdpa"

    def split(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` tokens (a multiple of ``size``)."""
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def of(module) -> ContextParallel | None:
    """The context-parallel group ``install`` gave ``module`` (an attention or Mamba module), else None. An attribute,
    not a context entered around the forward: activation checkpointing recomputes layers in the backward, outside
    any such context."""
    return getattr(module, ATTR, None)


# --- collectives with their backward -------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """x [cp · n, ...] chunk j to rank j; out [cp · n, ...] chunk j from rank j. Backward: the inverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group) -> Tensor:
    x = x.contiguous()  # first: empty_like keeps a non-contiguous input's strides, and the collective needs neither
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllGather(torch.autograd.Function):
    """x [...] -> [cp, ...]: every rank's x. Backward: the gathered pieces' gradients summed over ranks (each rank
    used the pieces in its own way), this rank's piece kept."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, size: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        out = x.new_empty(size * x.numel())  # flat: gloo wants the output as the input's dim 0 times size
        dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _ReplicatedSum(torch.autograd.Function):
    """The sum of every rank's x, on every rank. Every rank computes the same loss from it, so the gradient that
    reaches each rank's x is the loss's own, times ``cp``: FSDP2 averages gradients over all its ranks, and a
    weight's gradient is the sum of the context-parallel ranks' shares (averaged over data-parallel ranks only).
    (Not FSDP2's ``set_gradient_divide_factor``: its PREMUL_SUM reduction does not exist in gloo.)"""

    @staticmethod
    def forward(ctx, x: Tensor, group, size: int) -> Tensor:
        ctx.size = size
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.size, None, None


def all_gather(x: Tensor, cp: ContextParallel) -> Tensor:
    return _AllGather.apply(x, cp.group, cp.rank, cp.size)


def replicated_sum(x: Tensor, cp: ContextParallel) -> Tensor:
    return _ReplicatedSum.apply(x, cp.group, cp.size)


# --- attention: Ulysses --------------------------------------------------------------------------------------


def _heads_to_sequence(x: Tensor, cp: ContextParallel) -> Tensor:
    """[T/cp, H, D] (all heads of my tokens) -> [T, H/cp, D] (my heads of all tokens)."""
    t, h, d = x.shape
    x = x.reshape(t, cp.size, h // cp.size, d).transpose(0, 1)  # [cp, T/cp, H/cp, D]: chunk j goes to rank j
    return _AllToAll.apply(x.contiguous(), cp.group).reshape(cp.size * t, h // cp.size, d)


def _sequence_to_heads(x: Tensor, cp: ContextParallel) -> Tensor:
    """[T, H/cp, D] -> [T/cp, H, D]: the inverse of ``_heads_to_sequence``."""
    t, h, d = x.shape
    x = _AllToAll.apply(x.reshape(cp.size, t // cp.size, h, d).contiguous(), cp.group)  # chunk j: rank j's heads
    return x.transpose(0, 1).reshape(t // cp.size, cp.size * h, d)


def _rows_sdpa(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """q/k/v [T, H, D], rows by ``cu`` (cu_seqlens), causal within each: the CPU's kernel, one causal SDPA a row (no
    [T, T] tensor: a mask over the pack, or 3-D inputs, which take the math kernel, make each rank's memory quadratic in
    T: 11x the 1-rank step at 16K tokens)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            # [1, H, T, D]: 4-D, which the CPU's flash kernel wants (3-D fell back to the math kernel's [T, T] scores)
            q_, k_, v_ = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def ulysses_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention contract under context parallelism: query [1, Hq, T/cp, D], key/value [1, Hkv,
    T/cp, D] of this rank's tokens -> ([1, T/cp, Hq, D], None), attending over the whole pack (``cu_seq_lens_q``:
    its rows, given by modeling/policy.py)."""
    cp = of(module)
    if cp is None or query.shape[0] != 1 or "cu_seq_lens_q" not in kwargs:
        raise ValueError("ulysses attention runs only inside a context-parallel forward of one pack "
                         "(modeling/policy.py with context_parallel)")
    hq, hkv = query.shape[1], key.shape[1]
    if hq % cp.size:
        raise ValueError(f"context parallel size {cp.size} must divide the {hq} attention heads")
    if hkv % cp.size:  # too few K/V heads to split: each query head gets its own copy (as transformers' repeat_kv)
        key, value = key.repeat_interleave(hq // hkv, dim=1), value.repeat_interleave(hq // hkv, dim=1)
    q, k, v = (_heads_to_sequence(x[0].transpose(0, 1), cp) for x in (query, key, value))  # [T, H/cp, D]
    cu = kwargs["cu_seq_lens_q"]
    if cp.inner == "varlen":
        from .attention import call_varlen

        n = int(kwargs["max_length_q"])
        out = call_varlen(q, k, v, cu, cu, n, n, scaling)
    else:
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        out = _rows_sdpa(q, k, v, cu, scaling)
    return _sequence_to_heads(out, cp)[None], None


def register() -> None:
    """``ulysses`` as a transformers attention implementation (and its mask function: none is built)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def install(model, cp: ContextParallel) -> ContextParallel:
    """Make ``model``'s attention Ulysses; the returned group's ``inner`` is the kernel it ran before."""
    heads = model.config.num_attention_heads
    if heads % cp.size:
        raise ValueError(f"trainer.context_parallel={cp.size} must divide the {heads} attention heads (Ulysses splits "
                         "them across the ranks)")
    inner = model.config._attn_implementation
    if inner == NAME:
        return of(model)
    if inner not in ("sdpa", "eager", "varlen"):
        raise ValueError(f"context parallelism runs over sdpa or varlen attention, not {inner!r} (model.attn_impl)")
    register()
    model.set_attn_implementation(NAME)
    cp = dataclasses.replace(cp, inner="varlen" if inner == "varlen" else "sdpa")
    for module in model.modules():  # each attention and Mamba module finds its group (``of``)
        setattr(module, ATTR, cp)
    return cp


# --- Mamba-2: the sequence split, states passed ---------------------------------------------------------------


def _gather_rows(x: Tensor, cp: ContextParallel) -> Tensor:
    """Every rank's ``x`` [...] -> [cp, ...], no gradient (row ids)."""
    out = x.new_empty(cp.size * x.numel())
    dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=cp.group)
    return out.view(cp.size, *x.shape)


# Each gather's backward is a collective: every rank must run it, in the same order. So a rank that does not read
# what it gathered (the first rank, nothing before it) still ties it to its output with a zero weight, and each
# layer's states go in one gather: its backward then falls in the same place of every rank's backward.


def conv_halo(x: Tensor, seq_idx: Tensor, k: int, cp: ContextParallel) -> tuple[Tensor, Tensor]:
    """x [1, T/cp, C] and seq_idx [1, T/cp] with the last ``k - 1`` of the rank before prepended (row -1 before
    the first rank: the conv reads none of it)."""
    if k <= 1:
        return x, seq_idx
    tails = all_gather(x[:, -(k - 1):], cp)  # [cp, 1, k-1, C]
    seg = _gather_rows(seq_idx[:, -(k - 1):], cp)
    if cp.rank == 0:
        halo, halo_seg = tails[-1] * 0, torch.full_like(seg[0], -1)
    else:
        halo, halo_seg = tails[cp.rank - 1], seg[cp.rank - 1]
    return torch.cat([halo, x], dim=1), torch.cat([halo_seg, seq_idx], dim=1)


def carry_in(y: Tensor, final: Tensor, a: Tensor, C: Tensor, seq_idx: Tensor, cp: ContextParallel) -> Tensor:
    """The scan's output ``y`` [1, T/cp, H, P] (from a zero state) with the state carried in from the ranks before
    added to the tokens of this rank's first row. ``final`` [1, H, P, N]: the state at this rank's end (of its
    last row, from zero); ``a`` [1, T/cp, H]: each token's decay ``A · dt`` (0 for a token that does not advance
    the state); ``C`` [1, T/cp, H, N]."""
    h, p, n = final.shape[1:]
    first, last = seq_idx[0, 0], seq_idx[0, -1]
    both = all_gather(torch.cat([final[0].reshape(-1), a[0].sum(0)]), cp)  # [cp, H·P·N + H]
    ends, decay = both[:, : h * p * n].view(cp.size, h, p, n), both[:, h * p * n:]  # end states, Σ a per rank
    rows = _gather_rows(torch.stack([first, last]).long(), cp)  # [cp, 2]: each rank's first and last row
    state, row = torch.zeros_like(ends[0]), None
    for q in range(cp.rank):  # the ranks before: one row through rank q carries the state on, decayed
        through = row is not None and bool(rows[q, 0] == row) and bool(rows[q, 0] == rows[q, 1])
        state = ends[q] + torch.exp(decay[q])[:, None, None] * state if through else ends[q]
        row = rows[q, 1]
    if row is None or bool(first != row):
        return y + both.sum() * 0
    mine = (seq_idx[0] == first)[:, None]  # [T/cp, 1]: the tokens of the row that went on from the rank before
    reach = torch.exp(torch.cumsum(a[0], dim=0)) * mine  # [T/cp, H]: the carried state's decay at each token
    extra = torch.einsum("thn,hpn->thp", C[0].float(), state) * reach[..., None]
    return y + extra[None].to(y.dtype) + both.sum() * 0

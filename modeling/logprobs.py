"""Per-token log-probs (and entropy) straight from hidden states and the LM head, chunked.

For hidden states h [N, H], the LM head's weight W [V, H], targets y [N] and temperature T:

    z_i        = h_i · Wᵀ / T                                  (the logits, never all at once)
    logprob_i  = z_{i, y_i} − logsumexp_j z_{i,j}
    entropy_i  = −Σ_j p_{i,j} log p_{i,j},   p_i = softmax(z_i)

The naive path (``linear_logprobs_reference``: ``lm_head`` → full logits → ``log_softmax``
→ gather) keeps N × V float32 values alive several times over: the logits, the
log-softmax that autograd saves, the probabilities for the entropy, and in the backward
a gradient of the same size. At N = 8k tokens and V = 152k that is 4.6 GiB per copy.
``linear_logprobs`` is a ``torch.autograd.Function`` that walks the tokens in chunks of
``chunk_tokens`` rows: each chunk's logits are built in float32, reduced to per-token
statistics (logsumexp, picked logit, entropy) and dropped. Backward keeps only h, W, y
and those statistics [N], rebuilds each chunk's logits and turns them into

    ∂L/∂z = g_lp · (onehot(y) − p) + g_ent · (−p · (log p + H))     (times 1/T for ∂/∂(h·Wᵀ))
    ∂L/∂h[chunk] = ∂L/∂z · W,   ∂L/∂W += ∂L/∂zᵀ · h[chunk]

Memory: the peak above the inputs is about 2 × chunk_tokens × V × 4 bytes (one chunk of
logits plus one of probabilities; 1 × without entropy in the forward) instead of several
N × V × 4; plus the float32 ∂L/∂W [V, H]. The cost is one extra logits matmul per chunk
in the backward (4 matmuls of N·V·H instead of 3). bf16/fp16 inputs are computed in
float32 (float64 inputs stay float64, for gradcheck): a half-precision W is copied to
float32 once per pass (V × H × 4 bytes) and its gradient is accumulated in float32
before it is cast back to W's dtype.

Run the checks against the naive path with ``pytest tests/test_logprobs.py``, and the
memory benchmark with ``.venv/bin/python bench/logprob_memory.py [--quick]``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from cascade_rl.kernels.logprob_args import check_args  # shared with kernels/logprob.py


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs; float64 when either input is float64."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)


def allocator_peak(fn) -> int:
    """Peak bytes held by torch's CPU allocator while ``fn`` runs, above what was live before it: what the
    memory claim of this module is checked with (tests/test_logprobs.py, bench/logprob_memory.py).

    The profiler records every CPU allocator call with its size (``profile_memory``); the running sum of
    those, in time order, is what the process holds at each moment, temporaries inside one op included
    (``tracemalloc`` cannot see them: torch's CPU allocator bypasses Python's). ``experimental_event_tree``
    is private API, pinned with torch==2.13.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    allocs = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation]
    running = peak = 0
    for node in sorted(allocs, key=lambda n: n.start_time_ns):
        running += node.extra_fields.alloc_size
        peak = max(peak, running)
    return peak


def linear_logprobs_reference(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The naive path with the same signature: full [N, V] logits, log_softmax, gather.

    ``chunk_tokens`` is ignored. For tests and the benchmark only.
    """
    dtype = _compute_dtype(hidden, weight)
    logits = hidden.to(dtype) @ weight.to(dtype).T / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1) if with_entropy else None
    return picked, entropy


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens, with_entropy):
        dtype = _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        w = weight.to(dtype)  # no copy when W is already float32
        logprob = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
        # Under autocast the matmuls below would run in bf16; logits must stay in float32.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                z = hidden[rows].to(dtype) @ w.T  # [c, V]: the one chunk-sized buffer (two with entropy)
                if temperature != 1.0:
                    z.div_(temperature)
                picked = z.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
                # logsumexp by hand, shifting z in place: torch.logsumexp allocates its own [c, V] temporary.
                zmax = z.amax(dim=1, keepdim=True)
                z.sub_(zmax)  # z − max: ≤ 0, so exp cannot overflow
                if with_entropy:
                    e = torch.exp(z)
                    s = e.sum(dim=1)
                    # H = lse − Σ p z = log s − Σ e (z − max) / s
                    entropy[rows] = s.log() - e.mul_(z).sum(dim=1) / s
                    del e
                else:
                    s = z.exp_().sum(dim=1)
                # Free the chunk now: rebinding z next iteration would free it only after the
                # next matmul had allocated its own, one more [c, V] buffer at the peak.
                del z
                lse[rows] = zmax.squeeze(1) + s.log()
                logprob[rows] = picked - lse[rows]
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = temperature, chunk_tokens, with_entropy
        # Unused outputs then reach backward as None, so their terms are skipped, not multiplied by 0.
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None
        dtype = lse.dtype
        n, chunk = hidden.shape[0], ctx.chunk_tokens
        w = weight.to(dtype)
        # ∂/∂(h·Wᵀ) = (1/T) ∂/∂z: fold 1/T into the [N] upstream grads, not the [c, V] chunk.
        inv_t = 1.0 / ctx.temperature
        g_lp = g_lp.to(dtype) * inv_t if g_lp is not None else None
        g_ent = g_ent.to(dtype) * inv_t if g_ent is not None else None
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows].to(dtype)
                z = h @ w.T
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                logp = z.sub_(lse[rows].unsqueeze(1))  # in place: z is not needed again
                if g_ent is None:
                    grad_z = logp.exp_().mul_(-g_lp[rows].unsqueeze(1))  # −g_lp · p, in place
                else:
                    p = torch.exp(logp)
                    # −g_ent · p · (log p + H), written over log p
                    grad_z = logp.add_(entropy[rows].unsqueeze(1)).mul_(p).mul_(-g_ent[rows].unsqueeze(1))
                    if g_lp is not None:
                        grad_z.sub_(p.mul_(g_lp[rows].unsqueeze(1)))
                    del p
                if g_lp is not None:
                    grad_z.scatter_add_(1, targets[rows].unsqueeze(1), g_lp[rows].unsqueeze(1))
                if want_h:
                    grad_h[rows] = grad_z @ w
                if want_w:
                    grad_w.addmm_(grad_z.T, h)  # accumulates in place: no [V, H] temporary per chunk
                del z, logp, grad_z  # one buffer under three names; free it before the next matmul
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log_softmax(hidden · weightᵀ / T)[targets] per token, and the entropy if asked, without [N, V] logits.

    hidden [N, H], weight [V, H] (an LM head's ``weight``), targets [N] int64 in [0, V).
    Returns (logprob [N], entropy [N] or None), float32 (float64 for float64 inputs).
    Differentiable wrt hidden and weight, once (no double backward). Each pass holds
    about ``2 · chunk_tokens · V`` float32 values at a time; larger chunks mean fewer,
    larger matmuls.
    """
    check_args(hidden, weight, targets, chunk_tokens)
    logprob, entropy = _LinearLogprobs.apply(hidden, weight, targets.long(), float(temperature), chunk_tokens,
                                             with_entropy)
    return logprob, entropy if with_entropy else None


# --------------------------------------------------------------------------- from full logits (reference, SFT)


def _next_token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / T)[targets] for logits [n, L, V], targets [n, L], in float32.

    Computed as logit − logsumexp, so besides the float32 copy of the chunk no second
    [n, L, V] tensor (the full log_softmax) is built.
    """
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_logprobs(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> Tensor:
    """Per-token log-probs [N, L]: out[:, t] = log_softmax(logits[:, t-1] / T)[input_ids[:, t]], out[:, 0] = 0.

    Position 0 has no prediction (nothing precedes it); it is set to 0 and must be
    masked out by the caller, as prompt tokens are.

    Cost: a chunk of n rows needs an n·(L−1)·V float32 temporary (4 bytes each: 2.5 GB
    per row at L=4096, V=152k), so ``chunk_rows`` bounds the peak at one chunk instead
    of all N rows. Under autograd each chunk is checkpointed, so that temporary is
    freed after the forward and rebuilt in the backward (one extra log-softmax per
    chunk) instead of every chunk's being kept alive until ``backward()``.
    """
    n_rows, length = input_ids.shape
    first = logits.new_zeros((n_rows, 1), dtype=torch.float32)
    if length < 2:
        return first[:, :length]
    step = n_rows if chunk_rows is None else max(1, chunk_rows)
    recompute = chunk_rows is not None and torch.is_grad_enabled() and logits.requires_grad
    chunks = []
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        args = (logits[rows, :-1], input_ids[rows, 1:], temperature)
        if recompute:
            chunks.append(checkpoint(_next_token_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_next_token_logprobs(*args))
    return torch.cat([first, torch.cat(chunks, dim=0)], dim=1)

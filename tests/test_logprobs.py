"""modeling/logprobs.py against its naive reference: values, gradients, edge cases, peak memory."""

import pytest
import torch

from cascade_rl.modeling.logprobs import allocator_peak, linear_logprobs, linear_logprobs_reference

H, V = 16, 101


def make(n: int, h: int = H, v: int = V, dtype=torch.float32, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    up_lp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)  # random upstream grads
    return hidden, weight, targets, up_lp, up_ent


def run(fn, hidden, weight, targets, up_lp, up_ent, use_lp=True, use_ent=True, **kw):
    """Values and (grad hidden, grad weight) of Σ up_lp·logprob + Σ up_ent·entropy, for the inputs that want grad."""
    lp, ent = fn(hidden, weight, targets, **kw)
    loss = (lp * up_lp.to(lp.dtype)).sum() if use_lp else 0.0
    if ent is not None and use_ent:
        loss = loss + (ent * up_ent.to(ent.dtype)).sum()
    inputs = [t for t in (hidden, weight) if t.requires_grad]
    grads = torch.autograd.grad(loss, inputs)
    return lp.detach(), None if ent is None else ent.detach(), grads


def assert_grads_close(got, want, rel=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = w.abs().max().clamp(min=1e-12)
        assert ((g - w).abs().max() / scale).item() <= rel


def assert_values_close(got, want, tol=1e-5):
    assert got.dtype == want.dtype == torch.float32
    assert (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("n,chunk", [(37, 8), (64, 16), (37, 1024), (37, 1)])  # ragged, even, N < chunk, 1 row
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_reference(n, chunk, temperature, with_entropy):
    args = make(n)
    kw = dict(temperature=temperature, chunk_tokens=chunk, with_entropy=with_entropy)
    lp, ent, grads = run(linear_logprobs, *args, **kw)
    ref_lp, ref_ent, ref_grads = run(linear_logprobs_reference, *args, **kw)
    assert_values_close(lp, ref_lp)
    if with_entropy:
        assert_values_close(ent, ref_ent)
    else:
        assert ent is None and ref_ent is None
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_only_one_output_in_the_loss(use_lp, use_ent):
    # The unused output's grad reaches backward as None; its term must drop out, not break.
    args = make(50)
    kw = dict(temperature=1.3, chunk_tokens=16, with_entropy=True, use_lp=use_lp, use_ent=use_ent)
    assert_grads_close(run(linear_logprobs, *args, **kw)[2], run(linear_logprobs_reference, *args, **kw)[2])


def test_larger_vocab_and_large_logits():
    # Logits of a few hundred: both paths shift by the row max, so nothing overflows.
    args = make(300, h=32, v=1000, scale=30.0)
    kw = dict(temperature=0.9, chunk_tokens=128, with_entropy=True)
    lp, ent, grads = run(linear_logprobs, *args, **kw)
    ref_lp, ref_ent, ref_grads = run(linear_logprobs_reference, *args, **kw)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    # Values of |logprob| ~ 1e2 here, so the absolute bound scales with them.
    assert (lp - ref_lp).abs().max().item() <= 1e-5 * max(1.0, ref_lp.abs().max().item())
    assert (ent - ref_ent).abs().max().item() <= 1e-5 * max(1.0, ref_ent.abs().max().item())
    assert_grads_close(grads, ref_grads, rel=1e-4)


def test_weight_without_grad():
    hidden, weight, targets, up_lp, up_ent = make(40)
    weight = weight.detach()
    kw = dict(temperature=0.8, chunk_tokens=7, with_entropy=True)
    (grad_h,) = run(linear_logprobs, hidden, weight, targets, up_lp, up_ent, **kw)[2]
    (ref_h,) = run(linear_logprobs_reference, hidden, weight, targets, up_lp, up_ent, **kw)[2]
    assert_grads_close([grad_h], [ref_h])


def test_hidden_without_grad():
    hidden, weight, targets, up_lp, up_ent = make(40)
    hidden = hidden.detach()
    kw = dict(chunk_tokens=9, with_entropy=False)
    (grad_w,) = run(linear_logprobs, hidden, weight, targets, up_lp, up_ent, **kw)[2]
    (ref_w,) = run(linear_logprobs_reference, hidden, weight, targets, up_lp, up_ent, **kw)[2]
    assert_grads_close([grad_w], [ref_w])


def test_no_grad_anywhere():
    hidden, weight, targets, *_ = make(20)
    with torch.no_grad():
        lp, ent = linear_logprobs(hidden, weight, targets, chunk_tokens=6, with_entropy=True)
    assert not lp.requires_grad and not ent.requires_grad
    assert_values_close(lp, linear_logprobs_reference(hidden, weight, targets)[0].detach())


@pytest.mark.parametrize("with_entropy", [False, True])
def test_zero_tokens(with_entropy):
    hidden, weight, targets, up_lp, up_ent = make(0)
    lp, ent, (grad_h, grad_w) = run(linear_logprobs, hidden, weight, targets, up_lp, up_ent,
                                    chunk_tokens=4, with_entropy=with_entropy)
    assert lp.shape == (0,) and (ent is None or ent.shape == (0,))
    assert grad_h.shape == (0, H) and torch.equal(grad_w, torch.zeros(V, H))


def test_bf16_inputs_computed_in_fp32():
    # The reference casts the same bf16 values to fp32, so values agree to fp32 precision;
    # grads come back in bf16 and differ from the reference's by bf16 rounding only.
    args = make(45, dtype=torch.bfloat16)
    kw = dict(temperature=0.7, chunk_tokens=16, with_entropy=True)
    lp, ent, (grad_h, grad_w) = run(linear_logprobs, *args, **kw)
    ref_lp, ref_ent, (ref_h, ref_w) = run(linear_logprobs_reference, *args, **kw)
    assert_values_close(lp, ref_lp)
    assert_values_close(ent, ref_ent)
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    assert_grads_close([grad_h, grad_w], [ref_h, ref_w], rel=1e-2)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64(with_entropy):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=g)

    def fn(h, w):
        lp, ent = linear_logprobs(h, w, targets, temperature=0.8, chunk_tokens=2, with_entropy=with_entropy)
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_rejects_bad_arguments():
    hidden, weight, targets, *_ = make(4)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_logprobs(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError):
        linear_logprobs(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError):
        linear_logprobs(hidden.unsqueeze(0), weight, targets)


# --- peak memory --------------------------------------------------------------------------


def test_peak_memory_is_one_chunk_not_all_tokens():
    n, h, v, chunk = 1024, 32, 8192, 64
    hidden, weight, targets, up_lp, up_ent = make(n, h=h, v=v)
    full_logits, one_chunk = n * v * 4, chunk * v * 4  # 32 MiB and 2 MiB

    def fwd_bwd(fn):
        return lambda: run(fn, hidden, weight, targets, up_lp, up_ent, chunk_tokens=chunk, with_entropy=True)

    naive = allocator_peak(fwd_bwd(linear_logprobs_reference))
    lean = allocator_peak(fwd_bwd(linear_logprobs))
    # The measurement must see full logits when they exist, or the bound below proves nothing.
    assert naive >= 2 * full_logits
    # Two chunk buffers (logits, probabilities), the grads of W and h, and a little for [N] vectors
    # (measured: 5.15 MiB against this bound's 5.6 MiB; a third live chunk would break it).
    assert lean <= 2 * one_chunk + (v * h + n * h) * 4 + one_chunk // 4, (naive, lean)
    assert lean <= full_logits / 4

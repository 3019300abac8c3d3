"""kernels/logprob.py (Triton) against its torch references: values, gradients, edge cases, GPU compilation.

Without CUDA the kernels run under the Triton interpreter (fp32 numpy, one program at a time, 16-wide
tiles), so shapes stay tiny but ragged: N, H, V not multiples of 16, several vocab splits. With CUDA the
same tests run the compiled kernels at their GPU tile sizes, plus a determinism check. Ahead-of-time
compilation for sm_90 (what the interpreter cannot catch: unsupported ops, layouts, shared memory,
registers) is tests/test_triton_aot.py, for every kernel of kernels/.

    .venv/bin/pytest tests/test_logprob_kernel.py
"""

import inspect
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Before triton decorates the kernels (tests/conftest.py may have set it already).
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")  # CPU torch wheels do not bring it

from cascade_rl.kernels import logprob as kernel  # noqa: E402
from cascade_rl.modeling import logprobs as torch_paths  # noqa: E402

assert DEVICE == "cuda" or kernel.INTERPRETED, (
    "kernels.logprob was imported before TRITON_INTERPRET=1 was set; without CUDA it must run interpreted")

REFERENCES = {"naive": torch_paths.linear_logprobs_reference, "chunked": torch_paths.linear_logprobs}


def make(n, h, v, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    up_lp, up_ent = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    return hidden, weight, targets, up_lp, up_ent


def run(fn, hidden, weight, targets, up_lp, up_ent, use_lp=True, use_ent=True, **kw):
    """Values and grads (of the inputs that want them) of Σ up_lp·logprob + Σ up_ent·entropy."""
    lp, ent = fn(hidden, weight, targets, **kw)
    loss = (lp * up_lp).sum() if use_lp else 0.0
    if ent is not None and use_ent:
        loss = loss + (ent * up_ent).sum()
    grads = torch.autograd.grad(loss, [t for t in (hidden, weight) if t.requires_grad])
    return lp.detach(), None if ent is None else ent.detach(), grads


def close(got, want, tol=1e-5):
    """max |Δ| ≤ tol, scaled by the reference's magnitude where that exceeds 1."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    scale = max(1.0, want.abs().max().item())
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= tol * scale, f"max |Δ| {diff:.3g} > {tol * scale:.3g}"


def check_against_references(args, tol=1e-5, grad_tol=1e-5, **kw):
    lp, ent, grads = run(kernel.linear_logprobs, *args, **kw)
    for name, ref in REFERENCES.items():
        ref_lp, ref_ent, ref_grads = run(ref, *args, chunk_tokens=8, **kw)
        assert lp.dtype == torch.float32, name
        close(lp, ref_lp, tol)
        if ref_ent is None:
            assert ent is None
        else:
            close(ent, ref_ent, tol)
        assert len(grads) == len(ref_grads)
        for g, r in zip(grads, ref_grads, strict=True):
            close(g, r, grad_tol)


# (20, 40, 70): two token blocks, three H slices, five vocab tiles over two splits, all ragged;
# (7, 24, 37): one ragged block, three splits of one tile; (32, 32, 64): exact multiples of 16.
@pytest.mark.parametrize("n,h,v", [(20, 40, 70), (7, 24, 37), (32, 32, 64)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_references(n, h, v, temperature, with_entropy):
    check_against_references(make(n, h, v), temperature=temperature, with_entropy=with_entropy)


@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_only_one_output_in_the_loss(use_lp, use_ent):
    # The unused output's grad reaches backward as None: its term drops out.
    check_against_references(make(20, 40, 70, seed=1), temperature=0.7, with_entropy=True, use_lp=use_lp,
                             use_ent=use_ent)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_one_input_without_grad(frozen):
    hidden, weight, *rest = make(20, 40, 70, seed=2)
    (weight if frozen == "weight" else hidden).requires_grad_(False)
    check_against_references((hidden, weight, *rest), temperature=0.7, with_entropy=True)


def test_large_logits():
    # Logits of a few hundred: the online max keeps every exp ≤ 1; |logprob| ~ 1e2 scales the bound.
    check_against_references(make(20, 16, 70, seed=3, scale=30.0), temperature=0.9, with_entropy=True,
                             grad_tol=1e-4)


def test_bf16_inputs():
    # bf16 × bf16 products are exact in fp32, so the values match the fp32 torch paths on the same numbers;
    # ∂L/∂z is rounded to bf16 before its matmuls (and the grads come back in bf16): bf16-sized error there.
    check_against_references(make(20, 40, 70, dtype=torch.bfloat16, seed=4), temperature=0.7, with_entropy=True,
                             grad_tol=2e-2)


@pytest.mark.parametrize("n,v", [(0, 70), (1, 70), (5, 1)])
def test_edge_sizes(n, v):
    # No tokens; one token; a vocabulary of one (logprob 0, entropy 0, zero grads).
    check_against_references(make(n, 24, v, seed=5), with_entropy=True)


def test_vocab_splits_cover_the_vocabulary():
    for blocks in (1, 2, 3, 64, 1000):
        for tiles in (1, 2, 5, 7, 1187):
            splits, per_split = kernel._vocab_splits(blocks, tiles, programs=264)
            assert splits >= 1 and (splits - 1) * per_split < tiles <= splits * per_split  # none empty, all covered
            assert blocks * splits <= max(264, blocks) + blocks  # no more programs than asked for (one round up)


def test_backward_chunks_fit_their_budget_and_cover_the_vocabulary(monkeypatch):
    """The GPU's rule for the ∂z chunk (the interpreter uses two tiles): whole tiles, within DZ_CHUNK_BYTES unless
    one tile alone is over it, never wider than the vocabulary rounded up to a tile."""
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    for n in (1, 1000, 8192, 65536, 2**22):
        for vocab in (1, 70, 32000, 151936):
            for itemsize, block_v in ((2, 128), (4, 64)):
                cols = kernel._chunk_columns(n, vocab, itemsize, block_v)
                assert cols % block_v == 0 and block_v <= cols <= -(-vocab // block_v) * block_v
                assert n * cols * itemsize <= kernel.DZ_CHUNK_BYTES or cols == block_v
    assert -(-151936 // kernel._chunk_columns(8192, 151936, 2, 128)) == 10  # the bench's shape: 10 chunks


def test_same_signature_as_the_reference():
    assert inspect.signature(kernel.linear_logprobs) == inspect.signature(torch_paths.linear_logprobs)


def test_rejects_bad_inputs():
    hidden, weight, targets, *_ = make(4, 8, 16)
    with pytest.raises(TypeError, match="float64"):
        kernel.linear_logprobs(hidden.double(), weight.double(), targets)
    with pytest.raises(ValueError):
        kernel.linear_logprobs(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError):
        kernel.linear_logprobs(hidden, weight, targets[:2])


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter runs one program at a time: trivially deterministic")
def test_gradients_are_deterministic():
    args = make(300, 64, 1000, dtype=torch.bfloat16, seed=6)
    first = run(kernel.linear_logprobs, *args, with_entropy=True)
    second = run(kernel.linear_logprobs, *args, with_entropy=True)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2]), strict=True):
        assert torch.equal(a, b)

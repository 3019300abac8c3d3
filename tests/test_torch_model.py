"""samplers/torch_model.py against transformers: logits, cache paths, weight layouts, MoE implementations."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM

from cascade_rl.kernels.moe import select_experts
from cascade_rl.samplers.kv_cache import KVCache
from cascade_rl.samplers.torch_model import Transformer, read_safetensors


@pytest.fixture(params=["tiny_model", "tiny_dense_model"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


def tokens(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("moe_impl", ["grouped", "dense", "cpu-kernels"])
@torch.no_grad()
def test_prefill_then_decode_logits_equal_transformers(model_dir, moe_impl):
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if moe_impl == "cpu-kernels":  # the C++ kernels: MoE and norms in the prefill, decode as one op
        model = Transformer.from_pretrained(model_dir).use_cpu_kernels()
    else:
        model = Transformer.from_pretrained(model_dir, moe_impl=moe_impl)
    ids = tokens(3, 24, model.args.vocab_size)
    ref = hf(input_ids=ids).logits
    cache = KVCache(model.args, slots=3, max_len=32)
    p = 10
    full = model(ids[:, :p], torch.arange(p).expand(3, -1), cache.prefill(torch.arange(3), torch.arange(3)))
    assert (full - ref[:, :p]).abs().max().item() <= 1e-5
    for t in range(p, 24):  # one token at a time from the cache
        logits = model.decode(ids[:, t], torch.full((3,), t), cache)
        assert (logits - ref[:, t]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-ops", "cpu-kernels"])
@torch.no_grad()
def test_ragged_prompts_shared_prefill_and_per_slot_positions(model_dir, kernels):
    """Right-padded prompts of different lengths, each prefilled once into two slots, then decoded at
    different positions per slot (slot order differs from prompt order): each slot sees only its own tokens."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = Transformer.from_pretrained(model_dir)
    if kernels:
        model.use_cpu_kernels()
    lengths = [5, 11, 8]
    prompts = [tokens(1, n, model.args.vocab_size, seed=n)[0] for n in lengths]
    padded = torch.zeros(3, 11, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    cache = KVCache(model.args, slots=6, max_len=32)
    slots, src = torch.tensor([5, 0, 3, 1, 4, 2]), torch.tensor([0, 0, 1, 1, 2, 2])
    last = model(padded, torch.arange(11).expand(3, -1), cache.prefill(slots, src), last=torch.tensor(lengths) - 1)
    for i, p in enumerate(prompts):
        assert (last[i] - hf(input_ids=p[None]).logits[0, -1]).abs().max().item() <= 1e-5
    # decode 4 steps on slots 0..5; slot s holds prompt src[slots == s] and gets its own new tokens
    prompt_of = {int(s): int(g) for s, g in zip(slots, src)}
    seqs = [prompts[prompt_of[s]].clone() for s in range(6)]
    for step in range(4):
        new = tokens(6, 1, model.args.vocab_size, seed=100 + step)
        pos = torch.tensor([len(q) for q in seqs])
        logits = model.decode(new[:, 0], pos, cache)
        for s in range(6):
            seqs[s] = torch.cat([seqs[s], new[s]])
            assert (logits[s] - hf(input_ids=seqs[s][None]).logits[0, -1]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_cache_move_keeps_a_slot_intact(tiny_model):
    model = Transformer.from_pretrained(tiny_model)
    ids = tokens(2, 9, model.args.vocab_size)
    cache = KVCache(model.args, slots=4, max_len=16)
    model(ids[:, :8], torch.arange(8).expand(2, -1), cache.prefill(torch.tensor([2, 3]), torch.tensor([0, 1])))
    cache.move(torch.tensor([0, 1]), torch.tensor([2, 3]), kv_len=8)
    pos = torch.tensor([8, 8])
    moved = model(ids[:, 8:9], pos[:, None], cache.decode(pos, 9))[:, -1]
    ref = model(ids, torch.arange(9).expand(2, -1), KVCache(model.args, 2, 16).prefill(torch.arange(2),
                                                                                       torch.arange(2)))[:, -1]
    assert (moved - ref).abs().max().item() <= 1e-5


def test_both_weight_layouts_load_and_round_trip(tiny_model, tmp_path):
    """save_pretrained's one-tensor-per-expert files and save_model's fused experts give the same model;
    hf_state_dict gives back exactly transformers' state dict."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(".experts.0.gate_proj." in k for k in read_safetensors(tiny_model))  # the on-disk layout
    model = Transformer.from_pretrained(tiny_model)
    ours, theirs = model.hf_state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model(hf, str(tmp_path / "w.safetensors"))
    model.load_hf_state_dict(read_safetensors(tmp_path / "w.safetensors"))
    ours, theirs = model.hf_state_dict(), hf.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@torch.no_grad()
def test_moe_implementations_agree(tiny_model):
    moe = Transformer.from_pretrained(tiny_model).layers[0].ffn
    for n in (1, 7, 300):
        x = torch.randn(n, moe.w13.shape[1])
        weights, experts = select_experts(moe.router(x), moe.routing)
        assert torch.allclose(weights.sum(-1), torch.ones(n))
        out = {}
        for impl in ("grouped", "dense"):  # the engine's MoE block, on kernels/moe.py's experts
            moe.impl = impl
            out[impl] = moe(x)
        assert (out["grouped"] - out["dense"]).abs().max().item() <= 1e-5


def test_bfloat16_runs(tiny_model):
    model = Transformer.from_pretrained(tiny_model, dtype=torch.bfloat16)
    ids = tokens(2, 6, model.args.vocab_size)
    with torch.no_grad():
        out = model(ids, torch.arange(6).expand(2, -1), KVCache(model.args, 2, 8, torch.bfloat16).prefill(
            torch.arange(2), torch.arange(2)), last=torch.tensor([5, 3]))
    assert out.shape == (2, model.args.vocab_size) and out.dtype == torch.bfloat16 and out.isfinite().all()

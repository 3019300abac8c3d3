"""kernels/cpu_decode.cpp (the torch engine's C++ CPU kernels) against the torch ops they replace.

The whole-model check (prefill + decode logits equal transformers', dense and MoE) is in
tests/test_torch_model.py; here each kernel alone, its edge cases and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cascade_rl.kernels import cpu_decode
from cascade_rl.kernels.moe import Routing, experts_grouped, select_experts
from cascade_rl.samplers.kv_cache import KVCache
from cascade_rl.samplers.torch_model import ModelArgs, apply_rope, rms_norm

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason=f"no C++ build: {cpu_decode.build_error()}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 16), (64, 128), (3, 5, 96), (0, 8)])
def test_rms_norm_equals_torch(shape):
    x = torch.randn(shape, generator=gen(0)) * 3
    w = torch.rand(shape[-1], generator=gen(1)) + 0.5
    assert torch.allclose(cpu_decode.rms_norm(x, w, 1e-6), F.rms_norm(x, shape[-1:], w, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("top_k,normalize", [(1, True), (2, True), (2, False), (4, True), (8, True)])
def test_moe_forward_equals_route_and_grouped_experts(n, top_k, normalize):
    e, h, i = 8, 48, 40
    x = torch.randn(n, h, generator=gen(n))
    router = torch.randn(e, h, generator=gen(1)) * 0.3
    w13 = torch.randn(e, h, 2 * i, generator=gen(2)) * 0.1
    w2 = torch.randn(e, i, h, generator=gen(3)) * 0.1
    weights, experts = select_experts(x @ router.T, Routing(top_k, normalize))
    ref = experts_grouped(x, weights, experts, w13.transpose(1, 2), w2.transpose(1, 2))
    out = cpu_decode.moe_forward(x, router, w13, w2, top_k, normalize)
    assert out.shape == (n, h)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_moe_forward_one_expert_takes_every_token():
    """A router that sends every token to expert 3 first: one expert's rows split over the threads."""
    e, h, i, n = 8, 32, 24, 200
    x = torch.rand(n, h, generator=gen(0)) + 0.1  # positive: a positive router row wins for every token
    router = torch.zeros(e, h)
    router[3] = 1.0
    w13, w2 = torch.randn(e, h, 2 * i, generator=gen(2)), torch.randn(e, i, h, generator=gen(3))
    weights, experts = select_experts(x @ router.T, Routing(2))
    assert bool((experts[:, 0] == 3).all())
    assert torch.allclose(cpu_decode.moe_forward(x, router, w13, w2, 2, True),
                          experts_grouped(x, weights, experts, w13.transpose(1, 2), w2.transpose(1, 2)), atol=1e-4,
                          rtol=1e-5)


def args(hd: int, heads: int = 4, kv: int = 2) -> ModelArgs:
    return ModelArgs(vocab_size=16, dim=heads * hd, n_layers=1, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                     intermediate_size=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                     tie_word_embeddings=True)


@pytest.mark.parametrize("hd,heads,kv", [(32, 4, 2), (64, 4, 4), (16, 6, 2), (128, 2, 1)])
def test_attend_decode_equals_the_torch_decode_path(hd, heads, kv):
    """Per-slot positions (0 included: a slot's first token attends to itself alone); the cache rows
    written must equal the torch path's, and nothing else in the cache may change."""
    a, b, max_len = args(hd, heads, kv), 5, 24
    qkv = torch.randn(b, heads + 2 * kv, hd, generator=gen(0))
    qk_norm = torch.rand(heads + kv, hd, generator=gen(1)) + 0.5
    positions = torch.tensor([0, 3, 17, 23, 9])
    angles = positions[:, None].float() * torch.rand(hd // 2, generator=gen(2))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_cache, cache = KVCache(a, 6, max_len), KVCache(a, 6, max_len)
    ref_cache.k.normal_(generator=gen(3)), ref_cache.v.normal_(generator=gen(4))
    cache.k.copy_(ref_cache.k), cache.v.copy_(ref_cache.v)
    # torch path: the norm and RoPE of Attention.forward, then KVCache.decode's attention
    qk = apply_rope(qk_norm * rms_norm(qkv[:, None, : heads + kv], None, 1e-6), cos[:, None, None], sin[:, None, None])
    ref = ref_cache.decode(positions, max_len)(0, qk[:, :, :heads], qk[:, :, heads:], qkv[:, None, heads + kv:])
    out = cpu_decode.attend_decode(qkv, qk_norm, cos, sin, cache.k[0], cache.v[0], positions, heads, 1e-6)
    assert torch.allclose(out, ref.reshape(b, -1), atol=1e-5, rtol=1e-5)
    assert torch.allclose(cache.k, ref_cache.k, atol=1e-6) and torch.equal(cache.v, ref_cache.v)


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="last dim"):
        cpu_decode.rms_norm(x, torch.ones(7), 1e-6)
    router, w13, w2 = torch.randn(4, 8), torch.randn(4, 8, 6), torch.randn(4, 3, 8)
    with pytest.raises(RuntimeError, match="top_k"):
        cpu_decode.moe_forward(x, router, w13, w2, 5, True)
    with pytest.raises(RuntimeError, match=r"w2 must be \[E, I, H\]"):
        cpu_decode.moe_forward(x, router, w13, torch.randn(4, 8, 3), 2, True)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_decode.moe_forward(x.T.contiguous().T, router, w13, w2, 2, True)
    a = args(8)
    cache = KVCache(a, 2, 4)
    qkv, qk_norm, cs = torch.randn(2, 8, 8), torch.ones(6, 8), torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_decode.attend_decode(qkv, qk_norm, cs, cs, cache.k[0], cache.v[0], torch.tensor([1, 4]), 4, 1e-6)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_decode.attend_decode(qkv, qk_norm, cs, cs, cache.k[0], cache.v[0], torch.tensor([1, 2.0]), 4, 1e-6)
    with pytest.raises(RuntimeError, match="qkv must be"):
        cpu_decode.attend_decode(qkv[:, :7], qk_norm, cs, cs, cache.k[0], cache.v[0], torch.tensor([1, 2]), 4, 1e-6)


def test_engine_refuses_kernels_it_cannot_use(tiny_model):
    from cascade_rl.samplers.torch_engine import TorchEngine

    with pytest.raises(ValueError, match="float32"):
        TorchEngine(tiny_model, dtype="bfloat16", cpu_kernels=True)
    assert not TorchEngine(tiny_model, dtype="bfloat16").cpu_kernels  # default: on only where they apply


@pytest.mark.slow
def test_a_builder_killed_midway_does_not_block_the_next_one(tmp_path):
    """torch's build lock is a file; a sampler SIGKILLed while it builds leaves it behind, and the next process that
    must build waits on it forever (bench/chaos.py found every sampler after such a kill hung). In a fresh build
    folder holding only that stale lock (a first build killed midway), a new process builds and loads the library:
    it clears the file under the kernel lock it holds. One real build: about half a minute."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    code = "from cascade_rl.kernels import cpu_decode; print(cpu_decode.build_dir())"
    where = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                check=True).stdout.strip())
    where.mkdir(parents=True)
    (where / "lock").write_text("")  # what the killed builder left
    code = "from cascade_rl.kernels import cpu_decode; assert cpu_decode.available(), cpu_decode.build_error()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(where.glob("*.so")) and not (where / "lock").exists()

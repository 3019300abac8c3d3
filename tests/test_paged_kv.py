"""The torch engine's paged KV cache (samplers/paged_kv.py, ``TorchEngine(kv_cache="paged")``; admission and
preemption in samplers/scheduler.py): its decode attention equals the static cache's; the engine gives the static
engine's tokens and log-probs (tiny Qwen3-MoE and tiny Nemotron-H, multi-turn prefix reuse included); one 16K-token
row among short ones runs in less memory than the static cache reserves (its pool and the peak of every tensor
allocated during generate); rows wait and are preempted when the pool is full and still finish with the static
engine's tokens; a row that can never fit is refused naming ``sampler.kv_cache_tokens``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import built_once
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.kv_cache import KVCache
from cascade_rl.samplers.paged_kv import PagedKVCache
from cascade_rl.samplers.state_cache import KVShape
from cascade_rl.samplers.torch_engine import TorchEngine

TOL = 1e-4  # fp32: the paged decode's segment softmax sums in another order than the static cache's softmax
LONG = 16384


@pytest.fixture(scope="module")
def nh_model(tmp_path_factory) -> str:
    """The tiny Nemotron-H, shared with tests/test_nemotron_h_engine.py (the same built-once folder)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-nemotron-h",
                      lambda d: str(make_tiny_model(d / "tiny-nemotron-h", arch="nemotron_h")))


@pytest.fixture(params=["tiny_model", "nh_model"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def long_model(tiny_model, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE, same weights and tokenizer, with a context of 16K + 512 tokens (RoPE needs no more)."""
    out = tmp_path_factory.mktemp("long-context") / "model"
    shutil.copytree(tiny_model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = LONG + 512
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def requests(lengths, n=2, max_tokens=24, temperature=1.0, seed=7, vocab=300) -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [GenerationRequest(f"r{i}", rng.integers(3, vocab, p).astype(np.int32), n, temperature, 1.0, max_tokens,
                              [], seed=seed) for i, p in enumerate(lengths)]


def engines(path: str, **paged) -> tuple[TorchEngine, TorchEngine]:
    """A static engine on torch ops (the paged one cannot run the C++ kernels) and a paged one, same settings."""
    kw = dict(max_batch=paged.pop("max_batch", 5), ignore_eos=paged.pop("ignore_eos", False),
              return_routes=paged.pop("return_routes", False))
    return (TorchEngine(path, cpu_kernels=False, **kw),
            TorchEngine(path, kv_cache="paged", kv_block_size=paged.pop("kv_block_size", 4), **paged, **kw))


def assert_same(a: list, b: list) -> None:
    for x, y in zip([s for g in a for s in g], [s for g in b for s in g], strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL)
        assert x.finish_reason == y.finish_reason
        np.testing.assert_array_equal(x.routes, y.routes)  # None when not asked for


# --- the cache alone ---


def test_paged_decode_attention_equals_the_static_cache():
    """Random K/V written through prefill, random positions: the paged decode (blocks in flight, segment softmax)
    attends as the static cache's padded decode does, GQA included; compaction moves block tables, not K/V."""
    torch.manual_seed(0)
    shape, hd, heads = KVShape(2, 2, 8), 8, 4
    lengths = [1, 5, 16, 17, 33]
    static = KVCache(shape, slots=len(lengths), max_len=64)
    paged = PagedKVCache(shape, slots=len(lengths), max_len=64, blocks=40, block_size=4)
    for slot, n in enumerate(lengths):
        assert paged.grow(slot, n + 1)
        k, v = torch.randn(1, n, 2, hd), torch.randn(1, n, 2, hd)
        q = torch.randn(1, n, heads, hd)
        for cache in (static, paged):
            for layer in range(2):
                cache.prefill(torch.tensor([slot]), torch.tensor([0]))(layer, q, k, v)
    pos = torch.tensor(lengths)
    q, k, v = torch.randn(len(lengths), 1, heads, hd), torch.randn(len(lengths), 1, 2, hd), torch.randn(len(lengths), 1, 2, hd)
    paged.plan_decode(pos.numpy())
    for layer in range(2):
        want = static.decode(pos, int(pos.max()) + 1)(layer, q, k, v)
        got = paged.decode(pos, 0)(layer, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    used = paged.used_blocks
    paged.release([1])
    paged.move(torch.tensor([1]), torch.tensor([4]), 0, (np.array([1]), np.array([4])))
    assert paged.used_blocks == used - 2 and not paged.owned[4] and len(paged.owned[1]) == 9
    torch.testing.assert_close(paged.save(1, 34)[0], static.save(4, 34)[0].transpose(1, 2))


def test_make_room_preempts_the_newest_rows():
    """A full pool: the oldest rows get their blocks; the newest give theirs up, newest first, itself included."""
    cache = PagedKVCache(KVShape(1, 1, 2), slots=3, max_len=64, blocks=7, block_size=4)  # 6 usable blocks
    for slot in range(3):
        assert cache.grow(slot, 8)  # 2 blocks each: none free
    assert cache.make_room(np.array([7, 7, 7]), age=np.array([0, 2, 1])) == []  # every next token has its block
    assert cache.make_room(np.array([8, 5, 8]), age=np.array([0, 2, 1])) == [1]  # 0 and 2 need one: 1 is newest
    assert cache.free_blocks == 0 and [len(b) for b in cache.owned] == [3, 0, 3]
    cache.move(torch.tensor([1]), torch.tensor([2]), 0, (np.array([1]), np.array([2])))  # the engine compacts
    assert cache.make_room(np.array([9, 12]), age=np.array([0, 1])) == [1]  # the newest itself needed a block
    assert [len(b) for b in cache.owned] == [3, 0, 0] and cache.free_blocks == 3


# --- the engine: same results as the static cache ---


def test_paged_engine_equals_static(model_dir):
    """Sampled rows of different lengths, more rows than slots (admission as slots free up, compaction), EOS
    stops, 4-token blocks: the same tokens and log-probs."""
    static, paged = engines(model_dir, kv_cache_tokens=4096)
    reqs = requests([5, 37, 12, 70, 3, 20])
    assert_same(static.generate(reqs), paged.generate(reqs))
    assert paged.counters["kv_preempted"] == 0 and paged.cache.used_blocks == 0  # every block back in the pool
    assert paged.cpu_kernels is False and paged.graphs is None


def test_paged_multi_turn_reuses_kept_prefixes(model_dir):
    """Turn 2 extends turn 1 (greedy, prefix_keys): the kept K/V (and Mamba state) is restored into blocks and only
    the new tokens prefill, as with the static cache."""
    static, paged = engines(model_dir, kv_cache_tokens=2048)
    out = []
    for engine in (static, paged):
        first = requests([9, 30], n=1, max_tokens=12, temperature=0.0)
        for i, r in enumerate(first):
            r.prefix_keys = [f"row{i}"]  # each row's K/V kept under its key when it stops
        turn1 = engine.generate(first)
        second = [GenerationRequest(r.key, np.concatenate([r.prompt_ids, g[0].response_ids, [5, 6, 7]]).astype(np.int32),
                                    1, 0.0, 1.0, 10, [], prefix_keys=r.prefix_keys) for r, g in zip(first, turn1)]
        out.append((turn1, engine.generate(second)))
    assert_same(out[0][0], out[1][0])
    assert_same(out[0][1], out[1][1])
    stops = sum(g[0].finish_reason == "stop" for g in out[0][0])
    assert paged.counters["prefix_hits"] == static.counters["prefix_hits"] == stops


def test_rows_wait_and_are_preempted_when_the_pool_is_full(model_dir):
    """A pool of 160 tokens for 12 rows needing up to 110 each: rows wait for blocks and the newest are preempted
    (recomputed on re-admission), and every row still ends with the static engine's greedy tokens, log-probs and
    MoE routes (R3: a preempted row's recomputed prefill adds only its last sampled token's)."""
    static, paged = engines(model_dir, kv_cache_tokens=160, max_batch=8, ignore_eos=True, return_routes=True)
    reqs = requests([5, 37, 12, 70, 3, 20], max_tokens=40, temperature=0.0)
    assert_same(static.generate(reqs), paged.generate(reqs))
    assert paged.counters["kv_waits"] > 0 and paged.counters["kv_preempted"] > 0
    assert paged.counters["kv_peak_blocks"] <= 40 and paged.cache.used_blocks == 0


def test_a_row_that_can_never_fit_is_refused_with_the_setting(tiny_model):
    engine = TorchEngine(tiny_model, kv_cache="paged", kv_cache_tokens=64)
    big = requests([50], n=1, max_tokens=32)[0]
    assert "raise sampler.kv_cache_tokens" in engine.check(big) and "(82)" in engine.check(big)
    with pytest.raises(ValueError, match="sampler.kv_cache_tokens"):
        engine.generate([big])
    long_prompt = requests([600], n=1, max_tokens=8)[0]  # past the 512-token context: the context's reason
    assert "exceeds the model context 512" in engine.check(long_prompt)
    assert engine.generate(requests([40], n=2, max_tokens=8))  # 48 tokens fit, two rows in turn


def test_paged_refuses_cpu_kernels_and_comes_from_the_config(tiny_model):
    with pytest.raises(ValueError, match="cpu_decode.cpp reads the static KV cache"):
        TorchEngine(tiny_model, kv_cache="paged", cpu_kernels=True)
    with pytest.raises(ValueError, match="kv_cache='dynamic'"):
        TorchEngine(tiny_model, kv_cache="dynamic")
    from cascade_rl.supervisor.config import compose

    cfg = compose("tiny", [f"model.path={tiny_model}", "sampler.kv_cache=paged", "sampler.kv_cache_tokens=1024",
                           "sampler.kv_block_size=8"], check=False)
    engine = TorchEngine.from_config(cfg, torch.device("cpu"))
    assert engine.paged and engine.kv_blocks == 129 and engine.kv_block_size == 8


# --- memory at length ---


class PeakBytes(TorchDispatchMode):
    """The live bytes of the storages that ops allocate while it is on, and their peak: a storage counts from the
    op that returned it until it is freed (a storage's Python object lives as long as the storage, so a finalizer
    on it sees the free). Buffers an op uses inside and frees before it returns are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in inputs and key not in self.live:  # a new allocation, not a view or in place
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def test_a_16k_row_among_short_ones_fits_where_a_per_row_reservation_would_not(long_model):
    """One 16,384-token prompt among 15 of 24 tokens, 8 tokens each, in a pool of 17K tokens: the pool is a
    fifteenth of the static cache's 16 slots x 16,512 positions, and every tensor generate allocates (the pool, the
    16K prefill's activations, the decode steps) peaks below what the static cache alone would reserve."""
    engine = TorchEngine(long_model, kv_cache="paged", kv_cache_tokens=LONG + 1024, ignore_eos=True)
    rng = np.random.default_rng(0)
    reqs = [GenerationRequest("long", rng.integers(3, 300, LONG).astype(np.int32), 1, 1.0, 1.0, 8, [], seed=1)]
    reqs += [GenerationRequest(f"s{i}", rng.integers(3, 300, 24).astype(np.int32), 1, 1.0, 1.0, 8, [], seed=1)
             for i in range(15)]
    a = engine.model.args
    per_token = a.n_layers * 2 * a.n_kv_heads * a.head_dim * 4  # fp32 K and V of every layer
    static_bytes = len(reqs) * (-(-(LONG + 8) // 128) * 128) * per_token  # TorchEngine._ensure_cache's reservation
    with PeakBytes() as peak:
        groups = engine.generate(reqs)
    assert [len(g[0].response_ids) for g in groups] == [8] * 16
    pool_bytes = sum(b.numel() * b.element_size() for b in engine.cache.buffers())
    assert pool_bytes < static_bytes / 12
    assert pool_bytes < peak.peak < static_bytes / 2, (peak.peak / 2**20, static_bytes / 2**20)
    assert engine.counters["kv_peak_blocks"] * 16 >= LONG + 15 * 24  # every row was in the pool at once
    assert engine.counters["kv_waits"] == 0 and engine.counters["kv_preempted"] == 0


def test_the_engine_bench_runs(tmp_path):
    """bench/lengths.py --engine --smoke (tests/test_benches.py runs its trainer part): each mode's child writes its
    figures, the paged cache smaller than the static one."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "lengths.py"
    r = subprocess.run([sys.executable, str(bench), "--engine", "--smoke"], capture_output=True, text=True,
                       env=dict(os.environ, CASCADE_BENCH_RESULTS=str(tmp_path)), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    record = json.loads((tmp_path / "lengths-engine.json").read_text())
    assert summary["name"] == "lengths-engine" and 0 < summary["value"] < summary["baseline_value"]
    assert record["rows"]["512"]["paged_half"]["counters"]["kv_waits"] > 0

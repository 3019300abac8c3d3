"""In-flight weight updates: the torch engine takes new weights between decode steps without dropping the rows it
is generating, and every token carries the version that sampled it (samplers/torch_engine.py ``between``).

The reference for "the engine's log-probs are the trainer's under that token's version" is the trainer's own
forward (modeling/policy.py on the HF model) of each whole rollout under version 0 and under version 1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.modeling.policy import Policy
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.torch_engine import TorchEngine

SWITCH_AFTER = 4  # tokens sampled under version 0


def two_versions(path: str):
    """Version 0 (the checkpoint) and version 1 (every weight perturbed), as HF models."""
    v0 = AutoModelForCausalLM.from_pretrained(path)
    v1 = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return v0, v1


def generate_with_update(path: str, v1, inflight_kv: str):
    engine = TorchEngine(path, ignore_eos=True, inflight_kv=inflight_kv)
    calls = []

    def between():
        calls.append(1)
        if len(calls) == SWITCH_AFTER:
            engine.load_tensors(v1.state_dict(), 1)

    prompts = [np.array([1, 5, 7, 9], np.int32), np.array([1, 6, 8], np.int32)]
    reqs = [GenerationRequest(f"r{i}", p, 2, 1.0, 1.0, 12, [], seed=i) for i, p in enumerate(prompts)]
    return prompts, engine.generate(reqs, between=between), engine


def trainer_logprobs(model, prompt: np.ndarray, response: np.ndarray) -> torch.Tensor:
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt):] = True
    with torch.no_grad():
        lp, _ = Policy(model, pack=False)(ids, torch.tensor([ids.shape[1]]), mask)
    return lp[0, len(prompt):]


@pytest.mark.parametrize("inflight_kv", ["recompute", "keep"])
def test_an_update_mid_generation_tags_each_token_with_its_version(tiny_model, inflight_kv):
    v0, v1 = two_versions(tiny_model)
    prompts, groups, engine = generate_with_update(tiny_model, v1, inflight_kv)
    assert engine.version == 1
    worst_after = 0.0
    for p, group in zip(prompts, groups):
        for s in group:
            assert len(s.response_ids) == 12  # nothing dropped: every row ran to its end
            assert s.versions.tolist() == [0] * SWITCH_AFTER + [1] * (12 - SWITCH_AFTER)
            before, after = s.versions == 0, s.versions == 1
            lp0 = trainer_logprobs(v0, p, s.response_ids)
            lp1 = trainer_logprobs(v1, p, s.response_ids)
            engine_lp = torch.from_numpy(s.logprobs)
            torch.testing.assert_close(engine_lp[before], lp0[before], atol=1e-4, rtol=1e-4)
            if inflight_kv == "recompute":  # the K/V recomputed: exactly version 1's log-probs
                torch.testing.assert_close(engine_lp[after], lp1[after], atol=1e-4, rtol=1e-4)
            worst_after = max(worst_after, float((engine_lp[after] - lp1[after]).abs().max()))
    if inflight_kv == "keep":  # the old K/V kept: the tokens after the update are not version 1's
        assert worst_after > 1e-3
    recomputed = engine.counters["inflight_recomputed_tokens"]
    if inflight_kv == "recompute":  # 4 rows, each its prompt and the tokens sampled before the update but the last
        assert recomputed == 2 * (4 + SWITCH_AFTER - 1) + 2 * (3 + SWITCH_AFTER - 1)
    else:
        assert recomputed == 0


def test_without_an_update_every_token_has_the_engines_version(tiny_model):
    engine = TorchEngine(tiny_model)
    engine.version = 7
    out = engine.generate([GenerationRequest("a", np.array([1, 2, 3], np.int32), 2, 1.0, 1.0, 6, [], seed=0)],
                          between=lambda: None)
    assert all((s.versions == 7).all() and len(s.versions) == len(s.response_ids) for s in out[0])


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_async_launch_with_inflight_updates_records_each_rollouts_version_span(lora, tiny_model, math_data,
                                                                                   tmp_path):
    """max_staleness=1 with in-flight updates, every process real: the sampler generates the next batch while the
    trainer steps and takes its weights mid-generation (random weights run rows to hundreds of tokens: 4 rows of up
    to 400 take longer to decode than a step takes to train), so rollouts span two versions; the ledger writes each
    one's newest version, summary.json the spans, the metrics the largest span per step; nothing is lost and no
    trained rollout is older than allowed. ``lora``: the versions are adapters (trainer.lora), merged mid-generation."""
    from test_launch import cli, read_ledger

    run_dir = tmp_path / "run"
    r = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
            "orchestrator.max_staleness=1", "trainer.correction=icepop", "sampler.inflight_updates=true",
            "run.steps=6", "run.prompts_per_step=2", "run.group_size=2", "sampling.max_tokens=400",
            "orchestrator.eval_n=0", "orchestrator.eval_greedy=false", "supervisor.progress=none",
            "sampler.threads=1", "trainer.threads=1",
            *(["trainer.lora.rank=8", "trainer.lr=5e-2", "trainer.entropy_coef=0.05"] if lora else []), timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["lost"] == 0 and summary["books"]["trained"] == 6 * 2 * 2
    span = summary["version_span"]
    assert span["trained"] == 6 * 2 * 2 and span["spanning"] > 0 and span["max"] == 1, span
    trained = [x for x in read_ledger(run_dir).values() if x["fate"] == "trained"]
    spanning = [x for x in trained if "version_max" in x]
    assert len(spanning) == span["spanning"] and all(x["version_max"] == x["version"] + 1 for x in spanning)
    assert max(x["step"] - x["version"] for x in trained) <= 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m["version_span_max"] for m in metrics if "version" in m) == 1

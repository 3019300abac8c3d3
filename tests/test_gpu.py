"""On a CUDA GPU: the bf16 trainer path with the Triton kernels and varlen attention, and a full MOPD launch with
trainer, sampler and teacher sharing GPU 0 (docs/ARCHITECTURE.md §10). Skipped without CUDA; bench/gpu_checks.sh
runs this file on the GPU machine (bench/gpu_launch.py times the same launch at larger sizes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: Triton kernels, varlen attention and bf16 on one device "
    "(bench/gpu_checks.sh runs it on one)")  # fmt: skip
# every role on GPU 0, sharing it (the shares sum to at most 1); the kernels a GPU run uses
ONE_GPU = ["gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.teachers=[0]",
           "gpus.memory={trainer: 0.35, sampler: 0.3, teacher: 0.15}"]  # fmt: skip
GPU_PATH = ["model.dtype=bf16", "model.attn_impl=varlen", "model.moe_impl=triton", "trainer.logprob_impl=triton"]
MISMATCH_MEAN_MAX = {"bf16": 0.05, "fp32": 1e-4}  # engine vs trainer log-probs: mean |Δ| per token


def safetensors_dtypes(ckpt: Path) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}
    return dtypes


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory, tiny_model) -> str:
    """A second tiny MoE: the same architecture and tokenizer as ``tiny_model``, another seed."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("models") / "teacher", arch="qwen3_moe", seed=1)
    assert (out / "tokenizer.json").read_bytes() == (Path(tiny_model) / "tokenizer.json").read_bytes()
    return str(out)


@needs_cuda
@pytest.mark.slow
def test_mopd_launch_with_trainer_sampler_and_teacher_on_one_gpu(tiny_model, teacher_model, math_data, tmp_path):
    check_mopd_launch(tiny_model, teacher_model, math_data, tmp_path, [*ONE_GPU, *GPU_PATH], "cuda", "bf16")


def check_mopd_launch(tiny_model: str, teacher_model: str, math_data: list[str], tmp_path: Path,
                      placement: list[str], device: str, dtype: str) -> None:
    """A 2-step MOPD launch with ``placement`` overrides; every role must run on ``device`` in ``dtype``."""
    run_dir = tmp_path / "run"
    steps, prompts, group = 2, 8, 4
    cmd = [*CLI, "launch", "tiny", "stage=mopd", "run.algorithm=mopd", f"run_dir={run_dir}",
           f"model.path={tiny_model}", f"+teacher.checkpoints.math={teacher_model}", *math_data, "data.eval_per_domain=8",
           f"run.steps={steps}", f"run.prompts_per_step={prompts}", f"run.group_size={group}",
           "sampling.max_tokens=32", "supervisor.progress=plain", *placement]  # fmt: skip
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the supervisor stops every worker on its way out
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the launch took over 300 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    # every rollout in exactly one column
    assert summary["steps"] == steps and summary["policy_version"] == steps
    assert books["lost"] == 0 and books["in_flight"] == 0
    assert books["dispatched"] == books["trained"] + books["filtered"] + books["stale"]
    assert books["trained"] == steps * prompts * group

    # each model role ran where asked (on a GPU: GPU 0, its only visible device, cuda:0), as the workers record
    workers = {w["id"]: w for w in summary["workers"]}
    for wid in ("trainer-0", "sampler-0", "teacher-0"):
        assert workers[wid]["gpus"] == ([0] if device == "cuda" else []), workers[wid]
        assert workers[wid]["counters"]["device"].startswith(device), workers[wid]["counters"]
    torch_dtype = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    assert torch_dtype in workers["trainer-0"]["counters"]["device"]
    assert f"on {device}" in (run_dir / "logs" / "trainer-0.log").read_text()

    # engine vs trainer log-probs, every step: present, finite, small
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in metrics if "version" in m]
    assert [m["version"] for m in train_steps] == list(range(1, steps + 1))
    for m in train_steps:
        for key in ("abs_diff_mean", "abs_diff_max", "kl_k3", "outside_band"):
            assert math.isfinite(m[f"trainer/mismatch/{key}"]), (key, m)
        assert m["trainer/mismatch/abs_diff_mean"] < MISMATCH_MEAN_MAX[dtype], m
        assert math.isfinite(m["trainer/mopd/reverse_kl"]) and math.isfinite(m["trainer/loss"])
    assert set(summary["mismatch"]) >= {"abs_diff_mean", "abs_diff_max"}
    assert all(math.isfinite(v) for v in summary["mismatch"].values())

    # the checkpoint holds the weights in the dtype they were trained in
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == f"step_{steps:06d}"
    assert safetensors_dtypes(ckpt) == {{"bf16": "BF16", "fp32": "F32"}[dtype]}


@needs_cuda
def test_policy_with_triton_kernels_and_varlen_matches_torch_and_sdpa_on_cuda(tiny_model):
    """The trainer's bf16 GPU path (Triton MoE + fused log-prob kernel + torch's FlashAttention varlen, packed
    rows) against the torch path (HF grouped_mm experts + chunked torch log-probs + SDPA) on the same weights:
    log-probs, entropies and gradients agree within bf16's precision."""
    compare_policy_paths(tiny_model, "cuda", "bf16", ("sdpa", "hf", "torch"), ("varlen", "triton", "triton"))


def compare_policy_paths(tiny_model: str, device: str, dtype: str, reference: tuple[str, str, str],
                         candidate: tuple[str, str, str]) -> None:
    """Policy log-probs, entropies and gradients of one batch under two (attn_impl, moe_impl, logprob_impl)."""
    from transformers import AutoConfig

    from cascade_rl.modeling.models import load_model
    from cascade_rl.modeling.policy import Policy
    from cascade_rl.supervisor.config import compose

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    g = torch.Generator().manual_seed(0)
    n, width, prompt = 8, 160, 12
    lengths = torch.randint(prompt + 4, width + 1, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, width), generator=g)
    ids[torch.arange(width)[None, :] >= lengths[:, None]] = 0
    target = (torch.arange(width)[None, :] >= prompt) & (torch.arange(width)[None, :] < lengths[:, None])
    ids, lengths, target = ids.to(device), lengths.to(device), target.to(device)
    weights = torch.randn(n, width, generator=g).to(device)

    results = []
    for attn, moe, logprob in (reference, candidate):
        cfg = compose(None, [f"model.path={tiny_model}", f"model.dtype={dtype}", f"model.attn_impl={attn}",
                             f"model.moe_impl={moe}"], check=False)
        model = load_model(tiny_model, cfg, device)
        assert model.config._attn_implementation == attn
        assert next(model.parameters()).dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        lp, ent = Policy(model, logprob_impl=logprob)(ids, lengths, target, with_entropy=True)
        ((lp * weights).sum() + ent.sum()).backward()
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten()
                           for p in model.parameters()])
        results.append((lp.detach().float(), ent.detach().float(), grads))

    (lp_ref, ent_ref, g_ref), (lp, ent, grads) = results
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grads).all()
    assert not lp[~target].any()  # nothing outside the targets
    diff = (lp - lp_ref)[target].abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean().item(), diff.max().item())
    ent_diff = (ent - ent_ref)[target].abs()
    assert ent_diff.mean() < 0.02, ent_diff.mean().item()
    cosine = torch.nn.functional.cosine_similarity(grads, g_ref, dim=0)
    assert cosine > 0.99, cosine.item()


@needs_cuda
def test_lora_trains_ships_and_merges_on_cuda(tiny_model, tmp_path):
    """LoRA on the GPU path (bf16 base, Triton experts, varlen, fused log-probs): fp32 adapters on cuda:0 beside the
    frozen bf16 base, the adapter shipped alone, merged by the bf16 torch engine on cuda:0 into log-probs that agree
    with the trainer's within bf16's precision."""
    check_lora_round_trip(tiny_model, tmp_path, "cuda", "bf16", GPU_PATH)


def test_lora_round_trip_on_the_cpu(tiny_model, tmp_path):
    """The same round trip on the CPU in fp32 (tests/test_gpu.py's GPU check, rehearsed: 1e-4)."""
    check_lora_round_trip(tiny_model, tmp_path, "cpu", "fp32", [])


def test_lora_adapters_stay_fp32_on_a_bf16_base_on_the_cpu(tiny_model, tmp_path):
    """The GPU check's bf16 round trip on the CPU: the first GPU run found the adapters built in bf16 beside the
    bf16 base (peft's inject_adapter_in_model does not upcast them); fp32 adapters, the base in bf16, the merge
    by the bf16 engine within bf16's precision. The CPU's own kernels (sdpa, grouped experts, torch log-probs):
    varlen attention and the Triton kernels of GPU_PATH need CUDA."""
    check_lora_round_trip(tiny_model, tmp_path, "cpu", "bf16", [])


def check_lora_round_trip(tiny_model: str, tmp_path: Path, device: str, dtype: str, overrides: list[str]) -> None:
    import numpy as np
    from safetensors.torch import load_file

    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import Batch, build, publish, train_step
    from cascade_rl.protocol.rows import from_padded
    from cascade_rl.samplers.engine import GenerationRequest
    from cascade_rl.samplers.torch_engine import TorchEngine
    from cascade_rl.supervisor.config import compose
    from cascade_rl.weights.shm import ShmTransport

    cfg = compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}", f"model.dtype={dtype}",
                           "trainer.lora.rank=8", "trainer.lr=2e-2", "trainer.entropy_coef=0.05", *overrides],
                  check=False)
    policy, reference, opt, _, _ = build(cfg, parallel.Ranks(), device)
    lora = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert lora and all(".lora_" in n and p.dtype == torch.float32 and p.device.type == device
                        for n, p in lora.items())
    frozen = {str(p.dtype) for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen == {"torch.bfloat16" if dtype == "bf16" else "torch.float32"}
    rng = np.random.default_rng(0)
    n, prompt, resp = 16, 8, 24
    ids = rng.integers(5, 300, size=(n, prompt + resp)).astype(np.int32)
    mask = np.zeros((n, prompt + resp), bool)
    mask[:, prompt:] = True
    batch = Batch.from_message(from_padded(step=0, group_size=4, input_ids=ids, response_mask=mask,
                                           inf_logprobs=np.zeros_like(mask, np.float32),
                                           rewards=rng.integers(0, 2, n).astype(np.float32),
                                           versions=np.zeros(n, np.int32)))
    for step in range(2):
        train_step(policy, opt, batch.to(torch.device(device)), cfg.trainer, step, reference, run=cfg.run)
    assert all(p.dtype == torch.float32 and "master" not in opt.state[p] for p in lora.values())  # their own masters
    transport = ShmTransport(run_id=f"lora-gpu-{os.getpid()}")
    try:
        notice = publish(transport, policy, parallel.Ranks(), 2)
        assert {t.dtype for t in load_file(notice.uri.removeprefix("file://")).values()} == {torch.float32}
        engine = TorchEngine(tiny_model, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype], device=device)
        engine.load_adapter(notice.uri.removeprefix("file://"), 2, notice.adapter)
    finally:
        transport.close()
    assert engine.version == 2
    requests = [GenerationRequest(f"r{i}", ids[i, :prompt].copy(), 2, 1.0, 1.0, 16, [], i) for i in range(4)]
    groups = engine.generate(requests)
    samples = [s for group in groups for s in group]
    rows = [np.concatenate([r.prompt_ids, s.response_ids]) for r, group in zip(requests, groups) for s in group]
    width = max(map(len, rows))
    padded = torch.zeros(len(rows), width, dtype=torch.long)
    target = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = torch.from_numpy(row.astype(np.int64))
        target[i, prompt:len(row)] = True
    lengths = torch.tensor([len(r) for r in rows])
    with torch.no_grad():  # the trainer's log-probs of the engine's samples, under the adapter it shipped
        lp, _ = policy(padded.to(device), lengths.to(device), target.to(device))
    diffs = torch.cat([(lp[i, prompt:len(row)].float().cpu() - torch.from_numpy(s.logprobs)).abs()
                       for i, (row, s) in enumerate(zip(rows, samples))])
    assert diffs.mean().item() < MISMATCH_MEAN_MAX[dtype], diffs.mean().item()
    if dtype == "fp32":
        assert diffs.max().item() < 1e-4, diffs.max().item()
    with torch.no_grad():  # and the adapter moved the policy: the base's log-probs differ
        from cascade_rl.learner.lora import adapters_off

        with adapters_off(policy):
            base, _ = policy(padded.to(device), lengths.to(device), target.to(device))
    assert (base - lp)[target.to(device)].abs().max().item() > 1e-2


@needs_cuda
def test_a_packed_part_pads_its_micro_batches_on_cuda():
    """The trainer's path for every TrainBatch (learner/batch.py): the part moves packed, each micro-batch is padded on
    the GPU (``index_copy_`` of int64, bool, fp32 and int16 rows), the same values as on the CPU."""
    import numpy as np

    from cascade_rl.learner.batch import Part
    from cascade_rl.protocol import decode, encode
    from cascade_rl.protocol.rows import from_padded

    rng = np.random.default_rng(0)
    lengths = [7, 3, 12, 5, 6, 6]
    n, width = len(lengths), max(lengths)
    real = np.arange(width)[None, :] < np.array(lengths)[:, None]
    mask = real & (np.arange(width)[None, :] >= 2)
    msg = decode(encode(from_padded(
        step=0, group_size=3, input_ids=rng.integers(1, 500, (n, width)).astype(np.int32) * real, response_mask=mask,
        inf_logprobs=-rng.random((n, width)).astype(np.float32) * mask, rewards=np.ones(n, np.float32),
        versions=np.zeros(n, np.int32), lengths=lengths, teacher_logprobs=-rng.random((n, width)).astype(np.float32),
        routes=rng.integers(-1, 8, (n, width, 2, 2)).astype(np.int16), loss_masked=np.array([0, 0, 0, 1, 1, 1], bool))))
    cpu, gpu = Part.from_message(msg), Part.from_message(msg).to(torch.device("cuda"))
    for sl in cpu.groups(1):
        want, got = cpu.rows(sl), gpu.rows(sl)
        for name in ("input_ids", "lengths", "response_mask", "loss_mask", "inf_logprobs", "teacher_logprobs",
                     "routes", "rewards"):
            value = getattr(got, name)
            assert value.is_cuda and torch.equal(value.cpu(), getattr(want, name)), name

"""LoRA RL in the trainer (learner/lora.py): only adapters train and ship, the KL reference is the base with the
adapters off, checkpoints are peft's own adapter directories and resume exactly, bad settings are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_nemotron_h_engine import nh_model  # noqa: F401 (a fixture)
from test_trainer import make_batch
from transformers import AutoModelForCausalLM

from cascade_rl.learner import lora, parallel
from cascade_rl.learner.trainer import build, publish, save_state, train_step
from cascade_rl.modeling.policy import Policy
from cascade_rl.supervisor.config import ConfigError, compose
from cascade_rl.weights import adapters
from cascade_rl.weights.shm import ShmTransport


def lora_cfg(tiny_model, tmp_path, *extra):
    overrides = [f"model.path={tiny_model}", f"run_dir={tmp_path}", "trainer.lr=1e-2", "trainer.lora.rank=8",
                 *extra]
    return compose("tiny", overrides, check=False)


def logprobs(policy, batch):
    with torch.no_grad():
        lp, _ = policy(batch.input_ids, batch.lengths, batch.response_mask)
    return lp


def test_only_adapters_train_and_ship_and_the_reference_is_the_base(tiny_model, tmp_path):
    cfg = lora_cfg(tiny_model, tmp_path, "trainer.kl_coef=0.01")
    policy, reference, opt, tok, state = build(cfg, parallel.Ranks())
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in policy.parameters() if p.requires_grad)
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if ".lora_" not in n}
    batch = make_batch()
    for step in range(2):
        metrics = train_step(policy, opt, batch, cfg.trainer, step, reference, run=cfg.run)
    assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if ".lora_" not in n)

    # the reference: the policy with its adapters off equals a separately loaded base; the policy has moved
    separate = Policy(AutoModelForCausalLM.from_pretrained(tiny_model).eval())
    want = logprobs(separate, batch)
    torch.testing.assert_close(logprobs(reference, batch), want, atol=1e-5, rtol=0)
    assert (logprobs(policy, batch) - want).abs().max() > 1e-3  # the adapter is on again after the reference
    assert all(p.requires_grad for n, p in policy.named_parameters() if ".lora_" in n)

    # one version on the wire: the adapter alone, in peft's names, its config in the notice
    transport = ShmTransport(run_id=f"lora-{tmp_path.name}")
    try:
        notice = publish(transport, policy, parallel.Ranks(), 2)
        shipped = load_file(notice.uri.removeprefix("file://"))
    finally:
        transport.close()
    assert notice.adapter["r"] == 8 and notice.adapter["base_model_name_or_path"] == str(tiny_model)
    assert set(shipped) == {lora.file_name(n, "model.") for n in trainable}
    full = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert notice.nbytes < full / 5


def test_saved_adapter_loads_in_peft_and_resume_is_exact(tiny_model, tmp_path):
    from peft import PeftModel

    cfg = lora_cfg(tiny_model, tmp_path)
    batches = [make_batch(seed=s) for s in range(3)]
    policy, _, opt, tok, _ = build(cfg, parallel.Ranks())
    for step in (0, 1):
        train_step(policy, opt, batches[step], cfg.trainer, step, run=cfg.run)
    ckpt = save_state(policy, opt, tok, tmp_path, 2, {"policy_version": 2}, parallel.Ranks())
    assert adapters.is_adapter(ckpt) and not (tmp_path / "checkpoints" / "step_000002" / "model.safetensors").exists()
    assert json.loads((tmp_path / "checkpoints" / "step_000002" / adapters.CONFIG_FILE).read_text())["r"] == 8

    # peft's own loader gives the trainer's log-probs
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), ckpt).eval()
    torch.testing.assert_close(logprobs(Policy(peft_model.get_base_model()), batches[0]), logprobs(policy, batches[0]),
                               atol=1e-5, rtol=0)

    train_step(policy, opt, batches[2], cfg.trainer, 2, run=cfg.run)
    expected = {k: v.clone() for k, v in policy.state_dict().items()}
    resumed, _, opt2, _, state = build(lora_cfg(tiny_model, tmp_path, "run.resume_from=latest"), parallel.Ranks())
    assert state["step"] == 2
    train_step(resumed, opt2, batches[2], cfg.trainer, 2, run=cfg.run)
    got = resumed.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k  # exact: adapter, optimizer moments, step


@pytest.mark.parametrize("extra, says", [
    (["trainer.lora.targets=[nope_proj]"], "matches no Linear layer"),
    (["trainer.lora.targets=[experts]"], "fused routed experts"),
    (["trainer.lora.rank=4096"], "larger than"),
])
def test_bad_lora_settings_are_refused_with_the_reason(tiny_model, tmp_path, extra, says):
    with pytest.raises(lora.LoraError, match=says):
        build(lora_cfg(tiny_model, tmp_path, *extra), parallel.Ranks())


def test_lora_on_nemotron_h_trains_and_what_peft_refuses_is_said(tmp_path, request):
    """The paper's architecture: the default targets are its attention and shared-expert projections; a Mamba-2
    out_proj, which peft refuses on Mamba models, is refused with peft's reason."""
    nh = request.getfixturevalue("nh_model")
    cfg = lora_cfg(nh, tmp_path, "trainer.kl_coef=0.01")
    policy, reference, opt, _, _ = build(cfg, parallel.Ranks())
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in policy.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
    metrics = train_step(policy, opt, make_batch(), cfg.trainer, 0, reference, run=cfg.run)
    assert metrics["grad_norm"] > 0
    with pytest.raises(lora.LoraError, match="peft refuses"):
        build(lora_cfg(nh, tmp_path, "trainer.lora.targets=[out_proj]"), parallel.Ranks())


def test_launch_refuses_lora_where_adapters_cannot_go(tiny_model, tmp_path, monkeypatch):
    from cascade_rl.samplers.engine import ENGINES, register_builtin_engines

    class FullWeightsOnly:  # a user's engine without load_adapter
        def load_weights(self, path: str, version: int) -> None: ...

    register_builtin_engines()
    monkeypatch.setitem(ENGINES, "full_only", FullWeightsOnly)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / adapters.CONFIG_FILE).write_text(json.dumps({"r": 8, "base_model_name_or_path": "/elsewhere"}))
    for extra, says in [(["sampler.engine=full_only"], "does not load adapters"),
                        (["weights_transport=cuda_ipc"], "ships full weights only"),
                        ([f"model.path={adapter}"], "already a LoRA adapter"),
                        (["trainer.lora.rank=-1"], "must be >= 0"),
                        (["sampler.engine=vllm"], "cannot run LoRA on a MoE model")]:
        with pytest.raises(ConfigError, match=says):
            from cascade_rl.supervisor.config import validate

            validate(lora_cfg(tiny_model, tmp_path, *extra))


@pytest.mark.slow
@pytest.mark.parametrize("context_parallel", [1, 2])
def test_two_ranks_train_the_adapter_like_one_rank(tiny_model, tmp_path, context_parallel):
    """FSDP2 (gloo, 2 ranks), splitting the batch or (context parallelism) each sequence: the adapter after two steps
    (KL to the base with adapters off, micro-batches) is the 1-rank adapter, the published adapter file is the same
    bytes, and a resume takes the last step exactly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    helper = Path(__file__).parent / "helpers" / "lora_dist_steps.py"
    got = {}
    for world in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", DIST_STEPS_CP=str(min(world, context_parallel)))
        out = tmp_path / f"w{world}.safetensors"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
            if world > 1 else [sys.executable]
        r = subprocess.run([*launcher, str(helper), str(tiny_model), str(out)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        report = json.loads(Path(str(out) + ".json").read_text())
        assert report["resumed_step"] == 1 and report["resume_max_diff"] == 0, report
        got[world] = (load_file(out), report)
    (one, r1), (two, r2) = got[1], got[2]
    assert one.keys() == two.keys() and all(".lora_" in k for k in one)
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=2e-5, rtol=0, msg=k)
    assert max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 1e-4  # B moved off zero
    assert r1["published"][0] == r2["published"][0]
    for a, b in zip(r1["metrics"], r2["metrics"]):
        for k in ("loss", "grad_norm", "kl_ref", "entropy"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_the_memory_plan_counts_the_adapter_peft_builds(tiny_model, tmp_path):
    """`cascade-rl plan`'s adapter size is the parameters peft adds, and LoRA leaves gradients and optimizer state
    to the adapters and no second copy for the reference."""
    from cascade_rl.supervisor.memory_plan import trainer_terms
    from cascade_rl.supervisor.memory_report import trainer_settings
    from cascade_rl.supervisor.memory_shapes import shape_from_config

    cfg = lora_cfg(tiny_model, tmp_path, "trainer.kl_coef=0.01")
    policy, *_ = build(cfg, parallel.Ranks())
    shape = shape_from_config(json.loads((Path(tiny_model) / "config.json").read_text()))
    assert shape.lora_params(8) == sum(p.numel() for p in policy.parameters() if p.requires_grad)

    lora_terms = {t.name: t.bytes for t in trainer_terms(shape, trainer_settings(cfg))}
    cfg.trainer.lora.rank = 0
    full_terms = {t.name: t.bytes for t in trainer_terms(shape, trainer_settings(cfg))}
    assert lora_terms["optimizer"] == 8 * shape.lora_params(8) < full_terms["optimizer"] / 10
    assert "reference weights" in full_terms and "reference weights" not in lora_terms


def test_the_adapter_steps_alike_in_every_layout(tiny_model, tmp_path):
    """Packed or padded rows, with or without activation checkpointing (and the KL to the base, the entropy bonus):
    two LoRA steps give the same adapter (padded: another summation order, which AdamW turns into 2e-5)."""
    got = {}
    for checkpointing in (False, True):
        for pack in (True, False):
            torch.manual_seed(0)
            cfg = lora_cfg(tiny_model, tmp_path / f"{checkpointing}{pack}", "trainer.kl_coef=0.01",
                           "trainer.entropy_coef=0.01", f"trainer.activation_checkpointing={checkpointing}",
                           f"trainer.pack={pack}")
            policy, reference, opt, _, _ = build(cfg, parallel.Ranks())
            for step in range(2):
                train_step(policy, opt, make_batch(seed=step), cfg.trainer, step, reference, run=cfg.run)
            got[checkpointing, pack] = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    first = got[False, True]
    assert max(v.abs().max().item() for n, v in first.items() if "lora_B" in n) > 1e-3  # the adapter moved
    for layout, adapter in got.items():
        for n, v in adapter.items():
            assert (v - first[n]).abs().max().item() < 1e-4, (layout, n)  # AdamW at lr 1e-2: 1 % of a step

"""LoRA RL in the trainer (learner/lora.py): only adapters train and ship, the KL reference is the base with the
adapters off, checkpoints are peft's own adapter directories and resume exactly, bad settings are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cascade_rl.learner import lora, parallel
from cascade_rl.learner.trainer import build, publish, save_state, train_step
from cascade_rl.modeling.policy import Policy
from cascade_rl.supervisor.config import ConfigError, compose
from cascade_rl.weights import adapters
from cascade_rl.weights.shm import ShmTransport

from test_trainer import make_batch


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


def test_launch_refuses_lora_where_adapters_cannot_go(tiny_model, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / adapters.CONFIG_FILE).write_text(json.dumps({"r": 8, "base_model_name_or_path": "/elsewhere"}))
    for extra, says in [(["sampler.engine=sglang"], "does not load adapters"),
                        (["weights_transport=cuda_ipc"], "ships full weights only"),
                        ([f"model.path={adapter}"], "already a LoRA adapter"),
                        (["trainer.lora.rank=-1"], "must be >= 0")]:
        with pytest.raises(ConfigError, match=says):
            from cascade_rl.supervisor.config import validate

            validate(lora_cfg(tiny_model, tmp_path, *extra))

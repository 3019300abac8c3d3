"""The GRPO train step on a real tiny model: direction of the update, micro-batching, schedule."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from cascade_rl.learner.trainer import Batch, lr_at, train_step
from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.rows import from_padded


def make_batch(groups: int = 2, g: int = 4, prompt: int = 5, resp: int = 6, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    n = groups * g
    ids = rng.integers(5, 200, size=(n, prompt + resp)).astype(np.int32)
    mask = np.zeros((n, prompt + resp), bool)
    mask[:, prompt:] = True
    mask[1, prompt + 3 :] = False  # a shorter response (right padding after it)
    rewards = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), groups)[:n]
    msg = from_padded(step=0, group_size=g, input_ids=ids, response_mask=mask, inf_logprobs=np.zeros_like(mask, np.float32),
                      rewards=rewards, versions=np.zeros(n, np.int32))
    return Batch.from_message(msg)


def cfg(**kw):
    """A ``trainer`` section."""
    base = dict(lr=1e-3, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0,
                micro_batch_groups=0, correction="none", geo_band=[0.99, 1.01], eps_low=0.5, eps_high=2.0, kl_coef=0.0,
                entropy_coef=0.0, lr_decay="none")
    return OmegaConf.create(base | kw)


RUN = OmegaConf.create(dict(algorithm="grpo", steps=100))  # the ``run`` section train_step reads
MOPD_RUN = OmegaConf.create(dict(algorithm="mopd", steps=100))


def seq_logprob(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return (token_logprobs(logits, batch.input_ids) * batch.response_mask).sum(-1)


def test_step_raises_rewarded_and_lowers_unrewarded_sequences(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    batch = make_batch()
    before = seq_logprob(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_step(Policy(model), opt, batch, cfg(lr=0.5), step=0, run=RUN)
    delta = seq_logprob(model, batch) - before
    rewarded = batch.rewards == 1
    assert metrics["grad_norm"] > 0 and metrics["zero_adv_groups"] == 0
    assert delta[rewarded].mean() > 0 > delta[~rewarded].mean()


def test_equal_rewards_give_no_update(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    before = copy.deepcopy(model.state_dict())
    batch = make_batch()
    batch.rewards[:] = 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    metrics = train_step(Policy(model), opt, batch, cfg(), step=0, run=RUN)
    assert metrics["grad_norm"] == 0.0 and metrics["zero_adv_groups"] == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("micro", [1, 2])
def test_micro_batches_of_whole_groups_give_the_same_gradient(tiny_dense_model, micro):
    batch = make_batch(groups=2)
    grads = []
    for m in (0, micro):
        model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        captured = {}
        orig_step = opt.step

        def step(*a, captured=captured, model=model, orig_step=orig_step):
            captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return orig_step(*a)

        opt.step = step
        train_step(Policy(model), opt, batch, cfg(max_grad_norm=1e9, micro_batch_groups=m), step=0, run=RUN)
        grads.append(captured)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4)


def test_linear_warmup_schedule():
    c = cfg(lr=2e-6, warmup_steps=30, warmup_start_lr=2e-7)  # the paper's MOPD schedule
    assert lr_at(0, c, 100) == pytest.approx(2e-7)
    assert lr_at(15, c, 100) == pytest.approx(1.1e-6)
    assert lr_at(30, c, 100) == pytest.approx(2e-6) and lr_at(100, c, 100) == pytest.approx(2e-6)


def test_cosine_decay_after_warmup():
    c = cfg(lr=3e-6, warmup_steps=10, warmup_start_lr=0.0, lr_decay="cosine")  # paper: agentic SWE RL, 30 steps
    assert lr_at(5, c, 30) == pytest.approx(1.5e-6)  # the warm-up is linear as before
    assert lr_at(10, c, 30) == pytest.approx(3e-6)  # decay starts at the full rate
    assert lr_at(20, c, 30) == pytest.approx(1.5e-6)  # half way through the 20 steps left: cos(pi/2) -> half
    assert lr_at(29, c, 30) == pytest.approx(3e-6 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    assert lr_at(29, c, 30) < lr_at(28, c, 30) < lr_at(20, c, 30)


# --- MOPD, KL to a reference, masked groups, importance weights ---------------------------------------


def policy_logprobs(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return Policy(model)(batch.input_ids, batch.lengths, batch.response_mask)[0]


def test_mopd_step_moves_the_student_toward_the_teacher(tiny_dense_model, tmp_path):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    with torch.no_grad():  # a different policy: perturbed weights
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    batch = make_batch()
    batch.teacher_logprobs = policy_logprobs(teacher, batch)
    batch.inf_logprobs = policy_logprobs(student, batch)  # sampled by the student: ratio 1, nothing truncated
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    before = train_step(Policy(student), opt, batch, cfg(correction="icepop"), step=0, run=MOPD_RUN)
    assert before["correction/masked_frac"] == 0.0 and before["mopd/reverse_kl"] != 0.0
    after = policy_logprobs(student, batch)
    m = batch.response_mask
    # the per-token gap to the teacher shrinks (reverse KL estimate on the same tokens)
    assert (after - batch.teacher_logprobs)[m].abs().mean() < (batch.inf_logprobs - batch.teacher_logprobs)[m].abs().mean()


def test_mopd_with_the_teacher_equal_to_the_student_is_no_update(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    batch = make_batch()
    batch.teacher_logprobs = batch.inf_logprobs = policy_logprobs(model, batch)
    before = copy.deepcopy(model.state_dict())
    metrics = train_step(Policy(model), torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg(correction="icepop"), 0,
                         run=MOPD_RUN)
    assert metrics["grad_norm"] == 0.0 and abs(metrics["mopd/reverse_kl"]) < 1e-6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_mopd_without_teacher_logprobs_is_a_clear_error(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        train_step(Policy(model), torch.optim.SGD(model.parameters(), lr=0.1), make_batch(), cfg(correction="icepop"), 0,
                   run=MOPD_RUN)


def test_kl_penalty_reports_k3_to_the_reference_and_pulls_toward_it(tiny_dense_model):
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batch = make_batch()
    batch.rewards[:] = 1.0  # no policy-gradient signal: only the KL term moves the weights
    reference = Policy(ref_model.requires_grad_(False))
    ref_lp = policy_logprobs(ref_model, batch)
    lp = policy_logprobs(model, batch)
    d = ref_lp - lp
    k3 = torch.expm1(d) - d
    expected = torch.stack([k3[r][batch.response_mask[r]].mean() for r in (slice(0, 4), slice(4, 8))]).mean()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = train_step(Policy(model), opt, batch, cfg(kl_coef=0.03), 0, reference=reference, run=RUN)
    assert metrics["kl_ref"] == pytest.approx(expected.item(), rel=1e-4)
    assert metrics["grad_norm"] > 0
    d2 = ref_lp - policy_logprobs(model, batch)
    assert (torch.expm1(d2) - d2)[batch.response_mask].mean() < k3[batch.response_mask].mean()


def step_grads(model_path: str, batch: Batch, **kw) -> dict[str, torch.Tensor]:
    """The gradients one train_step hands to the optimizer."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = {}
    orig = opt.step

    def step(*a):
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return orig(*a)

    opt.step = step
    train_step(Policy(model), opt, batch, cfg(max_grad_norm=1e9, **kw), 0, run=RUN)
    return captured


def test_a_masked_group_contributes_no_gradient(tiny_dense_model):
    batch = make_batch(groups=2)
    masked = dataclasses.replace(batch, loss_mask=batch.loss_mask.clone())
    masked.loss_mask[4:] = False  # group 1 masked (no rollout above the threshold)
    zeroed = dataclasses.replace(batch, rewards=batch.rewards.clone())
    zeroed.rewards[4:] = 0.0  # the same group with no advantage instead: it also adds nothing
    a, b, full = (step_grads(tiny_dense_model, x) for x in (masked, zeroed, batch))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=1e-5)
    assert any((a[n] - full[n]).abs().max() > 1e-6 for n in a)  # while group 1 unmasked does count


def test_importance_weights_truncate_tokens_outside_the_band(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    batch = make_batch()
    lp = policy_logprobs(model, batch)
    inf = lp.clone()
    inf[0, batch.response_mask[0]] -= 5.0  # row 0's sampler log-probs far below the trainer's: ratio e^5
    batch.inf_logprobs = inf
    metrics = train_step(Policy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                         cfg(correction="icepop", geo_band=[0.99, 1.01]), 0, run=RUN)
    assert metrics["correction/masked_frac"] == pytest.approx(batch.response_mask[0].sum().item()
                                                                / batch.response_mask.sum().item())


# --- checkpoint and resume through the trainer's own build / save_state ---------------------------


def test_resume_reproduces_the_next_step_exactly(tiny_model, tmp_path):
    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import build, save_state
    from cascade_rl.supervisor.config import compose

    overrides = [f"model.path={tiny_model}", f"run_dir={tmp_path}", "trainer.warmup_steps=5",
                 "trainer.warmup_start_lr=1e-5", "trainer.lr=1e-3", "trainer.correction=icepop"]
    cfg = compose("tiny", overrides, check=False)  # the trainer alone: no data needed
    batches = [make_batch(seed=s) for s in range(3)]
    policy, _, opt, tok, state = build(cfg, parallel.Ranks())
    assert state["step"] == 0
    for step in (0, 1):
        train_step(policy, opt, batches[step], cfg.trainer, step, run=cfg.run)
    ckpt = save_state(policy, opt, tok, tmp_path, 2, {"policy_version": 2, "orchestrator": {"examples_drawn": 16}},
                      parallel.Ranks())
    train_step(policy, opt, batches[2], cfg.trainer, 2, run=cfg.run)
    expected = {k: v.clone() for k, v in policy.model.state_dict().items()}

    resumed, _, opt2, _, state = build(compose("tiny", overrides + ["run.resume_from=latest"], check=False), parallel.Ranks())
    assert state["step"] == 2 and state["extra"]["orchestrator"]["examples_drawn"] == 16
    assert ckpt.endswith("step_000002")
    train_step(resumed, opt2, batches[2], cfg.trainer, state["step"], run=cfg.run)
    got = resumed.model.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k  # exact: same weights, optimizer moments, step and lr


def test_bf16_micro_batch_grads_accumulate_in_fp32_for_the_step(tiny_dense_model):
    """bf16 parameters, MasterAdamW, one micro-batch per group: the gradient the optimizer steps with is the fp32
    sum of each backward's bf16 gradient (seen by a hook on every parameter), no bf16 ``p.grad`` accumulates, and
    the reported grad_norm is the norm of the fp32 sums."""
    from cascade_rl.learner.optim import MasterAdamW

    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model, dtype=torch.bfloat16)
    params = list(model.parameters())
    per_backward = {id(p): torch.zeros(p.shape) for p in params}
    calls = []

    def seen_by(p):
        def hook(g):  # this backward's bf16 grad of ``p``, before anything accumulates it
            per_backward[id(p)].add_(g.float())
            calls.append(1)
        return hook

    for p in params:
        p.register_hook(seen_by(p))
    opt = MasterAdamW(params, lr=0.0)
    seen = {}

    def step(*a, **k):
        seen["grads"] = [g.clone() for g in opt.grads()]
        seen["bf16_grads"] = [p.grad for p in params]

    opt.step = step
    metrics = train_step(Policy(model), opt, make_batch(groups=4), cfg(micro_batch_groups=1, max_grad_norm=1e9), 0,
                         run=RUN)
    assert len(calls) == 4 * len(params)  # four micro-batches, one backward each
    assert all(g is None for g in seen["bf16_grads"])
    assert [g.dtype for g in seen["grads"]] == [torch.float32] * len(params)
    for g, p in zip(seen["grads"], params):
        assert torch.equal(g, per_backward[id(p)])
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen["grads"]]))
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-6)

"""The GRPO train step on a real tiny model: direction of the update, micro-batching, schedule."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from cascade_rl.learner.losses import token_logprobs
from cascade_rl.learner.trainer import Batch, lr_at, train_step
from cascade_rl.protocol.messages import TrainBatch


def make_batch(groups: int = 2, g: int = 4, prompt: int = 5, resp: int = 6, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    n = groups * g
    ids = rng.integers(5, 200, size=(n, prompt + resp)).astype(np.int32)
    mask = np.zeros((n, prompt + resp), bool)
    mask[:, prompt:] = True
    mask[1, prompt + 3 :] = False  # a shorter response (right padding after it)
    rewards = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), groups)[:n]
    msg = TrainBatch(0, g, ids, mask, np.zeros_like(mask, np.float32), rewards, np.zeros(n, np.int32))
    return Batch.from_message(msg)


def cfg(**kw):
    base = dict(lr=1e-3, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0, micro_batch_groups=0)
    return OmegaConf.create(base | kw)


def seq_logprob(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return (token_logprobs(logits, batch.input_ids) * batch.response_mask).sum(-1)


def test_step_raises_rewarded_and_lowers_unrewarded_sequences(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    batch = make_batch()
    before = seq_logprob(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_step(model, opt, batch, cfg(lr=0.5), temperature=1.0, step=0)
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
    metrics = train_step(model, opt, batch, cfg(), temperature=1.0, step=0)
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
        train_step(model, opt, batch, cfg(max_grad_norm=1e9, micro_batch_groups=m), temperature=1.0, step=0)
        grads.append(captured)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4)


def test_linear_warmup_schedule():
    c = cfg(lr=2e-6, warmup_steps=30, warmup_start_lr=2e-7)  # the paper's MOPD schedule
    assert lr_at(0, c) == pytest.approx(2e-7)
    assert lr_at(15, c) == pytest.approx(1.1e-6)
    assert lr_at(30, c) == pytest.approx(2e-6) and lr_at(100, c) == pytest.approx(2e-6)

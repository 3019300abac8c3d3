"""The ``Trajectories`` component alone (orchestrator/trajectories.py): multi-turn rows driven turn by turn with a
fake chat template, a worker pool and a fake clock; no core, no tokenizer. (Through the core, with the real
template: tests/test_multi_turn.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from cascade_rl.data.rows import Row
from cascade_rl.orchestrator.groups import Group
from cascade_rl.orchestrator.pool import Worker, WorkerPool
from cascade_rl.orchestrator.rules import Rules
from cascade_rl.orchestrator.trajectories import Trajectories
from cascade_rl.orchestrator.trajectory import Phase
from cascade_rl.protocol.messages import EnvReply, EnvRequest, PromptRequest, Rollout, SamplingParams, WorkKey

USER = ({"role": "user", "content": "2*3?"},)
PROMPT = np.array([1, 2, 3], np.int32)
S0, S1, E0 = b"sampler-0", b"sampler-1", b"environment-0"
TOOL = [{"role": "tool", "content": "6"}]


class Template:
    """A chat template of one token per character of a tool turn; a model turn's text is its ids."""

    def __init__(self) -> None:
        self.refuse = False

    def assistant_text(self, turn_ids: np.ndarray) -> str:
        return " ".join(map(str, turn_ids))

    def observation_ids(self, trajectory_ids: np.ndarray, messages: list[dict]) -> list[int]:
        if self.refuse:
            raise ValueError("the template rewrote turn 1")
        return [9] * len(messages[-1]["content"])


@pytest.fixture
def world():
    pool = WorkerPool()
    for ident, role, served in ((S0, "sampler", ()), (S1, "sampler", ()), (E0, "environment", ("python",))):
        pool.join(ident, Worker(role, 64, 0, served))
    template = Template()

    def make(n: int = 1, max_tokens: int = 8, **rules) -> tuple[Trajectories, Group]:
        g = Group("s0g1", Row("r0", USER, "tool_use", "6", {}), PROMPT, n, SamplingParams(max_tokens=max_tokens), 0,
                  True, 0, env="python")
        return Trajectories(Rules(**rules), template, pool, clock=lambda: 0.0), g

    return make, pool, template


def turn(key: WorkKey, prompt: np.ndarray, ids: list[int], finish: str = "stop") -> Rollout:
    return Rollout(key, "tool_use", prompt, np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32), finish)


def test_a_row_goes_turn_step_turn_step_to_its_finished_rollout(world):
    make, pool, _ = world
    trajectories, g = make(max_turns=3)
    assert trajectories.start(g, S1, turn(g.sample_key().answer(0), PROMPT, [10, 11])) is None
    assert list(trajectories.queue) == [WorkKey.step("s0g1", 0, "env", 1, 0)]
    (ident, step), = trajectories.dispatch({g.group_id: g})
    assert ident == E0 and isinstance(step, EnvRequest) and step.key == WorkKey.step("s0g1", 0, "env", 1, 0)
    assert step.messages == [*USER, {"role": "assistant", "content": "10 11"}] and step.key in pool.get(E0).held
    assert trajectories.awaits(g, step.key, "env") and not trajectories.queue
    assert trajectories.env_step(g, EnvReply(step.key, False, TOOL, {"x": 1}, tool_calls=1)) is None
    (ident, req), = trajectories.dispatch({g.group_id: g})
    assert ident == S1  # the row's last sampler first: its K/V prefix lives there
    assert isinstance(req, PromptRequest) and req.key == WorkKey.step("s0g1", 0, "gen", 1, 0) and req.n == 1
    assert req.keep and req.prompt_ids.tolist() == [1, 2, 3, 10, 11, 9]
    assert req.sampling.max_tokens == 8  # the budget (3 turns of 8) leaves more than a turn
    assert trajectories.next_turn(g, S0, turn(req.key.answer(0), req.prompt_ids, [12])) is None
    (_, step2), = trajectories.dispatch({g.group_id: g})
    assert step2.key == WorkKey.step("s0g1", 0, "env", 2, 0) and step2.state == {"x": 1}
    done = trajectories.env_step(g, EnvReply(step2.key, True, tool_calls=0))
    t = g.trajectories[0]
    assert t.phase == Phase.done and t.turn == 2 and t.tool_calls == 1 and t.sampler == S0
    assert done.key == WorkKey.step("s0g1", 0, "gen", 2, 0)  # the row's, with its model turns
    assert done.response_ids.tolist() == [10, 11, 9, 12] and done.loss_mask.tolist() == [True, True, False, True]
    assert done.inf_logprobs.tolist() == [-0.5, -0.5, 0.0, -0.5]


def test_awaits_only_the_step_the_trajectory_waits_for(world):
    make, _, _ = world
    trajectories, g = make()
    trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10]))
    key = WorkKey.step("s0g1", 0, "env", 1, 0)
    assert trajectories.awaits(g, key, "env")
    assert not trajectories.awaits(None, key, "env")  # its group is gone
    assert not trajectories.awaits(g, key, "gen")  # a reply of another kind
    assert not trajectories.awaits(g, WorkKey.step("s0g1", 0, "env", 2, 0), "env")  # another turn
    assert not trajectories.awaits(g, WorkKey.step("s0g1", 0, "env", 1, 1), "env")  # another attempt
    assert not trajectories.awaits(g, WorkKey.step("s0g1", 1, "env", 1, 0), "env")  # a row with no trajectory
    g.error = "sampler_error: boom"
    assert not trajectories.awaits(g, key, "env")  # a failed group waits for nothing


def test_the_budget_and_the_context_end_a_trajectory_and_limit_a_turn(world):
    make, _, _ = world
    trajectories, g = make(max_tokens=8, max_total_tokens=4)
    assert trajectories.budget(g) == 4
    assert trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10, 11])) is None
    key = trajectories.queue[0]
    done = trajectories.env_step(g, EnvReply(key, False, [{"role": "tool", "content": "66"}]))
    assert done is not None and done.response_ids.tolist() == [10, 11, 9, 9]  # ends on the observation
    # the model's context: a trajectory (prompt included) never outgrows it; the next turn samples what is left
    trajectories, g = make(max_tokens=8, context=10)
    assert trajectories.budget(g) == 7
    trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10, 11]))
    trajectories.env_step(g, EnvReply(trajectories.queue.popleft(), False, TOOL))
    (_, req), = trajectories.dispatch({g.group_id: g})
    assert req.sampling.max_tokens == 7 - 3


def test_a_truncated_turn_ends_and_failures_fail_the_group(world):
    make, _, template = world
    trajectories, g = make(n=3)
    done = trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10], finish="length"))
    assert done is not None and done.finish_reason == "length" and not trajectories.queue  # no step for a cut turn
    trajectories.start(g, S0, turn(g.sample_key().answer(1), PROMPT, [10]))
    assert trajectories.env_step(g, EnvReply(trajectories.queue.popleft(), False, ok=False, error="no env")) is None
    assert g.error == "env_error: no env" and g.trajectories[1].phase == Phase.done
    trajectories, g = make()
    template.refuse = True
    trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10]))
    assert trajectories.env_step(g, EnvReply(trajectories.queue.popleft(), False, TOOL)) is None
    assert g.error == "template_error: the template rewrote turn 1"
    trajectories, g = make()
    trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10]))
    gen = WorkKey.step("s0g1", 0, "gen", 1, 0)
    empty = np.zeros(0, np.int32)
    assert trajectories.next_turn(g, S0, Rollout(gen, "tool_use", PROMPT, empty, empty, "error", error="oom")) is None
    assert g.error == "sampler_error: oom"


def test_dispatch_waits_for_a_worker_and_drops_what_no_trajectory_waits_for(world):
    make, pool, _ = world
    trajectories, g = make(n=2)
    trajectories.start(g, S0, turn(g.sample_key().answer(0), PROMPT, [10]))
    trajectories.start(g, S0, turn(g.sample_key().answer(1), PROMPT, [11]))
    pool.get(E0).draining = True  # no environment worker takes work: the steps wait, in order
    assert trajectories.dispatch({g.group_id: g}) == [] and len(trajectories.queue) == 2
    pool.get(E0).draining = False
    trajectories.requeue(WorkKey.step("s0g1", 0, "env", 1, 1))  # an older attempt's step, sent again: skipped
    g.trajectories[1].phase = Phase.done
    (ident, step), = trajectories.dispatch({g.group_id: g})  # row 1 ended meanwhile: only row 0's step goes
    assert ident == E0 and step.key == WorkKey.step("s0g1", 0, "env", 1, 0) and not trajectories.queue

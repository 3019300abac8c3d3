"""The orchestrator's per-stage data options on real groups: overlong penalty, dynamic filtering, loss masking,
and the data cursor carried to checkpoints. (The event loop itself is exercised by tests/test_launch.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cascade_rl.learner.orchestrator import Group, Orchestrator
from cascade_rl.protocol.messages import Rollout, SamplingParams, Score
from cascade_rl.supervisor.config import compose


@pytest.fixture
def make(tiny_model, tmp_path):
    made = []

    def make(**opts) -> Orchestrator:
        overrides = [f"model.path={tiny_model}", f"run_dir={tmp_path}",
                     f"+endpoints.orchestrator=ipc://{tmp_path}/orch-{len(made)}"]
        overrides += [f"orchestrator.{k}={'null' if v is None else v}" for k, v in opts.items()]
        o = Orchestrator(compose("tiny", overrides))
        made.append(o)
        return o

    yield make
    for o in made:
        o.router.close(0)


def group(o: Orchestrator, rewards: list[float], finish: list[str]) -> Group:
    ex = o.train_pool[0]
    g = o._new_group(ex, len(rewards), SamplingParams(), True)
    del o.groups[g.group_id]
    for i, (r, f) in enumerate(zip(rewards, finish)):
        g.rollouts[i] = Rollout(g.group_id, i, "math", g.prompt_ids, np.array([5, 6, 7], np.int32),
                                np.full(3, -0.5, np.float32), f)
        g.scores[i] = Score(f"{g.group_id}/{i}", r, True)
    return g


def test_overlong_penalty_zeroes_truncated_responses(make):
    g_off, g_on = (group(o, [1.0, 1.0, 0.0, 1.0], ["stop", "length", "stop", "length"])
                   for o in (make(), make(overlong_penalty=True)))
    assert make().rewards(g_off).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert make(overlong_penalty=True).rewards(g_on).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_dynamic_filtering_drops_groups_with_equal_rewards(make):
    o = make(dynamic_filtering=True)
    assert o._filter_reason(group(o, [1.0, 1.0, 1.0, 1.0], ["stop"] * 4)) == "uniform_rewards"
    assert o._filter_reason(group(o, [0.0, 0.0, 0.0, 0.0], ["stop"] * 4)) == "uniform_rewards"
    assert o._filter_reason(group(o, [0.0, 1.0, 0.0, 0.0], ["stop"] * 4)) == ""
    # equal only after the overlong penalty: filtered too (what is trained on is what counts)
    o = make(dynamic_filtering=True, overlong_penalty=True)
    assert o._filter_reason(group(o, [0.0, 1.0, 0.0, 0.0], ["stop", "length", "stop", "stop"])) == "uniform_rewards"
    assert make()._filter_reason(group(o, [1.0] * 4, ["stop"] * 4)) == ""  # off by default


def test_masked_groups_travel_as_loss_masked_rows_with_the_cursor(make):
    o = make(mask_threshold=0.5)
    low = group(o, [0.5, 0.2, 0.0, 0.5], ["stop"] * 4)  # nothing above 0.5: masked
    high = group(o, [0.6, 0.2, 0.0, 0.5], ["stop"] * 4)
    for g in (low, high):
        g.masked = bool(o.rewards(g).max() <= o.cfg.orchestrator.mask_threshold)
    o.examples_drawn = 40
    batch = o.build_batch(0, [low, high])
    assert batch.loss_masked.tolist() == [True] * 4 + [False] * 4
    assert batch.response_mask[:4].any()  # the tokens stay (log-prob mismatch is still measured on them)
    assert batch.cursor == {"examples_drawn": 40}
    assert batch.validate() == ""


def test_metrics_go_to_jsonl_and_tensorboard(make, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    o = make(tensorboard=True)
    o._log({"step": 1, "reward_mean": 0.25, "trainer/loss": -0.5, "note": "text is skipped"})
    o._log({"step": 2, "reward_mean": 0.5, "trainer/loss": -0.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["reward_mean"] for x in lines] == [0.25, 0.5]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in events.Scalars("trainer/loss")] == [-0.5, -0.25]
    assert "note" not in events.Tags()["scalars"]

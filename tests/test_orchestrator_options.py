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
def make(tiny_model, math_data, prepared, tmp_path):
    made = []

    def make(**opts) -> Orchestrator:
        overrides = [f"model.path={tiny_model}", *math_data, f"run_dir={tmp_path}",
                     f"+endpoints.orchestrator=ipc://{tmp_path}/orch-{len(made)}"]
        overrides += [f"orchestrator.{k}={'null' if v is None else v}" for k, v in opts.items()]
        o = Orchestrator(prepared(compose("tiny", overrides)))
        made.append(o)
        return o

    yield make
    for o in made:
        o.router.close(0)


def group(o: Orchestrator, rewards: list[float], finish: list[str]) -> Group:
    g = o._new_group(o.prompts.set.row(0), len(rewards), SamplingParams(), True)
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
    o.prompts.restore(40)
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


def test_a_group_domain_is_scored_as_one_request_when_the_group_is_complete(make, tmp_path):
    import sys
    from pathlib import Path

    import zmq

    from cascade_rl.data.rows import Row
    from cascade_rl.protocol.messages import GroupScoreRequest, Ready
    from cascade_rl.protocol.sockets import recv, send

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    import hostile_verifiers  # noqa: F401  (registers the group verifier test_group_len)

    o = make()
    verifier = zmq.Context.instance().socket(zmq.DEALER)  # a real peer on the orchestrator's ROUTER
    verifier.setsockopt(zmq.IDENTITY, b"verifier-9")
    verifier.setsockopt(zmq.LINGER, 0)
    verifier.connect(o.cfg.endpoints.orchestrator)
    send(verifier, Ready("verifier-9", "verifier", slots=8, domains=["test_group_len"]))
    o.pump(lambda: b"verifier-9" in o.workers, timeout_s=10)
    g = group(o, [0.0] * 4, ["stop"] * 4)
    g.row = Row("r", ({"role": "user", "content": "q"},), "test_group_len", "a", {})
    o.groups[g.group_id] = g
    rollouts = dict(g.rollouts)
    g.rollouts.clear()
    g.scores.clear()
    for i in range(3):  # not complete: nothing is queued yet
        g.rollouts[i] = rollouts[i]
        o._queue_score(g, i)
    assert not o.score_queue
    g.rollouts[3] = rollouts[3]
    o._queue_score(g, 3)
    o._queue_score(g, 3)  # queued once only
    assert list(o.score_queue) == [(g.group_id, -1)]
    o._dispatch_scores()
    assert verifier.poll(5000)
    req = recv(verifier, (GroupScoreRequest,))
    assert req.keys == [f"{g.group_id}/{i}/0" for i in range(4)] and len(req.texts) == 4
    assert req.domain == "test_group_len" and req.prompt == "q"
    assert set(o.workers[b"verifier-9"].assigned) == set(req.keys)
    verifier.close(0)


@pytest.fixture
def mopd(tiny_model, math_data, prepared, tmp_path):
    """An MOPD orchestrator and a real teacher peer (a DEALER) on its ROUTER."""
    import zmq

    from cascade_rl.protocol.messages import Ready
    from cascade_rl.protocol.sockets import send

    o = Orchestrator(prepared(compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}", "stage=mopd", *math_data,
                                               f"+teacher.checkpoints.math={tiny_model}",
                                               f"+endpoints.orchestrator=ipc://{tmp_path}/orch-mopd"])))
    teacher = zmq.Context.instance().socket(zmq.DEALER)
    teacher.setsockopt(zmq.IDENTITY, b"teacher-9")
    teacher.setsockopt(zmq.LINGER, 0)
    teacher.connect(o.cfg.endpoints.orchestrator)
    send(teacher, Ready("teacher-9", "teacher", slots=8, domains=["math"]))
    o.pump(lambda: b"teacher-9" in o.workers, timeout_s=10)
    yield o, teacher
    teacher.close(0)
    o.router.close(0)


def arrived(o: Orchestrator, lengths: list[int]) -> Group:
    """A training group whose rollouts (of these response lengths) have all arrived and are scored."""
    g = o._new_group(o.prompts.set.row(0), len(lengths), SamplingParams(), True)
    o.prompt_queue.clear()
    for i, n in enumerate(lengths):
        g.rollouts[i] = Rollout(g.group_id, i, "math", g.prompt_ids, np.arange(5, 5 + n, dtype=np.int32),
                                np.full(n, -0.5, np.float32), "stop")
        g.scores[i] = Score(f"{g.group_id}/{i}/0", 0.0, True)
    o.teacher_queue.append(g.group_id)
    return g


def test_mopd_sends_each_group_to_its_teacher_and_trains_on_the_replies(mopd):
    from cascade_rl.protocol.messages import TeacherLogprobs, TeacherRequest
    from cascade_rl.protocol.sockets import recv, send

    o, teacher = mopd
    g = arrived(o, [3, 1, 2, 4])
    assert g.needs_teacher and not g.complete  # scored, but no teacher log-probs yet
    o._dispatch_teachers()
    assert teacher.poll(5000)
    req = recv(teacher, (TeacherRequest,))
    assert req.key == f"{g.group_id}/teacher/0" and req.domain == "math"
    assert req.response_lens.tolist() == [3, 1, 2, 4] and len(req.response_ids) == 10
    assert req.temperature == o.cfg.sampling.temperature and req.validate() == ""
    logprobs = -np.arange(1, 11, dtype=np.float32) / 10
    send(teacher, TeacherLogprobs(req.key, logprobs, worker_id="teacher-9"))
    o.pump(lambda: g.complete, timeout_s=10)
    assert not o.workers[b"teacher-9"].assigned and not o.teacher_deadlines
    batch = o.build_batch(0, [g])
    p = len(g.prompt_ids)
    assert batch.teacher_logprobs[0, p:p + 3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.teacher_logprobs[3, p:p + 4].tolist() == pytest.approx([-0.7, -0.8, -0.9, -1.0])
    assert batch.teacher_logprobs[~batch.response_mask].max() == 0.0 and batch.validate() == ""
    # a late duplicate (an earlier attempt's reply) is dropped, not applied
    send(teacher, TeacherLogprobs(req.key, logprobs * 2, worker_id="teacher-9"))
    o.pump(lambda: o.books.duplicates_dropped == 1, timeout_s=10)
    assert batch.teacher_logprobs[0, p] == pytest.approx(-0.1)


def test_a_teacher_error_filters_the_group_with_its_reason_and_a_missed_deadline_asks_again(mopd):
    from cascade_rl.protocol.messages import TeacherLogprobs, TeacherRequest
    from cascade_rl.protocol.sockets import recv, send

    o, teacher = mopd
    g = arrived(o, [2, 2])
    o._dispatch_teachers()
    req = recv(teacher, (TeacherRequest,))
    send(teacher, TeacherLogprobs(req.key, np.zeros(0, np.float32), ok=False, error="token id 999 outside the vocab"))
    o.pump(lambda: g.complete, timeout_s=10)
    assert o._filter_reason(g) == "teacher_error: token id 999 outside the vocab"
    # wrong length: an error too, never a misaligned batch
    g2 = arrived(o, [2, 2])
    o._dispatch_teachers()
    req = recv(teacher, (TeacherRequest,))
    send(teacher, TeacherLogprobs(req.key, np.zeros(3, np.float32)))
    o.pump(lambda: g2.complete, timeout_s=10)
    assert o._filter_reason(g2) == "teacher_error: 3 log-probs for 4 tokens"
    # a teacher that never answers: the request goes out again when its deadline passes
    g3 = arrived(o, [1])
    o._dispatch_teachers()
    first = recv(teacher, (TeacherRequest,))
    o.teacher_deadlines[first.key] = 0.0
    o._enforce_deadlines()
    o._dispatch_teachers()
    assert teacher.poll(5000) and recv(teacher, (TeacherRequest,)).key == first.key
    assert not g3.complete


def test_replies_with_keys_never_sent_are_dropped_not_fatal(make):
    from cascade_rl.protocol.messages import TeacherLogprobs

    o = make()
    g = group(o, [0.0, 0.0], ["stop", "stop"])
    g.scores.clear()
    o.groups[g.group_id] = g
    for key in ("garbage", f"{g.group_id}/x/0", f"{g.group_id}/0/7", f"{g.group_id}/0", "a/b/c/d"):
        o._on_score(b"verifier-0", Score(key, 1.0, True))
    o._on_teacher(b"teacher-0", TeacherLogprobs("nope", np.zeros(1, np.float32)))
    assert o.books.duplicates_dropped == 6 and not g.scores
    o._on_score(b"verifier-0", Score(f"{g.group_id}/1/0", 1.0, True))  # the real key still lands
    assert list(g.scores) == [1]

"""The orchestrator's rules without sockets or a tokenizer: orchestrator/core.py driven by messages and a fake
clock, the ledger it writes, and the pure rules of groups and batches. (The event loop over real sockets is
exercised by tests/test_launch.py.)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from cascade_rl.data.rows import Row
from cascade_rl.orchestrator import groups
from cascade_rl.orchestrator.batch import build_batch
from cascade_rl.orchestrator.core import Core
from cascade_rl.orchestrator.ledger import Ledger
from cascade_rl.orchestrator.rules import Rules
from cascade_rl.protocol import records
from cascade_rl.protocol.messages import (
    GroupScoreRequest,
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    StepDone,
    TeacherLogprobs,
    TeacherRequest,
    WeightsReady,
    WorkKey,
)
from cascade_rl.protocol.rows import offsets, pad
from cascade_rl.protocol.sockets import UNREACHABLE

ROW = Row("r0", ({"role": "user", "content": "1+1?"},), "math", "2", {})
PROMPT = np.array([3, 4, 5], np.int32)
S0, V0, T0 = b"sampler-0", b"verifier-0", b"teacher-0"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def make(clock, tmp_path=None, resume_step: int = 0, **options) -> Core:
    ledger = Ledger(tmp_path / "ledger.jsonl" if tmp_path else None, resume_step)
    core = Core(Rules(**options), decode=lambda ids: " ".join(map(str, ids)), ledger=ledger, clock=clock)
    return core


def join(core: Core, ident: bytes, role: str, slots: int = 64, domains=("math",), version: int = 0) -> None:
    core.receive(ident, Ready(ident.decode(), role, slots, version, list(domains)))


def sent(core: Core, kind: type | None = None) -> list[tuple[bytes, object]]:
    core.dispatch()
    return [(i, m) for i, m in core.take_outbox() if kind is None or isinstance(m, kind)]


def rollout(req: PromptRequest, index: int, n_tokens: int = 3, version: int = 0, finish: str = "stop",
            attempt: int | None = None) -> Rollout:
    key = req.key.answer(index)
    if attempt is not None:
        key = dataclasses.replace(key, attempt=attempt)
    return Rollout(key, req.domain, req.prompt_ids, np.arange(5, 5 + n_tokens, dtype=np.int32),
                   np.full(n_tokens, -0.5, np.float32), finish, version, "sampler-0", 0.0)


def sample_and_score(core: Core, rewards: list[float], finish: list[str] | None = None, step: int = 0):
    """One training group through a sampler and a verifier; returns it."""
    g = core.add_group(ROW, PROMPT, len(rewards), SamplingParams(), train=True, step=step)
    (ident, req), = sent(core, PromptRequest)
    for i in range(len(rewards)):
        core.receive(ident, rollout(req, i, version=step, finish=(finish or ["stop"] * len(rewards))[i]))
    for v, score in sent(core, ScoreRequest):
        i = score.key.index
        core.receive(v, Score(score.key, rewards[i], True))
    assert g.complete
    return g


def ledger_lines(tmp_path: Path) -> list[dict]:
    """The ledger's fate lines (a group's dispatch is an event line of its own)."""
    return [r for r in records.read(tmp_path / "ledger.jsonl") if "fate" in r]


# --------------------------------------------------------------------------- pure rules


def test_overlong_penalty_dynamic_filtering_and_masking(clock):
    core = make(clock)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = sample_and_score(core, [1.0, 1.0, 0.0, 1.0], ["stop", "length", "stop", "length"])
    assert groups.rewards(g, overlong_penalty=False).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert groups.rewards(g, overlong_penalty=True).tolist() == [1.0, 0.0, 0.0, 0.0]
    uniform = sample_and_score(core, [1.0] * 4)
    assert groups.filter_reason(uniform, dynamic_filtering=True, overlong_penalty=False) == "uniform_rewards"
    assert groups.filter_reason(uniform, dynamic_filtering=False, overlong_penalty=False) == ""
    # equal only after the overlong penalty: filtered too (what is trained on is what counts)
    cut = sample_and_score(core, [0.0, 1.0, 0.0, 0.0], ["stop", "length", "stop", "stop"])
    assert groups.filter_reason(cut, dynamic_filtering=True, overlong_penalty=True) == "uniform_rewards"
    assert groups.filter_reason(cut, dynamic_filtering=True, overlong_penalty=False) == ""
    low = sample_and_score(core, [0.4, 0.9], ["stop", "length"])  # nothing above 0.5 once the cut one scores 0
    assert groups.masked(low, 0.5, overlong_penalty=True) and not groups.masked(low, 0.5, overlong_penalty=False)
    assert not groups.masked(low, None, overlong_penalty=True)


def test_settle_writes_each_fate_with_its_reason_and_the_batch_carries_ids_masks_and_cursor(clock, tmp_path):
    core = make(clock, tmp_path, dynamic_filtering=True, mask_threshold=0.5)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    low, high, flat = (sample_and_score(core, r) for r in ([0.5, 0.2, 0.0, 0.5], [0.6, 0.2, 0.0, 0.5], [1.0] * 4))
    kept = core.settle([low, high, flat])
    assert kept == [low, high] and low.masked and not high.masked and not core.groups
    batch = build_batch(0, kept, 4, mopd=False, overlong_penalty=False, cursor={"examples_drawn": 40})
    core.trained(kept)
    assert batch.loss_masked.tolist() == [True] * 4 + [False] * 4
    assert pad(batch.response_mask, batch.lengths)[:4].any()  # the tokens stay (log-prob mismatch is still measured on them)
    assert batch.cursor == {"examples_drawn": 40} and batch.validate() == ""
    assert batch.ids == [f"{low.group_id}/{i}" for i in range(4)] + [f"{high.group_id}/{i}" for i in range(4)]
    lines = ledger_lines(tmp_path)
    fates = {(r["id"], r["fate"], r["reason"]) for r in lines}
    assert {(f"{flat.group_id}/{i}", "filtered", "uniform_rewards") for i in range(4)} <= fates
    assert {(f"{low.group_id}/{i}", "trained", "masked") for i in range(4)} <= fates
    assert {(f"{high.group_id}/{i}", "trained", "") for i in range(4)} <= fates
    assert all(r["step"] == 0 and r["version"] == 0 and r["attempt"] == 0 for r in lines)
    books = core.books()
    assert (books["dispatched"], books["trained"], books["filtered"], books["lost"]) == (12, 8, 4, 0)
    assert books["filtered_reasons"] == {"uniform_rewards": 4}


def test_a_stale_group_is_not_trained(clock, tmp_path):
    core = make(clock, tmp_path, max_staleness=1)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=3)  # trained at version 3
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, rollout(req, 0, version=2))
    core.receive(ident, rollout(req, 1, version=1))  # two versions behind: stale under k = 1
    for v, s in sent(core, ScoreRequest):
        core.receive(v, Score(s.key, 1.0, True))
    assert core.settle([g]) == []
    assert {(r["fate"], r["reason"], r["version"]) for r in ledger_lines(tmp_path)} == {
        ("stale", "2 versions behind step 3", 2), ("stale", "2 versions behind step 3", 1)}


# --------------------------------------------------------------------------- credits and dispatch


def test_credits_bound_what_each_sampler_and_the_run_hold(clock):
    core = make(clock, max_inflight_groups=3)
    join(core, S0, "sampler", slots=8)
    join(core, b"sampler-1", "sampler", slots=8)
    for _ in range(5):
        core.add_group(ROW, PROMPT, 4, SamplingParams(), train=True, step=0)
    out = sent(core, PromptRequest)
    assert len(out) == 3 and len(core.prompt_queue) == 2  # max_inflight_groups
    assert sorted(i for i, _ in out) == [S0, S0, b"sampler-1"]  # least loaded first, within 8 slots each
    assert all(core.pool.get(i).load <= 8 for i in (S0, b"sampler-1"))
    # a draining worker gets nothing new; what it holds still counts
    core.receive(S0, Ready("sampler-0", "sampler", 0, draining=True))
    ident, req = out[-1] if out[-1][0] == b"sampler-1" else next(x for x in out if x[0] == b"sampler-1")
    for i in range(4):
        core.receive(ident, rollout(req, i))
    assert [i for i, _ in sent(core, PromptRequest)] == [b"sampler-1"]


def test_a_late_joiner_gets_the_newest_weights_before_its_first_group(clock):
    core = make(clock)
    core.receive(b"trainer-0", WeightsReady(2, "file:///w2"))
    core.receive(b"trainer-0", StepDone(step=1, version=2))
    join(core, S0, "sampler", version=0)
    core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=2)
    out = sent(core)
    assert [type(m).__name__ for _, m in out] == ["WeightsReady", "PromptRequest"]
    assert out[1][1].min_version == 2 and core.pool.get(S0).version == 2


def test_a_group_domain_is_scored_as_one_request_when_the_group_is_complete(clock):
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    import hostile_verifiers  # noqa: F401  (registers the group verifier test_group_len)

    core = make(clock)
    join(core, S0, "sampler")
    join(core, V0, "verifier", domains=["test_group_len"])
    row = Row("r", ({"role": "user", "content": "q"},), "test_group_len", "a", {})
    g = core.add_group(row, PROMPT, 4, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    for i in range(3):  # not complete: nothing is queued yet
        core.receive(ident, rollout(req, i))
    assert not sent(core, GroupScoreRequest)
    core.receive(ident, rollout(req, 3))
    (v, greq), = sent(core)  # one request for the whole group
    assert isinstance(greq, GroupScoreRequest) and v == V0
    assert greq.keys == [WorkKey.score(g.group_id, i, 0) for i in range(4)] and greq.texts[0] == "5 6 7"
    assert greq.domain == "test_group_len" and greq.prompt == "q"
    assert set(core.pool.get(V0).held) == set(greq.keys)



def test_an_evaluation_group_of_a_group_domain_is_scored_one_response_at_a_time(clock):
    """Held out, a group domain's rewards are each response's against the row's baseline (EVAL_VERIFIERS), since
    group-relative rewards average the same in every group."""
    core = make(clock)
    join(core, S0, "sampler")
    join(core, V0, "verifier", domains=["genrm"])
    row = Row("r", ({"role": "user", "content": "q"},), "genrm", "a baseline reply", {})
    g = core.add_group(row, PROMPT, 2, SamplingParams(), train=False)
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, rollout(req, 0))
    core.receive(ident, rollout(req, 1))
    out = sent(core)
    assert [type(m) for _, m in out] == [ScoreRequest, ScoreRequest] and not g.train
    assert [str(m.key) for _, m in out] == [f"{g.group_id}/0/0", f"{g.group_id}/1/0"]
    assert out[0][1].reference == "a baseline reply" and out[0][1].metadata["question"] == "q"


def test_an_unavailable_verifier_fails_the_group_with_its_reason(clock, tmp_path):
    core = make(clock, tmp_path)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, rollout(req, 0))
    core.receive(ident, rollout(req, 1))
    (_, s0), (_, s1) = sent(core, ScoreRequest)
    core.receive(V0, Score(s0.key, 1.0, True))
    core.receive(V0, Score(s1.key, 0.0, False, "JudgeError: refused", unavailable=True))
    assert g.complete and g.error == "verifier_unavailable: JudgeError: refused"
    assert core.settle([g]) == []  # not trained on a reward of 0: filtered with the reason
    assert core.ledger.reasons == {"verifier_unavailable: JudgeError: refused": 2}


def test_the_model_context_bounds_what_a_turn_may_sample(clock):
    core = make(clock, context=10)
    join(core, S0, "sampler")
    long_prompt = np.arange(3, 10, dtype=np.int32)  # 7 of the 10 tokens: room for 3
    core.add_group(ROW, long_prompt, 1, SamplingParams(max_tokens=8), train=True, step=0)
    core.add_group(ROW, PROMPT, 1, SamplingParams(max_tokens=5), train=True, step=0)
    (_, long_req), (_, short_req) = sent(core, PromptRequest)
    assert long_req.sampling.max_tokens == 3 and short_req.sampling.max_tokens == 5


# --------------------------------------------------------------------------- deadlines, faults, duplicates


def test_a_sampler_past_its_deadline_loses_the_group_and_its_late_rollouts_are_duplicates(clock, tmp_path):
    core = make(clock, tmp_path, sampler_timeout_s=10)
    join(core, S0, "sampler")
    join(core, b"sampler-1", "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
    (first, req0), = sent(core, PromptRequest)
    core.receive(first, rollout(req0, 0))
    clock.now = 11
    core.expire()
    assert g.attempt == 1 and not g.rollouts
    (second, req1), = sent(core, PromptRequest)
    assert req1.key == WorkKey.sample(g.group_id, 1) and str(req1.key) == f"{g.group_id}/0:sample/1"
    core.receive(first, rollout(req0, 1))  # the first sampler's late reply: dropped, in the ledger
    for i in range(2):
        core.receive(second, rollout(req1, i))
    for v, s in sent(core, ScoreRequest):
        core.receive(v, Score(s.key, 1.0, True))
    core.receive(V0, Score(WorkKey.score(g.group_id, 0, 0), 1.0, True))  # a score of the superseded attempt
    core.trained(core.settle([g]))
    lines = ledger_lines(tmp_path)
    assert [(r["id"], r["attempt"], r["fate"]) for r in lines] == [
        (f"{g.group_id}/1", 0, "duplicate"), (f"{g.group_id}/0", 0, "duplicate"),
        (f"{g.group_id}/0", 1, "trained"), (f"{g.group_id}/1", 1, "trained")]
    books = core.books()
    assert (books["trained"], books["redispatched"], books["duplicates_dropped"], books["lost"]) == (2, 2, 2, 0)


def test_a_restarted_or_unreachable_worker_has_its_work_sent_again(clock):
    core = make(clock)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    join(core, b"verifier-1", "verifier")
    core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
    sent(core, PromptRequest)
    join(core, S0, "sampler")  # sampler-0 restarted (Ready again under its id): the group goes out again
    (again, req1), = sent(core, PromptRequest)
    assert again == S0 and req1.key.attempt == 1
    core.receive(S0, rollout(req1, 0))
    (v, s), = sent(core, ScoreRequest)
    core.receive(v, UNREACHABLE)  # that verifier is gone: its score request goes to the other one
    (v2, s2), = sent(core, ScoreRequest)
    assert v2 != v and s2.key == s.key and core.pool.get(v) is None


def test_a_missed_score_deadline_asks_again_and_a_late_first_answer_still_counts_once(clock, tmp_path):
    core = make(clock, tmp_path, verifier_timeout_s=5)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 1, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, rollout(req, 0))
    (_, s), = sent(core, ScoreRequest)
    clock.now = 6
    core.expire()
    (_, again), = sent(core, ScoreRequest)
    assert again.key == s.key and not g.complete
    core.receive(V0, Score(s.key, 1.0, True))
    core.receive(V0, Score(s.key, 1.0, True))  # the second answer of the same key: a duplicate
    assert g.complete and core.books()["duplicates_dropped"] == 1 and not core.pool.get(V0).held


def test_replies_with_keys_never_sent_are_dropped_not_fatal(clock):
    core = make(clock)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    for i in range(2):
        core.receive(ident, rollout(req, i))
    sent(core)
    # (malformed keys never get this far: the codec refuses them, tests/test_protocol.py)
    for key in (WorkKey.score("garbage", 0, 0), WorkKey.teacher(g.group_id, 0), WorkKey.score(g.group_id, 0, 7),
                WorkKey.step(g.group_id, 0, "env", 1, 0), WorkKey.score("a/b/c", 0, 0), WorkKey.score(g.group_id, 9, 0)):
        core.receive(V0, Score(key, 1.0, True))
    core.receive(T0, TeacherLogprobs(WorkKey.teacher("nope", 0), np.zeros(1, np.float32)))
    assert not g.scores and core.books()["duplicates_dropped"] + core.stray_replies == 7
    core.receive(V0, Score(WorkKey.score(g.group_id, 1, 0), 1.0, True))  # the real key still lands
    assert list(g.scores) == [1]


def test_mopd_sends_each_group_to_its_teacher_and_trains_on_the_replies(clock):
    core = make(clock, mopd=True, teacher_timeout_s=5)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    join(core, T0, "teacher", slots=8)
    g = core.add_group(ROW, PROMPT, 4, SamplingParams(temperature=0.7), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    for i, n in enumerate([3, 1, 2, 4]):
        core.receive(ident, rollout(req, i, n_tokens=n))
    out = sent(core)
    for v, s in out:
        if isinstance(s, ScoreRequest):
            core.receive(v, Score(s.key, 0.0, True))
    (t, treq), = [(i, m) for i, m in out if isinstance(m, TeacherRequest)]
    assert g.needs_teacher and not g.complete  # scored, but no teacher log-probs yet
    assert treq.key == WorkKey.teacher(g.group_id, 0) and treq.domain == "math" and treq.temperature == 0.7
    assert treq.response_lens.tolist() == [3, 1, 2, 4] and len(treq.response_ids) == 10 and treq.validate() == ""
    clock.now = 6  # past its deadline: asked again
    core.expire()
    (_, again), = sent(core, TeacherRequest)
    assert again.key == treq.key
    logprobs = -np.arange(1, 11, dtype=np.float32) / 10
    core.receive(T0, TeacherLogprobs(treq.key, logprobs))
    assert g.complete and not core.pool.get(T0).held
    batch = build_batch(0, core.settle([g]), 4, mopd=True, overlong_penalty=False, cursor={})
    p, teacher = len(PROMPT), pad(batch.teacher_logprobs, batch.lengths)
    assert teacher[0, p:p + 3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert teacher[3, p:p + 4].tolist() == pytest.approx([-0.7, -0.8, -0.9, -1.0])
    assert batch.teacher_logprobs[~batch.response_mask].max() == 0.0 and batch.validate() == ""


def test_a_teacher_error_or_a_wrong_length_filters_the_group_with_its_reason(clock):
    core = make(clock, mopd=True)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    join(core, T0, "teacher")
    for reply, reason in ((TeacherLogprobs(WorkKey.teacher("?", 0), np.zeros(0, np.float32), ok=False, error="token id 999 outside"),
                           "teacher_error: token id 999 outside"),
                          (TeacherLogprobs(WorkKey.teacher("?", 0), np.zeros(3, np.float32)), "teacher_error: 3 log-probs for 6 tokens")):
        g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
        (ident, req), = sent(core, PromptRequest)
        for i in range(2):
            core.receive(ident, rollout(req, i))
        (_, treq), = sent(core, TeacherRequest)
        reply.key = treq.key
        core.receive(T0, reply)
        assert g.complete and groups.filter_reason(g, False, False) == reason


def test_a_sampler_error_fails_its_group_with_the_reason(clock):
    core = make(clock)
    join(core, S0, "sampler")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, Rollout(req.key, "math", PROMPT, np.zeros(0, np.int32), np.zeros(0, np.float32), "error", 0,
                                "sampler-0", 0.0, "prompt longer than the context"))
    assert g.complete and g.error == "sampler_error: prompt longer than the context" and not core.pool.get(S0).held


def test_books_count_ids_and_a_resumed_ledger_rolls_back_the_steps_from_its_checkpoint(clock, tmp_path):
    """A ledger read back at step 2 (a restart from that checkpoint): the ids of steps 0 and 1 keep their fates, those
    of steps 2 and on (trained in weights thrown away) and every one in flight are settled ``rolled_back``, once; new
    groups of step 2 get new ids; the books count the whole run."""
    core = make(clock, tmp_path)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    for step in range(3):
        core.trained(core.settle([sample_and_score(core, [0.0, 1.0], step=step)]))
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=3)  # in flight
    books = core.books()
    assert (books["dispatched"], books["trained"], books["in_flight"], books["lost"]) == (8, 6, 2, 0)
    core.forget([g])  # dropped without a fate: lost, by id
    assert core.books()["lost"] == 2 and core.books()["lost_ids"] == [f"{g.group_id}/0", f"{g.group_id}/1"]
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=3)  # in flight when the orchestrator died
    core.ledger.close()
    dispatches = [r for r in records.read(tmp_path / "ledger.jsonl") if r.get("event") == "dispatched"]
    assert [(r["step"], r["n"]) for r in dispatches] == [(0, 2), (1, 2), (2, 2), (3, 2), (3, 2)]
    again = make(clock, tmp_path, resume_step=2)  # restarted from the checkpoint of step 2
    fates = {}
    for r in ledger_lines(tmp_path):
        fates.setdefault(r["id"], []).append((r["step"], r["fate"]))
    assert sorted(f for f in fates.values() if f[-1][1] == "rolled_back") == [
        [(2, "trained"), (2, "rolled_back")], [(2, "trained"), (2, "rolled_back")],
        [(3, "rolled_back")], [(3, "rolled_back")], [(3, "rolled_back")], [(3, "rolled_back")]]
    assert sum(f == [(s, "trained")] for f in fates.values() for s in (0, 1)) == 4
    books = again.books()
    assert (books["dispatched"], books["trained"], books["rolled_back"], books["lost"]) == (10, 4, 6, 0)
    new = again.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=2)
    assert new.group_id not in {rid.split("/")[0] for rid in fates}  # drawn again, under a new id
    make(clock, tmp_path, resume_step=2).ledger.close()  # read back again: nothing settled twice
    assert sum(r["fate"] == "rolled_back" for r in ledger_lines(tmp_path)) == 6 + 2


def test_routes_and_token_versions_travel_through_the_core_into_the_batch_and_the_ledger(clock, tmp_path):
    """R3 and in-flight updates: each rollout's routes (the experts of every token the engine ran) land in the
    TrainBatch under that row's tokens (-1 elsewhere); a rollout whose tokens span versions is trained with its
    oldest version, the ledger writes its newest, and ``version_span`` counts it."""
    core = make(clock, tmp_path, max_staleness=1)
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 2, SamplingParams(), train=True, step=1)
    (ident, req), = sent(core, PromptRequest)
    rng = np.random.default_rng(0)
    routes = {}
    for i, n in enumerate((3, 5)):
        r = rollout(req, i, n_tokens=n)
        routes[i] = rng.integers(0, 8, size=(len(PROMPT) + n - 1, 2, 2)).astype(np.int16)  # 2 MoE layers, top-2
        r.routes = routes[i]
        if i == 1:  # new weights arrived after its third token
            r.token_versions = np.array([0, 0, 0, 1, 1], np.int32)
        assert r.validate() == ""
        core.receive(ident, r)
    for v, score in sent(core, ScoreRequest):
        core.receive(v, Score(score.key, float(score.key.attempt == 0), True))
    kept = core.settle([g])
    batch = build_batch(1, kept, 2, mopd=False, overlong_penalty=False, cursor={})
    core.trained(kept)
    assert batch.validate() == "" and batch.routes.shape == (int(batch.lengths.sum()), 2, 2)  # packed rows
    for i, row in enumerate(np.split(batch.routes, offsets(batch.lengths)[1:-1])):
        ran = len(routes[i])
        np.testing.assert_array_equal(row[:ran], routes[i])
        assert (row[ran:] == -1).all()
    assert batch.versions.tolist() == [0, 0]  # each row's oldest token
    lines = {r["id"]: r for r in ledger_lines(tmp_path) if r["fate"] == "trained"}
    assert "version_max" not in lines[f"{g.group_id}/0"] and lines[f"{g.group_id}/1"]["version_max"] == 1
    assert core.ledger.version_span() == {"trained": 2, "spanning": 1, "max": 1, "mean": 0.5}


def test_the_main_loop_drives_the_core_through_its_methods_and_every_message_leaves_by_the_outbox(clock):
    """What orchestrator/main.py needs: a resumed version, the trainer's batch sent through the outbox (its groups
    settle as trained), a StepDone taken once, evaluation groups forgotten."""
    core = Core(Rules(), decode=lambda ids: "", ledger=Ledger(None), clock=clock, version=5)
    join(core, b"trainer-0", "trainer")
    join(core, S0, "sampler")
    join(core, V0, "verifier")
    e = core.add_group(ROW, PROMPT, 1, SamplingParams(), train=False)  # an evaluation group
    (ident, req), = sent(core, PromptRequest)
    assert req.min_version == 5 and req.key.kind == "sample"  # new groups sample on the resumed version or newer
    core.receive(ident, rollout(req, 0, version=5))
    (v, s), = sent(core, ScoreRequest)
    core.receive(v, Score(s.key, 1.0, True))
    g = sample_and_score(core, [0.0, 1.0], step=5)
    kept = core.settle([g])
    batch = build_batch(5, kept, 2, False, False, {})
    core.to_trainer([batch], kept)
    assert core.take_outbox() == [(b"trainer-0", batch)] and core.books()["trained"] == 2
    core.receive(b"trainer-0", StepDone(5, 6))
    assert core.version == 6 and core.take_step(5).version == 6 and not core.steps_done
    assert e.complete and e.group_id in core.groups
    core.forget([e])
    assert not core.groups and core.books()["lost"] == 0

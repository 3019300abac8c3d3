"""The verifier worker's process pool: failing verifiers give ok=False with a reason and never take the worker
down; deadlines are enforced by killing the scoring process; scoring runs in parallel."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from cascade_rl.protocol.messages import ScoreRequest, WorkKey
from cascade_rl.verifiers.worker import Pool, parse_impls

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # spawned pool processes inherit sys.path
PLUGINS = ["hostile_verifiers"]


@pytest.fixture
def pool():
    p = Pool(2, {}, PLUGINS)
    yield p
    p.close()


def run(pool: Pool, reqs: list[ScoreRequest], limit_s: float = 20.0) -> dict[str, object]:
    pending, out = list(reqs), {}
    t_end = time.monotonic() + limit_s
    while len(out) < len(reqs) and time.monotonic() < t_end:
        while pending and pool.room:
            pool.submit(pending.pop(0))
        for s in pool.collect(0.02):
            out[s.key.group] = s
    return out


def req(name: str, domain: str, text: str = r"\boxed{4}", reference: str = "4", deadline_s: float = 30.0, **meta):
    """A request keyed as the score of group ``name``'s row 0 (``run`` maps replies by that name). The default
    deadline leaves room for a replacement process's start behind a hang (seconds on a loaded machine)."""
    return ScoreRequest(WorkKey.score(name, 0, 0), domain, text, reference, meta, deadline_s)


def test_a_hanging_verifier_is_killed_at_its_deadline_and_the_pool_goes_on(pool):
    t0 = time.monotonic()
    out = run(pool, [req("h", "test_hang", deadline_s=1.0), req("m", "math")])
    assert not out["h"].ok and out["h"].reward == 0.0 and "timeout" in out["h"].reason
    assert time.monotonic() - t0 < 1.0 + 10  # killed at its deadline (the verifier never returns by itself); the
    # margin is for a loaded machine: how soon after the deadline is a benchmark's question, not this test's
    assert out["m"].ok and out["m"].reward == 1.0
    assert run(pool, [req("again", "math")])["again"].reward == 1.0  # the replaced process serves


def test_requests_queued_behind_a_hanging_one_go_to_its_replacement(pool):
    """Both processes are fed several requests ahead; the ones behind a hang are neither lost nor failed."""
    reqs = [req("h", "test_hang", deadline_s=1.0)] + [req(f"m{i}", "math") for i in range(9)]
    out = run(pool, reqs)
    assert len(out) == 10 and not out["h"].ok and "timeout" in out["h"].reason
    assert all(out[f"m{i}"].ok and out[f"m{i}"].reward == 1.0 for i in range(9)), [out[f"m{i}"] for i in range(9)]


def test_a_full_pool_refuses_more_than_its_room():
    p = Pool(1, {}, PLUGINS, depth=2)
    try:
        p.submit(req("a", "math"))
        p.submit(req("b", "math"))
        assert p.room == 0
        with pytest.raises(RuntimeError, match="full"):
            p.submit(req("c", "math"))
    finally:
        p.close()


def test_a_verifier_that_kills_its_process_or_raises_scores_zero_with_the_reason(pool):
    out = run(pool, [req("d", "test_die"), req("r", "test_raise"), req("u", "no_such_domain"), req("m", "math")])
    assert not out["d"].ok and "died" in out["d"].reason and "exit code 3" in out["d"].reason
    assert not out["r"].ok and "RuntimeError: verifier bug" in out["r"].reason
    assert not out["u"].ok and "no verifier" in out["u"].reason
    assert out["m"].ok and out["m"].reward == 1.0


def test_scoring_runs_in_parallel(pool):
    t0 = time.monotonic()
    out = run(pool, [req(str(i), "test_slow_ok", sleep=2.0) for i in range(4)])
    assert all(s.ok for s in out.values()) and len(out) == 4
    # 2 processes: about half the serial 8 s (sleeps, so a loaded machine slows only the hand-offs)
    assert time.monotonic() - t0 < 4 * 2.0 * 0.8


def test_impl_overrides_parse_and_refuse_garbage():
    assert parse_impls(["math=math", "code=code_v2"]) == {"math": "math", "code": "code_v2"}
    with pytest.raises(SystemExit, match="DOMAIN=NAME"):
        parse_impls(["math"])


def test_group_requests_get_one_score_per_response(pool):
    from cascade_rl.protocol.messages import GroupScoreRequest

    good = GroupScoreRequest([WorkKey.score("g", i, 0) for i in range(3)], "test_group_len", "p", ["aa", "a", "aaa"])
    bad = GroupScoreRequest([WorkKey.score("b", i, 0) for i in range(2)], "test_group_short", "p", ["x", "y"])
    out = {}
    pool.submit(good)
    pool.submit(bad)
    t_end = time.monotonic() + 20
    while len(out) < 5 and time.monotonic() < t_end:
        for s in pool.collect(0.02):
            out[s.key] = s
    assert [out[k].reward for k in good.keys] == [0.5, 0.0, 1.0] and all(out[k].ok for k in good.keys)
    assert all(not out[k].ok and "1 rewards for 2 responses" in out[k].reason for k in bad.keys)

"""Offline scoring (orchestrator/offline.py ``Scorer``): each distinct response scored once, side by side, judged
domains as many at a time as the judge takes, and a verifier that could not score (VerifierUnavailable) asked
again rather than remembered."""

from __future__ import annotations

import threading
import time

from cascade_rl.orchestrator import offline
from cascade_rl.orchestrator.offline import Scorer
from cascade_rl.protocol.messages import ScoreRequest, WorkKey
from cascade_rl.verifiers import registry
from cascade_rl.verifiers.errors import VerifierUnavailable
from cascade_rl.verifiers.registry import register_verifier

CALLS: list[str] = []
LOCK = threading.Lock()
DOWN = {"judge": True}


@register_verifier("test_offline_len")
def _length(response: str, reference: str, metadata: dict) -> float:
    with LOCK:
        CALLS.append(response)
    return float(len(response) == int(reference))


@register_verifier("test_offline_down")
def _down(response: str, reference: str, metadata: dict) -> float:
    with LOCK:
        CALLS.append(response)
    if DOWN["judge"]:
        raise VerifierUnavailable("judge down")
    return 1.0


JUDGING = {"now": 0, "peak": 0}  # judged calls in flight


@register_verifier("test_offline_judged")
def _judged(response: str, reference: str, metadata: dict) -> float:
    with LOCK:
        JUDGING["now"] += 1
        JUDGING["peak"] = max(JUDGING["peak"], JUDGING["now"])
    time.sleep(0.05)  # waiting on the judge's reply, as a judged verifier does
    with LOCK:
        JUDGING["now"] -= 1
    return 1.0



def req(group: str, index: int, text: str, domain: str = "test_offline_len", reference: str = "3") -> ScoreRequest:
    return ScoreRequest(WorkKey.score(group, index, 0), domain, text, reference, {"question": "q"}, 5.0)


def test_each_distinct_response_is_scored_once_and_keys_are_kept():
    CALLS.clear()
    scorer = Scorer(workers=3)
    out = scorer.score([req("g", 0, "abc"), req("g", 1, "abc"), req("g", 2, "abcd"), req("g", 3, "abc")])
    assert [str(s.key) for s in out] == ["g/0/0", "g/1/0", "g/2/0", "g/3/0"]
    assert [s.reward for s in out] == [1.0, 1.0, 0.0, 1.0] and all(s.ok for s in out)
    assert sorted(CALLS) == ["abc", "abcd"] and scorer.calls == 2
    # another round (a later evaluation's group): remembered; another reference is another question
    again = scorer.score([req("h", 0, "abc"), req("h", 1, "abc", reference="4")])
    assert [s.reward for s in again] == [1.0, 0.0] and sorted(CALLS) == ["abc", "abc", "abcd"]
    scorer.close()


def test_an_unavailable_verifier_is_not_remembered():
    CALLS.clear()
    scorer = Scorer(workers=2)
    first = scorer.score([req("g", 0, "x", "test_offline_down")])
    assert first[0].unavailable and not first[0].ok and "judge down" in first[0].reason
    DOWN["judge"] = False
    second = scorer.score([req("g", 1, "x", "test_offline_down")])
    assert second[0].ok and second[0].reward == 1.0 and CALLS == ["x", "x"]
    scorer.close()


def test_judged_domains_are_scored_as_many_at_a_time_as_the_judge_takes(monkeypatch):
    # as a plugin whose verifier calls the judge registers its domain; for this test only (other modules
    # parametrize over JUDGED_DOMAINS)
    monkeypatch.setattr(registry, "JUDGED_DOMAINS", registry.JUDGED_DOMAINS | {"test_offline_judged"})
    monkeypatch.setattr(offline, "JUDGED_DOMAINS", registry.JUDGED_DOMAINS)
    JUDGING["peak"] = 0
    scorer = Scorer(workers=2, judge_workers=12)
    judged = [req("j", i, f"reply {i}", "test_offline_judged") for i in range(24)]
    out = scorer.score(judged + [req("g", i, "x" * i) for i in range(6)])
    assert [s.key for s in out] == [m.key for m in judged] + [WorkKey.score("g", i, 0) for i in range(6)]
    assert [s.reward for s in out] == [1.0] * 24 + [float(i == 3) for i in range(6)]
    assert JUDGING["peak"] == 12  # the judge's width, not the other verifiers'
    scorer.close()

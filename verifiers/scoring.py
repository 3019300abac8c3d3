"""Scoring one request, or a group's, in this process: what the verifier worker's pool runs in each child
process, and what offline evaluation (orchestrator/offline.py) calls directly. Never raises: a failing
verifier scores 0 with the reason, one that raises ``VerifierUnavailable`` says ``unavailable``."""

from __future__ import annotations

import time

from cascade_rl.protocol.messages import GroupScoreRequest, Score, ScoreRequest

from .errors import VerifierUnavailable
from .registry import EVAL_VERIFIERS, GROUP_VERIFIERS, VERIFIERS


def score_one(req: ScoreRequest, impls: dict[str, str] | None = None) -> Score:
    """Score one request in this process; never raises."""
    t0 = time.perf_counter()
    name = (impls or {}).get(req.domain, req.domain)
    fn = VERIFIERS.get(name) or EVAL_VERIFIERS.get(name)  # the held-out verifier of a group domain (evaluation)
    if fn is None:
        return Score(req.key, 0.0, False, f"no verifier for domain {req.domain!r}", 0.0)
    try:
        reward = float(fn(req.text, req.reference, req.metadata))
        return Score(req.key, reward, True, "", time.perf_counter() - t0)
    except VerifierUnavailable as e:  # not the response's fault: its group fails with the reason (errors.py)
        return Score(req.key, 0.0, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0, unavailable=True)
    except Exception as e:  # a failing verifier scores 0 with the reason; the rollout is not lost
        return Score(req.key, 0.0, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)


def score_group(req: GroupScoreRequest, impls: dict[str, str] | None = None) -> list[Score]:
    """Score a group's responses together in this process (one Score per key); never raises."""
    t0 = time.perf_counter()
    fn = GROUP_VERIFIERS.get((impls or {}).get(req.domain, req.domain))

    def failed(reason: str, unavailable: bool = False) -> list[Score]:
        return [Score(k, 0.0, False, reason, time.perf_counter() - t0, unavailable=unavailable) for k in req.keys]

    if fn is None:
        return failed(f"no group verifier for domain {req.domain!r}")
    try:
        rewards = [float(r) for r in fn(req.prompt, list(req.texts), req.reference, req.metadata)]
    except VerifierUnavailable as e:
        return failed(f"{type(e).__name__}: {e}", unavailable=True)
    except Exception as e:
        return failed(f"{type(e).__name__}: {e}")
    if len(rewards) != len(req.keys):
        return failed(f"group verifier returned {len(rewards)} rewards for {len(req.keys)} responses")
    return [Score(k, r, True, "", time.perf_counter() - t0) for k, r in zip(req.keys, rewards)]

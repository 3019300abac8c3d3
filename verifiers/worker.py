"""Verifier worker: ScoreRequests in, Scores out.

    python -m cascade_rl.verifiers.worker --config RUN_DIR/config.yaml --worker-id verifier-0

Serves the domains in ``workers.verifier_domains``. A verifier that raises
or gets a domain it does not serve yields ``Score(ok=False, reward=0)`` with
the reason; the worker never dies from it.
"""

from __future__ import annotations

import logging
import time

from cascade_rl.protocol.messages import Ready, Score, ScoreRequest
from cascade_rl.protocol.sockets import WorkerLink
from cascade_rl.protocol.worker_main import worker_start

from .registry import VERIFIERS

log = logging.getLogger("verifier")


def score_one(req: ScoreRequest) -> Score:
    t0 = time.perf_counter()
    fn = VERIFIERS.get(req.domain)
    if fn is None:
        return Score(req.key, 0.0, False, f"no verifier for domain {req.domain!r}", 0.0)
    try:
        reward = float(fn(req.text, req.reference, req.metadata))
        return Score(req.key, reward, True, "", time.perf_counter() - t0)
    except Exception as e:  # a failing verifier scores 0 with the reason; the rollout is not lost
        return Score(req.key, 0.0, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    args, cfg = worker_start(__doc__.splitlines()[0], argv)
    domains = list(cfg.workers.verifier_domains)
    unknown = [d for d in domains if d not in VERIFIERS]
    if unknown:
        raise SystemExit(f"no verifier registered for domains {unknown}; known: {sorted(VERIFIERS)}")
    counters = {"scored": 0, "failed": 0, "verify_s": 0.0}
    ep = cfg.endpoints
    link = WorkerLink(args.worker_id, "verifier", ep.orchestrator, ep.get("heartbeat"), None,
                      expect=(ScoreRequest,), status=lambda: {"state": "running", "counters": dict(counters)},
                      heartbeat_s=cfg.supervisor.heartbeat_s).start()
    link.send(Ready(args.worker_id, "verifier", slots=16, domains=domains))
    while True:
        req = link.inbox.get()
        score = score_one(req)
        score.worker_id = args.worker_id
        counters["scored"] += 1
        counters["failed"] += int(not score.ok)
        counters["verify_s"] += score.t_verify
        link.send(score)


if __name__ == "__main__":
    main()

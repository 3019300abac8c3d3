"""Verifier worker: ScoreRequests in, Scores out, scored concurrently by a pool of processes.

    python -m cascade_rl.verifiers.worker --config RUN_DIR/config.yaml --worker-id verifier-0 [--impl math=math]

Serves the domains in ``workers.verifier_domains``; each domain is scored by the
verifier registered under the domain's name, or the one named by ``--impl
DOMAIN=NAME`` (what ``cascade-rl ctl swap verifier`` starts). Scoring runs in
``workers.verifier_procs`` child processes, so CPU-bound checks use the cores and
a verifier cannot take the worker down with it:

- a verifier that raises, or gets a domain it does not serve, yields
  ``Score(ok=False, reward=0)`` with the reason;
- one that runs past the request's ``deadline_s`` has its process killed and
  replaced, and yields ``ok=False`` with "timeout";
- one whose process dies (a segfault, ``os._exit``, the OOM killer) yields
  ``ok=False`` with the exit code, and the process is replaced.

Group domains (``verifiers.registry.GROUP_VERIFIERS``: pairwise GenRM) get one
``GroupScoreRequest`` per group and answer one ``Score`` per response; the
same deadlines apply. Scoring processes see ``workers.judge`` (endpoint, model,
API-key variable) in ``registry.SETTINGS``.

SIGTERM drains: the worker tells the orchestrator it takes no more work
(``Ready(draining=True)``), scores what it holds, then exits 0. That is how the
supervisor retires the old workers of a swap without losing a score.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import logging
import multiprocessing as mp
import signal
import time
from multiprocessing.connection import Connection, wait

from omegaconf import OmegaConf

from cascade_rl.protocol.messages import GroupScoreRequest, Ready, Score, ScoreRequest
from cascade_rl.protocol.sockets import WorkerLink
from cascade_rl.protocol.worker_main import worker_start

from . import registry
from .registry import GROUP_VERIFIERS, VERIFIERS

log = logging.getLogger("verifier")


def score_one(req: ScoreRequest, impls: dict[str, str] | None = None) -> Score:
    """Score one request in this process; never raises."""
    t0 = time.perf_counter()
    fn = VERIFIERS.get((impls or {}).get(req.domain, req.domain))
    if fn is None:
        return Score(req.key, 0.0, False, f"no verifier for domain {req.domain!r}", 0.0)
    try:
        reward = float(fn(req.text, req.reference, req.metadata))
        return Score(req.key, reward, True, "", time.perf_counter() - t0)
    except Exception as e:  # a failing verifier scores 0 with the reason; the rollout is not lost
        return Score(req.key, 0.0, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)


def score_group(req: GroupScoreRequest, impls: dict[str, str] | None = None) -> list[Score]:
    """Score a group's responses together in this process (one Score per key); never raises."""
    t0 = time.perf_counter()
    fn = GROUP_VERIFIERS.get((impls or {}).get(req.domain, req.domain))

    def failed(reason: str) -> list[Score]:
        return [Score(k, 0.0, False, reason, time.perf_counter() - t0) for k in req.keys]

    if fn is None:
        return failed(f"no group verifier for domain {req.domain!r}")
    try:
        rewards = [float(r) for r in fn(req.prompt, list(req.texts), req.reference, req.metadata)]
    except Exception as e:
        return failed(f"{type(e).__name__}: {e}")
    if len(rewards) != len(req.keys):
        return failed(f"group verifier returned {len(rewards)} rewards for {len(req.keys)} responses")
    return [Score(k, r, True, "", time.perf_counter() - t0) for k, r in zip(req.keys, rewards)]


def load_plugins(modules: list[str]) -> None:
    """Import modules that register more verifiers (``workers.verifier_plugins``)."""
    for name in modules:
        importlib.import_module(name)


def _child(conn: Connection, impls: dict[str, str], plugins: list[str], settings: dict) -> None:
    """A pool process: requests in, scores out, until the pipe closes."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    registry.SETTINGS.update(settings)
    load_plugins(plugins)
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        conn.send(score_group(req, impls) if isinstance(req, GroupScoreRequest) else [score_one(req, impls)])


class Pool:
    """``size`` scoring processes; a request past its deadline gets its process killed and replaced."""

    def __init__(self, size: int, impls: dict[str, str], plugins: list[str] = (), settings: dict | None = None) -> None:
        self.ctx = mp.get_context("spawn")  # a fresh interpreter: no sockets or threads inherited
        self.impls, self.plugins, self.settings = impls, list(plugins), dict(settings or {})
        self.slots: list[dict] = [self._spawn() for _ in range(max(1, size))]

    def _spawn(self) -> dict:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_child, args=(child, self.impls, self.plugins, self.settings),
                                daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "req": None, "deadline": 0.0, "t0": 0.0}

    @property
    def idle(self) -> int:
        return sum(s["req"] is None for s in self.slots)

    @property
    def busy(self) -> int:
        return len(self.slots) - self.idle

    def submit(self, req: ScoreRequest | GroupScoreRequest) -> None:
        slot = next(s for s in self.slots if s["req"] is None)
        slot.update(req=req, t0=time.monotonic(), deadline=time.monotonic() + req.deadline_s)
        slot["conn"].send(req)

    def collect(self, timeout: float) -> list[Score]:
        """Scores finished within ``timeout``, plus failures for deadlines passed and processes lost."""
        busy = {s["conn"]: s for s in self.slots if s["req"] is not None}
        out = []
        for conn in wait(list(busy), timeout) if busy else []:
            slot = busy[conn]
            try:
                out.extend(conn.recv())
                slot["req"] = None
            except (EOFError, OSError):
                slot["proc"].join(timeout=1.0)  # reap it, for the exit code
                out.extend(self._replace(slot, f"verifier process died (exit code {slot['proc'].exitcode})"))
        now = time.monotonic()
        for slot in self.slots:
            if slot["req"] is not None and now > slot["deadline"]:
                out.extend(self._replace(slot, f"timeout: no score within {slot['req'].deadline_s:g} s"))
        if not busy:
            time.sleep(timeout)
        return out

    def _replace(self, slot: dict, reason: str) -> list[Score]:
        req, t0 = slot["req"], slot["t0"]
        slot["proc"].kill()
        slot["proc"].join()
        slot["conn"].close()
        slot.update(self._spawn())
        keys = req.keys if isinstance(req, GroupScoreRequest) else [req.key]
        log.warning("%s: %s", keys[0], reason)
        return [Score(k, 0.0, False, reason, time.monotonic() - t0) for k in keys]

    def close(self) -> None:
        for s in self.slots:
            s["conn"].close()
            s["proc"].kill()
        for s in self.slots:
            s["proc"].join(timeout=5)  # reap: no zombies left behind


def parse_impls(pairs: list[str]) -> dict[str, str]:
    impls = {}
    for pair in pairs:
        domain, sep, name = pair.partition("=")
        if not sep or not domain or not name:
            raise SystemExit(f"--impl wants DOMAIN=NAME, got {pair!r}")
        impls[domain] = name
    return impls


def main(argv: list[str] | None = None) -> None:
    # --- config: domains and the implementation scoring each
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--impl", action="append", default=[], help="DOMAIN=NAME: score DOMAIN with verifier NAME")
    known, rest = extra.parse_known_args(argv)
    args, cfg = worker_start(__doc__.splitlines()[0], rest)
    impls = parse_impls(known.impl)
    plugins = list(cfg.workers.verifier_plugins)
    load_plugins(plugins)
    domains = list(cfg.workers.verifier_domains)
    unknown = [d for d in domains if impls.get(d, d) not in VERIFIERS and impls.get(d, d) not in GROUP_VERIFIERS]
    if unknown:
        raise SystemExit(f"no verifier registered for domains {unknown}; known: {sorted(VERIFIERS)}")

    # --- pool, link, drain on SIGTERM
    pool = Pool(cfg.workers.verifier_procs, impls, plugins, {"judge": OmegaConf.to_container(cfg.workers.judge)})
    counters = {"scored": 0, "failed": 0, "verify_s": 0.0}
    state = {"state": "running", "counters": counters}
    ep = cfg.endpoints
    link = WorkerLink(args.worker_id, "verifier", ep.orchestrator, ep.get("heartbeat"), None,
                      expect=(ScoreRequest, GroupScoreRequest), status=lambda: state, heartbeat_s=cfg.supervisor.heartbeat_s).start()
    draining = []
    signal.signal(signal.SIGTERM, lambda *_: draining.append(time.monotonic()))
    slots = 4 * len(pool.slots)  # requests held at once: the pool's plus a queue so it never idles
    link.send(Ready(args.worker_id, "verifier", slots=slots, domains=domains))

    # --- loop: queue -> pool -> scores; drain and exit once asked and empty
    pending: collections.deque[ScoreRequest | GroupScoreRequest] = collections.deque()
    announced, last_request = False, time.monotonic()
    try:
        while True:
            while not link.inbox.empty():
                pending.append(link.inbox.get_nowait())
                last_request = time.monotonic()
            while pending and pool.idle:
                pool.submit(pending.popleft())
            for score in pool.collect(timeout=0.02):
                score.worker_id = args.worker_id
                counters["scored"] += 1
                counters["failed"] += int(not score.ok)
                counters["verify_s"] += score.t_verify
                link.send(score)
            if draining and not announced:
                link.send(Ready(args.worker_id, "verifier", slots=0, domains=domains, draining=True))
                state["state"], announced = "draining", True
                last_request = max(last_request, time.monotonic())
            # requests sent before the orchestrator read our drain notice still arrive: wait out a quiet second
            if announced and not pending and not pool.busy and time.monotonic() - last_request > 1.0:
                log.info("drained: %d scored", counters["scored"])
                return
    finally:
        pool.close()
        link.close()


if __name__ == "__main__":
    main()

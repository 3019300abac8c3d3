"""Verifier worker: ScoreRequests in, Scores out, scored concurrently by a pool of processes.

    python -m cascade_rl.verifiers.worker --config RUN_DIR/config.yaml --worker-id verifier-0 [--impl math=math]

Serves the domains in ``verifier.domains``; each domain is scored by the
verifier registered under the domain's name, or the one named by ``--impl
DOMAIN=NAME`` (what ``cascade-rl ctl swap verifier`` starts). Scoring runs in
``verifier.procs`` child processes, each fed a few requests ahead (no
round trip between two scores), so CPU-bound checks use the cores and a verifier
cannot take the worker down with it:

- a verifier that raises, or gets a domain it does not serve, yields
  ``Score(ok=False, reward=0)`` with the reason; one that raises ``VerifierUnavailable``
  (a judge endpoint down, no sandbox: verifiers/errors.py) yields ``unavailable=True``
  as well, and the orchestrator fails the group instead of training on a 0;
- one that runs past the request's ``deadline_s`` has its process killed and
  replaced, and yields ``ok=False`` with "timeout" (``unavailable=True`` too for a
  judged domain, ``registry.JUDGED_DOMAINS``: the judge hangs, the response is not at fault);
- one whose process dies (a segfault, ``os._exit``, the OOM killer) yields
  ``ok=False`` with the exit code, and the process is replaced.

Group domains (``verifiers.registry.GROUP_VERIFIERS``: pairwise GenRM) get one
``GroupScoreRequest`` per group and answer one ``Score`` per response; the
same deadlines apply. Scoring processes see ``verifier.judge`` (endpoint, model,
API-key variable) in ``registry.SETTINGS``.

It runs on the worker runtime (protocol/runtime.py): Ready with its slots
(``verifier.slots``), heartbeats, error replies, and SIGTERM drains: the worker
tells the orchestrator it takes no more work (``Ready(draining=True)``), scores
what it holds, then exits 0. That is how the supervisor retires the old workers
of a swap without losing a score. With ``launch --inline`` scoring runs in the
worker's thread (``InThreadPool``), where a debugger sees it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection, wait

from omegaconf import OmegaConf

from cascade_rl.protocol.messages import GroupScoreRequest, Score, ScoreRequest
from cascade_rl.protocol.runtime import Pending, Service, WorkerRuntime
from cascade_rl.protocol.worker_main import worker_start

from . import registry
from .registry import GROUP_VERIFIERS, VERIFIERS, load_plugins  # plugins: module names or .py paths
from .scoring import score_group, score_one

log = logging.getLogger("verifier")


def _child(conn: Connection, impls: dict[str, str], plugins: list[str], settings: dict) -> None:
    """A pool process: requests in, scores out (one list per request, in order), until the pipe closes.

    A reader thread takes requests off the pipe as they come, so the parent's sends never block on a
    verifier that is busy (or hanging) with an earlier request."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stall report's stack dump (supervisor/stall.py)
    registry.SETTINGS.update(settings)
    load_plugins(plugins)
    todo: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                todo.put(conn.recv())
            except (EOFError, OSError):
                todo.put(None)
                return

    threading.Thread(target=read, daemon=True).start()
    while (req := todo.get()) is not None:
        conn.send(score_group(req, impls) if isinstance(req, GroupScoreRequest) else [score_one(req, impls)])


@contextlib.contextmanager
def _sigusr1_ignored():
    """SIGUSR1 ignored while a scoring process starts (main thread only; elsewhere a no-op); this process's own
    stack dump (``worker_start``) registered again after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        yield
    finally:
        faulthandler.register(signal.SIGUSR1, all_threads=True)


class Pool:
    """``size`` scoring processes, each holding up to ``depth`` requests (scored one after another, so the
    next is already there when one finishes). A request's deadline runs from when its process starts on
    it; past it, the process is killed and replaced, and the requests queued behind go to the new one."""

    def __init__(self, size: int, impls: dict[str, str], plugins: list[str] = (), settings: dict | None = None,
                 depth: int = 8) -> None:
        self.ctx = mp.get_context("spawn")  # a fresh interpreter: no sockets or threads inherited
        self.impls, self.plugins, self.settings, self.depth = impls, list(plugins), dict(settings or {}), depth
        self.slots: list[dict] = [self._spawn() for _ in range(max(1, size))]

    def _spawn(self) -> dict:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_child, args=(child, self.impls, self.plugins, self.settings),
                                daemon=True)
        with _sigusr1_ignored():  # inherited through exec until the child registers its stack dump
            proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "queue": collections.deque(), "deadline": 0.0, "t0": 0.0}

    @property
    def idle(self) -> int:
        """Processes with nothing to do."""
        return sum(not s["queue"] for s in self.slots)

    @property
    def busy(self) -> int:
        return len(self.slots) - self.idle

    @property
    def pids(self) -> list[int]:
        """The scoring processes (a stall report dumps their stacks too)."""
        return [s["proc"].pid for s in self.slots]

    @property
    def room(self) -> int:
        """Requests the pool takes now (``submit`` that many)."""
        return sum(self.depth - len(s["queue"]) for s in self.slots)

    def submit(self, req: ScoreRequest | GroupScoreRequest) -> None:
        slot = min(self.slots, key=lambda s: len(s["queue"]))
        if len(slot["queue"]) >= self.depth:
            raise RuntimeError("verifier pool is full: submit at most `room` requests")
        slot["queue"].append(req)
        if len(slot["queue"]) == 1:
            self._start_head(slot)
        slot["conn"].send(req)

    @staticmethod
    def _start_head(slot: dict) -> None:
        slot["t0"] = time.monotonic()
        slot["deadline"] = slot["t0"] + slot["queue"][0].deadline_s

    def collect(self, timeout: float) -> list[Score]:
        """Scores finished within ``timeout``, plus failures for deadlines passed and processes lost."""
        busy = {s["conn"]: s for s in self.slots if s["queue"]}
        out = []
        for conn in wait(list(busy), timeout) if busy else []:
            slot = busy[conn]
            try:
                while slot["queue"] and conn.poll():
                    out.extend(conn.recv())
                    slot["queue"].popleft()
                    if slot["queue"]:
                        self._start_head(slot)
            except (EOFError, OSError):
                slot["proc"].join(timeout=1.0)  # reap it, for the exit code
                out.extend(self._replace(slot, f"verifier process died (exit code {slot['proc'].exitcode})"))
        now = time.monotonic()
        for slot in self.slots:
            if slot["queue"] and now > slot["deadline"]:
                out.extend(self._replace(slot, f"timeout: no score within {slot['queue'][0].deadline_s:g} s"))
        if not busy:
            time.sleep(timeout)
        return out

    def _replace(self, slot: dict, reason: str) -> list[Score]:
        """Kill the slot's process; its current request fails with ``reason``, the rest go to a new process."""
        queued, t0 = slot["queue"], slot["t0"]
        req = queued.popleft()
        slot["proc"].kill()
        slot["proc"].join()
        slot["conn"].close()
        slot.update(self._spawn())
        for rest in queued:
            slot["queue"].append(rest)
            slot["conn"].send(rest)
        if slot["queue"]:
            self._start_head(slot)
        keys = req.keys if isinstance(req, GroupScoreRequest) else [req.key]
        log.warning("%s: %s", keys[0], reason)
        # a judged domain past its deadline waited on a judge that hangs (or is frozen): the judge's fault, not the
        # response's, so its group fails as unavailable instead of training on a 0 (verifiers/errors.py)
        hung_judge = reason.startswith("timeout") and req.domain in registry.JUDGED_DOMAINS
        return [Score(k, 0.0, False, reason, time.monotonic() - t0, unavailable=hung_judge) for k in keys]

    def close(self) -> None:
        for s in self.slots:
            s["conn"].close()
            s["proc"].kill()
        for s in self.slots:
            s["proc"].join(timeout=5)  # reap: no zombies left behind


class InThreadPool:
    """``Pool``'s interface, scoring in the calling thread (``launch --inline``: one process, so a debugger sees
    the reward function). No deadline can be enforced on a verifier that hangs."""

    def __init__(self, impls: dict[str, str]) -> None:
        self.impls, self.queue = impls, collections.deque()
        self.room = 1

    @property
    def busy(self) -> int:
        return len(self.queue)

    def submit(self, req: ScoreRequest | GroupScoreRequest) -> None:
        self.queue.append(req)

    @property
    def pids(self) -> list[int]:
        return []

    def collect(self, timeout: float) -> list[Score]:
        out = []
        while self.queue:
            req = self.queue.popleft()
            out.extend(score_group(req, self.impls) if isinstance(req, GroupScoreRequest) else [score_one(req, self.impls)])
        return out

    def close(self) -> None:
        pass


class Verifier(Service):
    """The verifier's ``Service`` (protocol/runtime.py): requests go to the pool as it has room; scores come back
    from ``poll``."""

    role = "verifier"

    def __init__(self, worker_id: str, domains: list[str], pool: Pool | InThreadPool, slots: int) -> None:
        self.worker_id, self.domains, self.pool = worker_id, domains, pool
        self.slots = slots or 2 * pool.room  # requests held at once: the pool's plus as many queued here
        self.counters = {"scored": 0, "failed": 0, "verify_s": 0.0}

    def status(self) -> dict:
        return {"state": "running", "counters": {**self.counters, "pool_pids": list(getattr(self.pool, "pids", []))}}

    def take(self, pending: collections.deque[Pending]) -> list[Pending]:
        return [pending.popleft() for _ in range(min(len(pending), self.pool.room))]

    def serve(self, batch: list[Pending], reply, collect) -> None:
        # no ``check``: a verifier's failures are scores (ok=False), made in the pool
        for item in batch:
            self.pool.submit(item.request)

    def poll(self, reply) -> None:
        # with room left, return soon: a request arriving now starts within a couple of ms
        for score in self.pool.collect(timeout=0.002 if self.pool.room else 0.02):
            score.worker_id = self.worker_id
            self.counters["scored"] += 1
            self.counters["failed"] += int(not score.ok)
            self.counters["verify_s"] += score.t_verify
            reply(None, score)

    def busy(self) -> int:
        return self.pool.busy

    def error_reply(self, req: ScoreRequest | GroupScoreRequest, reason: str) -> list[Score]:
        keys = req.keys if isinstance(req, GroupScoreRequest) else [req.key]
        self.counters["scored"] += len(keys)
        self.counters["failed"] += len(keys)
        return [Score(k, 0.0, False, reason, 0.0, self.worker_id) for k in keys]

    def close(self) -> None:
        self.pool.close()


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
    v = cfg.verifier
    plugins = list(v.plugins)
    try:
        load_plugins(plugins)
    except registry.PluginError as e:
        raise SystemExit(str(e)) from e
    domains = list(v.domains)
    unknown = [d for d in domains if impls.get(d, d) not in VERIFIERS and impls.get(d, d) not in GROUP_VERIFIERS]
    if unknown:
        raise SystemExit(f"no verifier registered for domains {unknown}; known: {sorted(VERIFIERS)}")

    # --- the pool (in this thread with --inline), then serve on the worker runtime
    settings = {"judge": OmegaConf.to_container(v.judge, enum_to_str=True)}
    if cfg.get("inline"):
        registry.SETTINGS.update(settings)
        pool = InThreadPool(impls)
    else:
        pool = Pool(v.procs, impls, plugins, settings, depth=v.depth)
    WorkerRuntime(Verifier(args.worker_id, domains, pool, v.slots), cfg, args.worker_id,
                  expect=(ScoreRequest, GroupScoreRequest)).run()


if __name__ == "__main__":
    main()

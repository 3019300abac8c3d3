"""The one runtime of every worker that serves requests (sampler, verifier, teacher, environment).

    WorkerRuntime(service, cfg, worker_id, batch_window_s=cfg.sampler.batch_window_s).run()

What each worker shares is written here once; what it computes is its ``Service``, a subclass of the base
below that overrides only what it does (the base: a service with no notices, no checks, no asynchronous work,
that takes every request as soon as it arrives):

* **Ready and credits.** On start the worker sends ``service.hello()`` (its ``slots``: how much
  work the orchestrator may have with it at once); the orchestrator never exceeds them.
* **Heartbeats** to the supervisor every ``supervisor.heartbeat_s`` from the IO thread
  (protocol/sockets.py ``WorkerLink``), with the service's ``status()``.
* **The batching window.** The loop blocks while nothing can be served; after the first message of
  a burst it waits ``batch_window_s`` for the rest (the orchestrator dispatches a step's work back
  to back), so they share one batch.
* **Error replies.** A request ``service.check`` refuses, or one in a batch whose ``serve`` raised,
  is answered with ``service.error_reply`` and the reason: never dropped, never fatal.
* **Drain on SIGTERM** (``ctl scale`` down, a swap): the worker sends ``Ready(draining=True)``
  (no new work), serves what it holds and whatever arrives in the next quiet period
  (``supervisor.drain_quiet_s``: requests sent before the orchestrator read the notice), then exits 0.

The loop itself: collect arrived messages into ``pending`` (``service.accept`` takes notices such as
``WeightsReady`` itself), ``service.take(pending)`` the requests to serve now (the service's safe
point: the sampler loads new weights there), check and serve them, and ``service.poll`` the work of
asynchronous services (the verifier's process pool).

The service never holds the runtime: ``serve(batch, reply, collect)`` is handed what it may call back.
``reply(item, msg)`` sends an answer; ``collect()`` is the loop's own collect, without waiting: what has
arrived goes where the loop would put it (notices to ``accept``, requests to ``pending``), for a service
that looks at its inbox in the middle of serving (the sampler, taking new weights between decode steps).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .messages import Ready
from .sockets import WorkerLink

log = logging.getLogger(__name__)

IDLE_WAKE_S = 0.25  # with nothing to serve, how often the loop looks at the clock (drain quiet period)
_WAKE = object()  # put in the inbox by the SIGTERM handler: the loop notices a drain at once


@dataclasses.dataclass
class Pending:
    """A request waiting to be served, and when it arrived (deadlines run from there)."""

    request: Any
    arrived: float


Reply = Callable[[Pending | None, Any], None]  # reply(item, msg): send msg, the answer to item (None: from poll)


class Service(abc.ABC):
    """What a worker computes; ``WorkerRuntime`` does the rest (see the module docstring). A service says what it
    serves (``status``, ``serve``, ``error_reply``); every other method has the default of the simplest one."""

    role: str  # the worker's role in Ready and heartbeats: sampler | verifier | teacher | environment
    worker_id: str
    slots: int  # how much work the orchestrator may have with this worker at once
    domains: Sequence[str] = ()  # verifiers/teachers: the domains served; environments: their names

    def hello(self, draining: bool = False) -> Ready:
        """The ``Ready`` sent on start, and on a drain (no slots: no new work)."""
        return Ready(self.worker_id, self.role, 0 if draining else self.slots, domains=list(self.domains),
                     draining=draining)

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """``{"state", "version", "counters"}`` for heartbeats."""

    def accept(self, msg: Any) -> bool:
        """Take a notice that is not a request (True), or leave ``msg`` to be queued as one (False)."""
        return False

    def take(self, pending: collections.deque[Pending]) -> list[Pending]:
        """Remove and return the requests to serve now ([] when none can run yet); by default all of them."""
        return [pending.popleft() for _ in range(len(pending))]

    def check(self, item: Pending) -> str:
        """Why ``item`` cannot be served ("" when it can)."""
        return ""

    @abc.abstractmethod
    def serve(self, batch: list[Pending], reply: Reply, collect: Callable[[], int]) -> None:
        """Serve ``batch``, answering each with ``reply(item, msg)`` (later, from ``poll``, for async services);
        ``collect()`` takes in what arrived meanwhile, without waiting (see the module docstring)."""

    def poll(self, reply: Reply) -> None:  # noqa: B027 (optional hook: most services have nothing to deliver)
        """Deliver finished asynchronous work with ``reply(None, msg)``; may block a few ms."""

    def busy(self) -> int:
        """Requests taken but not yet answered (asynchronous services)."""
        return 0

    @abc.abstractmethod
    def error_reply(self, request: Any, reason: str) -> list[Any]:
        """The messages that answer ``request`` with failure ``reason``."""

    def close(self) -> None:  # noqa: B027 (optional hook: most services hold nothing)
        """Release what the service holds (processes, threads) when the worker exits."""


class WorkerRuntime:
    """Runs a ``Service`` on the worker's ``WorkerLink`` until it has drained (see the module docstring)."""

    def __init__(self, service: Service, cfg, worker_id: str, batch_window_s: float = 0.0,
                 weights: bool = False, expect: tuple[type, ...] = ()) -> None:
        """``weights``: also subscribe to the trainer's weight notices; ``expect``: the request types."""
        self.service, self.worker_id = service, worker_id
        self.batch_window_s = batch_window_s
        self.quiet_s = cfg.supervisor.drain_quiet_s
        ep = cfg.endpoints
        self.link = WorkerLink(worker_id, service.role, ep.orchestrator, ep.get("heartbeat") or None,
                               ep.get("weights") if weights else None, expect=expect, status=self._status,
                               heartbeat_s=cfg.supervisor.heartbeat_s)
        self.pending: collections.deque[Pending] = collections.deque()
        self.draining = False
        self._drain_asked = threading.Event()
        self._answered: set[int] = set()  # ids of the requests of the batch being served that got a reply

    def drain(self) -> None:
        """Ask the loop to drain (what SIGTERM does); thread-safe."""
        self._drain_asked.set()
        self.link.inbox.put(_WAKE)

    def run(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.drain())
        self.link.start()
        self.link.send(self.service.hello())
        quiet_since, idle = 0.0, True
        try:
            while True:
                if self._drain_asked.is_set() and not self.draining:
                    self.link.send(self.service.hello(draining=True))
                    self.draining, quiet_since = True, time.monotonic()
                    self.link.beat_now()
                if self.draining and not self.pending and not self.service.busy() \
                        and time.monotonic() - quiet_since > self.quiet_s:
                    log.info("%s drained: %s", self.worker_id, self.service.status().get("counters", {}))
                    return
                if self._collect(IDLE_WAKE_S if idle else 0.0, self.batch_window_s) and self.draining:
                    quiet_since = time.monotonic()  # sent before our notice was read: served too
                batch = self.service.take(self.pending)
                if batch:
                    self._serve(batch)
                if self.service.busy():
                    self.service.poll(self._reply)
                idle = not batch and not self.service.busy()
        finally:
            self.service.close()
            self.link.close()

    def _status(self) -> dict[str, Any]:
        status = dict(self.service.status())
        if self.draining:
            status["state"] = "draining"
        return status

    def _collect(self, wait_s: float = 0.0, window_s: float = 0.0) -> int:
        """Move arrived messages into ``pending`` (notices to ``service.accept``): wait up to ``wait_s`` for the
        first, then ``window_s`` for each next one (the rest of a burst). Returns how many requests arrived.
        With no arguments it never waits: the ``collect`` a service may call in the middle of ``serve``."""
        timeout, got = wait_s, 0
        while True:
            try:
                msg = self.link.inbox.get(timeout=timeout) if timeout else self.link.inbox.get_nowait()
            except queue.Empty:
                return got
            if msg is _WAKE:  # a drain: the loop sees ``_drain_asked`` when it next comes round
                return got
            if not self.service.accept(msg):
                self.pending.append(Pending(msg, time.monotonic()))
                got += 1
            timeout = window_s

    def _serve(self, batch: list[Pending]) -> None:
        good = []
        for item in batch:
            reason = self.service.check(item)
            if reason:
                self._fail(item, reason)
            else:
                good.append(item)
        if not good:
            return
        self._answered.clear()
        try:
            self.service.serve(good, self._reply, self._collect)
        except Exception as e:  # a failing batch fails its requests, not the worker
            log.exception("%s: serving %d requests failed", self.worker_id, len(good))
            for item in good:
                if id(item) not in self._answered:
                    self._fail(item, f"{self.service.role} error: {type(e).__name__}: {e}")

    def _fail(self, item: Pending, reason: str) -> None:
        log.warning("%s: %s", self.worker_id, reason)
        for msg in self.service.error_reply(item.request, reason):
            self._reply(item, msg)

    def _reply(self, item: Pending | None, msg: Any) -> None:
        if item is not None:
            self._answered.add(id(item))
        self.link.send(msg)

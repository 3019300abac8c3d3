"""Socket helpers for the patterns cascade-rl uses.

* ``send``/``recv``/``recv_routed``: one message per multipart, arrays zero-copy.
* ``WorkerLink``: the IO thread of a worker process. It owns the worker's
  sockets (a DEALER to the orchestrator's ROUTER, an optional SUB to the
  trainer's weights PUB, a PUSH of heartbeats to the supervisor); the worker's
  busy loop only touches ``inbox`` and ``send``. Malformed input is counted and
  logged, never raised into the worker.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from . import auth
from .codec import ProtocolError, decode, encode
from .messages import Heartbeat, WeightsReady

log = logging.getLogger(__name__)


def supervised_pid() -> int:
    """The pid the supervisor started: this process's, or under torchrun (rank 0 of a multi-rank
    trainer) the torchrun launcher's, whose child this rank is."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def send(sock: zmq.Socket, msg: Any, identity: bytes | None = None, flags: int = 0) -> None:
    frames = encode(msg)
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, flags=flags, copy=False)


def recv(sock: zmq.Socket, expect: tuple[type, ...] | None = None) -> Any:
    return decode(sock.recv_multipart(copy=False), expect)


def recv_routed(sock: zmq.Socket, expect: tuple[type, ...] | None = None) -> tuple[bytes, Any]:
    """For ROUTER sockets: (sender identity, message). Raises ProtocolError with the identity known."""
    frames = sock.recv_multipart(copy=False)
    identity = frames[0].bytes
    try:
        return identity, decode(frames[1:], expect)
    except ProtocolError as e:
        raise ProtocolError(f"from {identity!r}: {e}") from None


def exit_on_sigterm() -> None:
    """Turn SIGTERM (the supervisor's stop) into SystemExit so ``finally`` blocks run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def bind_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker with the same id takes over its route
    sock.setsockopt(zmq.LINGER, 0)
    auth.bind(sock, endpoint)  # CURVE server on tcp (protocol/auth.py)
    return sock


class WorkerLink:
    """IO thread of a worker; see the module docstring."""

    def __init__(
        self,
        worker_id: str,
        role: str,
        orchestrator: str,
        supervisor: str | None,
        weights: str | None,
        expect: tuple[type, ...],
        status: Callable[[], dict[str, Any]],
        heartbeat_s: float = 1.0,
    ) -> None:
        self.worker_id, self.role = worker_id, role
        self.inbox: queue.Queue = queue.Queue()
        self.malformed = 0
        self._endpoints = (orchestrator, supervisor, weights)
        self._expect = expect
        self._status = status
        self._heartbeat_s = heartbeat_s
        self._outbox: queue.Queue = queue.Queue()
        self._ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-io", daemon=True)

    def start(self) -> WorkerLink:
        self._thread.start()
        return self

    def send(self, msg: Any) -> None:
        """Queue ``msg`` for the orchestrator (thread-safe)."""
        self._outbox.put(msg)
        self._wake()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    # ------------------------------------------------------------------ IO thread

    def _run(self) -> None:
        orchestrator, supervisor, weights = self._endpoints
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        dealer.setsockopt(zmq.LINGER, 1000)
        auth.connect(dealer, orchestrator)  # every link: CURVE client on tcp (protocol/auth.py)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        sub = beat = None
        if weights:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            auth.connect(sub, weights)
            poller.register(sub, zmq.POLLIN)
        if supervisor:
            beat = self._ctx.socket(zmq.PUSH)
            beat.setsockopt(zmq.LINGER, 0)
            beat.setsockopt(zmq.SNDHWM, 10)  # a missing supervisor must not queue beats forever
            auth.connect(beat, supervisor)
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if beat is not None and now >= next_beat:
                    self._beat(beat)
                    next_beat = now + self._heartbeat_s
                events = dict(poller.poll(timeout=max(1, int((next_beat - now) * 1000)) if beat else 100))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while True:
                    try:
                        msg = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    send(dealer, msg)
                if self._stop.is_set():
                    if beat is not None:
                        self._beat(beat, state="stopped")
                    break
                if dealer in events:
                    self._receive(dealer, self._expect)
                if sub is not None and sub in events:
                    self._receive(sub, (WeightsReady,))
        finally:
            for s in (dealer, sub, beat, self._wake_rx, self._wake_tx):
                if s is not None:
                    s.close(linger=500 if s is dealer else 0)

    def _receive(self, sock: zmq.Socket, expect: tuple[type, ...]) -> None:
        while sock.poll(0):
            try:
                self.inbox.put(recv(sock, expect))
            except ProtocolError as e:
                self.malformed += 1
                log.warning("%s: dropped malformed message: %s", self.worker_id, e)

    def _beat(self, sock: zmq.Socket, state: str | None = None) -> None:
        status = dict(self._status())
        counters = dict(status.pop("counters", {}))
        counters["malformed"] = self.malformed
        msg = Heartbeat(
            role=self.role,
            worker_id=self.worker_id,
            pid=supervised_pid(),
            state=state or status.pop("state", "running"),
            version=int(status.pop("version", 0)),
            counters=counters,
        )
        try:
            send(sock, msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # supervisor not reading: heartbeats are best-effort

"""Socket helpers for the patterns cascade-rl uses.

* ``send``/``recv``/``recv_routed``: one message per multipart, arrays zero-copy.
* ``IOThread``: the thread that owns a process's sockets, so its busy loop touches only
  in-memory queues (``inbox`` and ``send``). It also sends the process's heartbeats to the
  supervisor (a PUSH), from a status the busy loop hands it. Malformed input is counted and
  logged, never raised into the busy loop. Two kinds:

  - ``WorkerLink``: a worker's (sampler, verifier, teacher, trainer): a DEALER to the
    orchestrator's ROUTER and an optional SUB to the trainer's weights PUB;
  - ``RouterLink``: the orchestrator's: the one ROUTER every worker connects to. Its inbox holds
    ``(identity, message)``; a send to a peer that is gone comes back as ``(identity, UNREACHABLE)``,
    so the rules that own the work (orchestrator/core.py) hand that peer's work to others.
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
from zmq.utils.monitor import recv_monitor_message

from . import auth
from .codec import ProtocolError, decode, encode
from .messages import Heartbeat, Ready, WeightsReady

log = logging.getLogger(__name__)

UNREACHABLE = "unreachable"  # RouterLink inbox: (identity, UNREACHABLE) when a send to that peer failed


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
    """Turn SIGTERM (the supervisor's stop) into SystemExit so ``finally`` blocks run (main thread only:
    in ``--inline`` runs every role is a thread, and the process's own handler stops them)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def bind_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker with the same id takes over its route
    sock.setsockopt(zmq.LINGER, 0)
    auth.bind(sock, endpoint)  # CURVE server on tcp (protocol/auth.py)
    return sock


class IOThread:
    """The IO thread of a process; subclasses open its sockets (``_open``), send one queued item
    (``_send_item``) and read a ready socket (``_read``)."""

    def __init__(self, worker_id: str, role: str, supervisor: str | None,
                 status: Callable[[], dict[str, Any]], heartbeat_s: float = 1.0) -> None:
        self.worker_id, self.role = worker_id, role
        self.inbox: queue.Queue = queue.Queue()
        self.malformed = 0
        self._supervisor = supervisor
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
        self._beat_now = threading.Event()
        self._opened: queue.Queue = queue.Queue(1)
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-io", daemon=True)

    def start(self) -> IOThread:
        """Start the thread once its sockets are open (a bind that fails raises here, in the caller)."""
        self._thread.start()
        error = self._opened.get(timeout=60)
        if error is not None:
            raise error
        return self

    def send(self, item: Any) -> None:
        """Queue ``item`` for sending (thread-safe): a message, or for a RouterLink ``(identity, message)``."""
        self._outbox.put(item)
        self._wake()

    def beat_now(self) -> None:
        """Send a heartbeat now rather than at the next period (a state the supervisor should see at once)."""
        self._beat_now.set()
        self._wake()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:  # the IO thread has ended: nothing left to wake
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    # ------------------------------------------------------------------ subclass hooks

    def _open(self, poller: zmq.Poller) -> list[zmq.Socket]:
        raise NotImplementedError

    def _send_item(self, item: Any) -> None:
        raise NotImplementedError

    def _read(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ IO thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            sockets = self._open(poller)
        except Exception as e:  # e.g. an endpoint already bound: start() raises it
            self._opened.put(e)
            return
        self._opened.put(None)
        beat = None
        if self._supervisor:
            beat = self._ctx.socket(zmq.PUSH)
            beat.setsockopt(zmq.LINGER, 0)
            beat.setsockopt(zmq.SNDHWM, 10)  # a missing supervisor must not queue beats forever
            auth.connect(beat, self._supervisor)  # CURVE client on tcp (protocol/auth.py)
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if beat is not None and (now >= next_beat or self._beat_now.is_set()):
                    self._beat_now.clear()
                    self._beat(beat)
                    next_beat = now + self._heartbeat_s
                events = dict(poller.poll(timeout=max(1, int((next_beat - now) * 1000)) if beat else 100))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    self._send_item(item)
                if self._stop.is_set():
                    if beat is not None:
                        self._beat(beat, state="stopped")
                    break
                for sock in sockets:
                    if sock in events:
                        self._read(sock)
        finally:
            for s in sockets:
                s.close(linger=self._linger_ms(s))
            # the thread may end on its own poll timeout between close()'s stop and its wake-up: the waker is closed
            # under the lock _wake sends under, so a late wake-up finds it closed instead of a freed socket
            with self._wake_lock:
                self._wake_tx.close(linger=0)
            if beat is not None:  # the "stopped" beat carries the final counters: let it leave (the summary's table)
                beat.close(linger=500)
            self._wake_rx.close(linger=0)

    def _linger_ms(self, sock: zmq.Socket) -> int:
        return 0

    def _decoded(self, sock: zmq.Socket, expect: tuple[type, ...], routed: bool):
        """Every message waiting on ``sock``, decoded; malformed ones counted and logged, not returned."""
        while sock.poll(0):
            try:
                yield recv_routed(sock, expect) if routed else recv(sock, expect)
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


class WorkerLink(IOThread):
    """A worker's IO thread: DEALER to the orchestrator, optional SUB to the weights PUB; see the module
    docstring. Its inbox holds decoded messages."""

    def __init__(self, worker_id: str, role: str, orchestrator: str, supervisor: str | None, weights: str | None,
                 expect: tuple[type, ...], status: Callable[[], dict[str, Any]], heartbeat_s: float = 1.0) -> None:
        super().__init__(worker_id, role, supervisor, status, heartbeat_s)
        self._orchestrator, self._weights, self._expect = orchestrator, weights, expect
        self._dealer = self._sub = self._monitor = None
        self._hello: Ready | None = None  # the last Ready sent: sent again to an orchestrator that restarted
        self._handshakes = 0  # connections made to the orchestrator: after the first, each is a restarted one
        self.reconnects = 0

    def _open(self, poller: zmq.Poller) -> list[zmq.Socket]:
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self._dealer.setsockopt(zmq.LINGER, 1000)
        # a restarted orchestrator knows no worker: each new connection (after the first) gets our Ready again
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        auth.connect(self._dealer, self._orchestrator)  # every link: CURVE client on tcp (protocol/auth.py)
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        sockets = [self._dealer, self._monitor]
        if self._weights:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.LINGER, 0)
            auth.connect(self._sub, self._weights)
            poller.register(self._sub, zmq.POLLIN)
            sockets.append(self._sub)
        return sockets

    def _send_item(self, item: Any) -> None:
        if isinstance(item, Ready):
            self._hello = item
        send(self._dealer, item)

    def _read(self, sock: zmq.Socket) -> None:
        if sock is self._monitor:
            self._on_handshakes()
            return
        expect = self._expect if sock is self._dealer else (WeightsReady,)
        for msg in self._decoded(sock, expect, routed=False):
            self.inbox.put(msg)

    def _on_handshakes(self) -> None:
        """Connections made: the first is the launch's; each later one is an orchestrator the supervisor restarted,
        which learns of this worker from the Ready it is sent again (its work there starts afresh)."""
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            self._handshakes += 1
            if self._handshakes > 1 and self._hello is not None:
                self.reconnects += 1
                log.info("%s: the orchestrator is back; Ready again", self.worker_id)
                send(self._dealer, self._hello)

    def _linger_ms(self, sock: zmq.Socket) -> int:
        return 500 if sock is self._dealer else 0  # what the worker sent last still goes out


class RouterLink(IOThread):
    """The orchestrator's IO thread: the ROUTER every worker connects to; see the module docstring."""

    def __init__(self, endpoint: str, supervisor: str | None, expect: tuple[type, ...],
                 status: Callable[[], dict[str, Any]], heartbeat_s: float = 1.0) -> None:
        super().__init__("orchestrator", "orchestrator", supervisor, status, heartbeat_s)
        self._endpoint, self._expect = endpoint, expect
        self._router = None

    def _open(self, poller: zmq.Poller) -> list[zmq.Socket]:
        self._router = bind_router(self._ctx, self._endpoint)
        poller.register(self._router, zmq.POLLIN)
        return [self._router]

    def _send_item(self, item: tuple[bytes, Any]) -> None:
        identity, msg = item
        try:
            send(self._router, msg, identity=identity)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone; its work goes back to the queues
            log.warning("%s unreachable (%s)", identity.decode(errors="replace"), e)
            self.inbox.put((identity, UNREACHABLE))

    def _read(self, sock: zmq.Socket) -> None:
        for identity, msg in self._decoded(sock, self._expect, routed=True):
            self.inbox.put((identity, msg))

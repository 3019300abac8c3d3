"""The worker runtime (protocol/runtime.py) in-process, its link replaced by queues: the ``Service`` base's
defaults, the one collect (the batching window; without waiting, what a service calls mid-serve), and the loop:
refused requests answered, notices collected in the middle of a serve, a drain that serves what it holds."""

from __future__ import annotations

import collections
import queue
import threading
import time

import pytest
from omegaconf import OmegaConf

from cascade_rl.protocol.messages import Ready
from cascade_rl.protocol.runtime import Pending, Service, WorkerRuntime


class Echo(Service):
    """The simplest service: only what the base cannot say. Requests are strings; "bad" ones are refused."""

    role = "echo"

    def __init__(self, slots: int = 2) -> None:
        self.worker_id, self.slots, self.domains = "echo-0", slots, ["a", "b"]
        self.served: list[list[str]] = []

    def status(self) -> dict:
        return {"state": "running", "counters": {"batches": len(self.served)}}

    def serve(self, batch: list[Pending], reply, collect) -> None:
        self.served.append([p.request for p in batch])
        for p in batch:
            reply(p, f"done {p.request}")

    def error_reply(self, request, reason: str) -> list:
        return [f"failed {request}: {reason}"]


class Notices(Echo):
    """Takes ``notice`` messages itself; its serve looks at its inbox in the middle (as the sampler does between
    decode steps) and records the notices that had arrived by then."""

    def __init__(self) -> None:
        super().__init__()
        self.notices: list[str] = []
        self.seen_mid_serve: list[list[str]] = []
        self.inbox: queue.Queue | None = None  # the test's stand-in for a notice arriving while serving

    def accept(self, msg) -> bool:
        if isinstance(msg, str) and msg.startswith("notice"):
            self.notices.append(msg)
            return True
        return False

    def check(self, item: Pending) -> str:
        return "refused" if item.request == "bad" else ""

    def serve(self, batch: list[Pending], reply, collect) -> None:
        self.inbox.put(f"notice {len(self.served)}")
        collect()
        self.seen_mid_serve.append(list(self.notices))
        super().serve(batch, reply, collect)


class FakeLink:
    """``WorkerLink``'s surface for the runtime: an inbox to fill, and what was sent."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list = []

    def start(self) -> None: ...
    def beat_now(self) -> None: ...
    def close(self) -> None: ...

    def send(self, msg) -> None:
        self.sent.append(msg)


def runtime(service: Service, batch_window_s: float = 0.0) -> WorkerRuntime:
    cfg = OmegaConf.create({"supervisor": {"drain_quiet_s": 0.2, "heartbeat_s": 1.0},
                            "endpoints": {"orchestrator": "ipc:///nowhere"}})
    rt = WorkerRuntime(service, cfg, service.worker_id, batch_window_s)
    rt.link = FakeLink()  # never started: no sockets
    return rt


def test_the_base_says_what_the_simplest_service_does():
    echo = Echo()
    assert echo.hello() == Ready("echo-0", "echo", 2, domains=["a", "b"])
    assert echo.hello(draining=True) == Ready("echo-0", "echo", 0, domains=["a", "b"], draining=True)
    assert not echo.accept("anything") and echo.busy() == 0 and echo.check(Pending("x", 0.0)) == ""
    pending = collections.deque([Pending("x", 0.0), Pending("y", 0.0)])
    assert [p.request for p in echo.take(pending)] == ["x", "y"] and not pending
    assert echo.poll(lambda item, msg: None) is None and echo.close() is None

    class Nothing(Service):
        role = "nothing"

    with pytest.raises(TypeError, match="abstract"):  # status, serve and error_reply are the service's to say
        Nothing()


def test_collect_without_arguments_never_waits_and_the_window_gathers_a_burst():
    service = Notices()
    rt = runtime(service)
    rt.link.inbox.put("notice 7")
    rt.link.inbox.put("r1")
    t0 = time.monotonic()
    assert rt._collect() == 1 and time.monotonic() - t0 < 0.05  # nothing more arrives: no wait
    assert service.notices == ["notice 7"] and [p.request for p in rt.pending] == ["r1"]

    def later(msg: str, delay_s: float) -> None:
        threading.Timer(delay_s, rt.link.inbox.put, (msg,)).start()

    later("r2", 0.0)
    later("r3", 0.1)
    assert rt._collect(1.0, window_s=0.5) == 2  # r3 came within the window after r2
    rt.link.inbox.put("r4")
    later("r5", 0.3)
    assert rt._collect(1.0) == 1  # no window: r4 alone
    assert rt._collect(1.0) == 1  # then r5
    assert [p.request for p in rt.pending] == ["r1", "r2", "r3", "r4", "r5"]


def test_the_loop_refuses_serves_collects_mid_serve_and_drains():
    service = Notices()
    rt = runtime(service, batch_window_s=0.05)
    service.inbox = rt.link.inbox
    for msg in ("r1", "bad", "r2"):
        rt.link.inbox.put(msg)

    def sigterm_then_a_late_request() -> None:
        rt.drain()
        rt.link.inbox.put("r3")  # sent before the orchestrator read our drain notice: served too

    threading.Timer(0.3, sigterm_then_a_late_request).start()
    t0 = time.monotonic()
    rt.run()
    assert time.monotonic() - t0 < 3.0
    sent = rt.link.sent
    assert sent[0] == Ready("echo-0", "echo", 2, domains=["a", "b"])
    assert Ready("echo-0", "echo", 0, domains=["a", "b"], draining=True) in sent
    assert [m for m in sent if isinstance(m, str)] == ["failed bad: refused", "done r1", "done r2", "done r3"]
    assert service.served == [["r1", "r2"], ["r3"]]
    assert service.seen_mid_serve == [["notice 0"], ["notice 0", "notice 1"]]  # accepted during each serve

"""The trainer's weights PUB, owned by an IO thread (docs/ARCHITECTURE.md §2: every socket is IO code's).

    notices = NoticePublisher(cfg.endpoints.weights).start()   # binds, or raises here
    notices.send(transport.publish(policy, version))            # queued: the trainer's loop never blocks on it
    notices.close()

Every sampler's SUB (protocol/sockets.py ``WorkerLink``) connects to it and applies the newest notice at its next
safe point; a sampler that is not connected yet misses it (PUB drops), which is why the trainer also sends each
notice to the orchestrator, which hands it to samplers that join late.
"""

from __future__ import annotations

import zmq

from cascade_rl.protocol import auth
from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.sockets import IOThread, send


class NoticePublisher(IOThread):
    """A PUB bound on ``endpoint`` (CURVE server on tcp, LINGER 0: a notice nobody took is worthless once the
    trainer stops), on its own thread; ``send(notice)`` queues a ``WeightsReady``. No heartbeats: the trainer's
    ``WorkerLink`` sends those."""

    def __init__(self, endpoint: str, worker_id: str = "trainer") -> None:
        super().__init__(f"{worker_id}-weights", "trainer", None, dict)
        self._endpoint = endpoint
        self._pub: zmq.Socket | None = None

    def _open(self, poller: zmq.Poller) -> list[zmq.Socket]:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            auth.bind(self._pub, self._endpoint)  # CURVE server on tcp (protocol/auth.py)
        except Exception:
            self._pub.close(linger=0)
            raise
        return [self._pub]  # closed by the thread when it ends; never polled: a PUB receives nothing

    def _send_item(self, notice: WeightsReady) -> None:
        send(self._pub, notice)

    def _read(self, sock: zmq.Socket) -> None:
        """Never called: the PUB is not registered for reading."""

"""How a run recovers from a process's death: restart budgets over a window, and the data plane rewound together.

Rules only (no processes, no sockets): supervisor/launch.py applies them.

* **A budget over a window.** A worker fails the run only when it has failed more than ``supervisor.max_restarts``
  times within the last ``supervisor.restart_window_s`` seconds: a crash loop, not the odd OOM kill or preemption
  of a week-long run. Its restart waits ``supervisor.restart_backoff_s`` doubled for each earlier failure still in
  the window (at most ``supervisor.restart_backoff_max_s``), so the backoff resets once the worker has run healthy
  for a window.
* **The data plane rewinds together.** The trainer's weights and the orchestrator's groups in flight live in
  memory; when either dies, the supervisor stops the trainer, the orchestrator and the samplers (which hold
  weights of versions the run is about to take back, and their servers: SGLang's), and starts them again from the
  run's newest checkpoint (``--resume-from latest``; from the start if there is none). The orchestrator reads
  its ledger back and settles every rollout of the steps after that checkpoint, and every one in flight,
  ``rolled_back`` (orchestrator/ledger.py); the data cursor is the checkpoint's, so the same prompts are drawn
  again in the same order. Verifiers, teachers, environments, the gateway and a served judge hold no weights:
  they stay, and send their Ready again to the new orchestrator (protocol/sockets.py ``WorkerLink``).
"""

from __future__ import annotations

import dataclasses

REWOUND_ROLES = ("orchestrator", "trainer", "sampler", "sglang")  # restarted together from the newest checkpoint
REWINDS_ON_DEATH = ("orchestrator", "trainer")  # whose death rewinds the data plane
RESUME_FLAG = "--resume-from"
SHOW_FAILURES = 5  # recent failures a process's row of ``ctl status`` shows


@dataclasses.dataclass
class Failure:
    at: float  # time.monotonic() of the failure
    wall: float  # time.time() of it, for people
    why: str  # how it died (supervisor/faults.py)

    def row(self, now: float) -> dict:
        return {"ago_s": round(now - self.at, 1), "at": round(self.wall, 3), "why": self.why}


def in_window(failures: list[Failure], now: float, window_s: float) -> list[Failure]:
    """The failures of the last ``window_s`` seconds (0: every one)."""
    return [f for f in failures if not window_s or now - f.at <= window_s]


def crash_loop(failures: list[Failure], now: float, sup) -> bool:
    """More than ``sup.max_restarts`` failures within ``sup.restart_window_s``: the run fails."""
    return len(in_window(failures, now, sup.restart_window_s)) > sup.max_restarts


def backoff_s(failures: list[Failure], now: float, sup) -> float:
    """The wait before the next start: ``restart_backoff_s`` doubled for each earlier failure in the window, at most
    ``restart_backoff_max_s``."""
    earlier = max(0, len(in_window(failures, now, sup.restart_window_s)) - 1)
    return min(sup.restart_backoff_max_s, sup.restart_backoff_s * 2 ** min(earlier, 30))


def crash_loop_reason(worker_id: str, failures: list[Failure], now: float, sup) -> str:
    recent = in_window(failures, now, sup.restart_window_s)
    return (f"{worker_id} failed {len(recent)} times within supervisor.restart_window_s={sup.restart_window_s:g} s "
            f"(more than supervisor.max_restarts={sup.max_restarts}: a crash loop); the last: {recent[-1].why} "
            f"(see logs/{worker_id}.log)")


def with_resume(args: list[str], resume: bool) -> list[str]:
    """A trainer's or orchestrator's arguments, starting from the newest checkpoint when ``resume``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == RESUME_FLAG:
            skip = True
        else:
            out.append(a)
    return out + [RESUME_FLAG, "latest"] if resume else out



"""A stalled run explains itself: when the orchestrator's waits stop completing, say where everything is.

The orchestrator counts every wait it completes (the workers joining, a step's sampling, a step's training,
an evaluation: ``progress`` in its heartbeat). When that count has not moved for
``orchestrator.stall_timeout_s``, the supervisor writes ``<run_dir>/stall.txt`` and prints where it is:

* what the orchestrator waits for (``waiting_for``) and its books;
* every process: role, id, pid, state, seconds since its last heartbeat, restarts (and how each recent one died:
  the signal, the OOM killer's count, its last RSS: supervisor/faults.py), and what the orchestrator
  has it hold (items, the oldest's age, the next deadline, a few keys: ``s3g5/2/0`` is the score of rollout
  ``s3g5/2``, attempt 0);
* a stack dump of every process: SIGUSR1 makes each of ours print every thread's stack to its log
  (``faulthandler``, registered by ``worker_start`` and in the verifiers' scoring processes); the report
  quotes what each log gained.

The run is not stopped: while the stall lasts the report is rewritten every ``stall_timeout_s`` (what the processes
are doing then), a wait that completes later resets the watch, and a second stall writes a new report.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from .procs import SERVER_ROLES

DUMP_WAIT_S = 1.0  # how long the processes get to write their stacks


class StallWatch:
    """Notices when the orchestrator's ``progress`` has not moved for ``timeout_s`` (0: never)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.progress, self.since, self.reported = None, time.monotonic(), None

    def stalled(self, orchestrator_counters: dict, now: float) -> bool:
        """True at the first check past the timeout since progress last moved, and again every ``timeout_s``
        while the stall lasts (the report is rewritten with what the processes are doing then)."""
        progress = orchestrator_counters.get("progress")
        if progress != self.progress:
            self.progress, self.since, self.reported = progress, now, None
        if not self.timeout_s or now - max(self.since, self.reported or self.since) < self.timeout_s:
            return False
        self.reported = now
        return True

    def stalled_for(self, now: float) -> float:
        return now - self.since


def report(rows: list[dict], orchestrator: dict, stalled_s: float, timeout_s: float, logs: Path) -> str:
    """The text of stall.txt. ``rows``: the supervisor's process table with each one's ``beat_age_s``;
    ``orchestrator``: the orchestrator's last heartbeat counters."""
    holdings = orchestrator.get("workers", {})
    lines = [f"No wait of the orchestrator completed for {stalled_s:.0f} s (orchestrator.stall_timeout_s={timeout_s:g}).",
             f"The orchestrator is {orchestrator.get('state', '?')}, step {orchestrator.get('step', '?')} of "
             f"{orchestrator.get('steps', '?')}, waiting for: {orchestrator.get('waiting_for', '?')}",
             "books: " + ", ".join(f"{k}={v}" for k, v in orchestrator.get("books", {}).items()
                                   if not isinstance(v, (dict, list))),
             "", "processes (heartbeat age, and what the orchestrator has each hold):"]
    for r in rows:
        held = holdings.get(r["id"])
        what = "holds nothing"
        if held and held["items"]:
            what = (f"holds {held['items']} items ({held['load']}/{held['slots']} slots), oldest {held['oldest_s']:.0f} s, "
                    f"next deadline in {held['next_deadline_s']:.0f} s: {', '.join(held['keys'])}"
                    + (" ..." if held["items"] > len(held["keys"]) else ""))
        if held and held.get("draining"):
            what += " (draining)"
        age = f"{r['beat_age_s']:.0f} s ago" if r.get("beat_age_s") is not None else "never"
        lines.append(f"  {r['role']:12s} {r['id']:14s} pid {r['pid']}  {r['state']:12s} heartbeat {age:10s} "
                     f"restarts {r['restarts']}  {what}")
        lines += [f"      failed {f['ago_s']:.0f} s ago: {f['why']}" for f in r.get("failures", [])]
    lines += ["", "stacks (SIGUSR1: every thread of every process, from its log):"]
    lines += stack_dumps(rows, logs)
    return "\n".join(lines) + "\n"


def stack_dumps(rows: list[dict], logs: Path) -> list[str]:
    """Ask every process of ours for its stacks (SIGUSR1) and return what each log gained meanwhile; with
    ``--inline`` (every role a thread of this process) this process's threads, dumped here."""
    if rows and all(r.get("pid") == os.getpid() for r in rows):
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return ["", "--- this process (--inline: every role is a thread, named by its worker id) ---",
                    f.read().strip(), _thread_names()]
    targets = []  # (label, pid, log file)
    for r in rows:
        if r.get("pid") and r["role"] not in SERVER_ROLES:  # a server of another project: SIGUSR1 could kill it
            log = logs / f"{r['id']}.log"
            targets.append((r["id"], r["pid"], log))
            targets += [(f"{r['id']} scoring process {pid}", pid, log) for pid in r["counters"].get("pool_pids", [])]
    sizes = {log: log.stat().st_size if log.is_file() else 0 for _, _, log in targets}
    signalled = []
    for label, pid, _ in targets:
        try:
            os.kill(pid, signal.SIGUSR1)
            signalled.append(label)
        except (ProcessLookupError, PermissionError) as e:
            signalled.append(f"{label} (not signalled: {type(e).__name__})")
    time.sleep(DUMP_WAIT_S)
    out = [f"signalled: {', '.join(signalled)}"]
    for log, size in sizes.items():
        if not log.is_file():
            continue
        with open(log, "rb") as f:
            f.seek(size)
            text = f.read().decode(errors="replace").strip()
        out += ["", f"--- {log.name} ---", text or "(nothing written)"]
    return out


def _thread_names() -> str:
    """faulthandler names threads by id only: the map from id to name (the worker ids, with --inline)."""
    return "threads: " + ", ".join(f"{t.ident:#x}={t.name}" for t in threading.enumerate())

"""A run that survives its faults by itself (supervisor/recovery.py): restart budgets over a window, the data
plane rewound to the newest checkpoint when the trainer or the orchestrator dies, a full disk stopping the run
cleanly. Real launches of the tiny preset, real SIGKILLs, and the books checked from the files
(orchestrator/books.py ``audit``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cascade_rl.learner import checkpoint_dirs
from cascade_rl.orchestrator.books import audit
from cascade_rl.protocol import exits
from cascade_rl.protocol.messages import Ready
from cascade_rl.protocol.sockets import RouterLink, WorkerLink
from cascade_rl.supervisor import recovery
from cascade_rl.supervisor.recovery import Failure

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


class Launch:
    """A launch of the tiny preset in the background, with ``ctl status`` to watch it."""

    def __init__(self, run_dir: Path, tmp_path: Path, *overrides: str, resume: bool = False) -> None:
        self.run_dir, self.env = run_dir, dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
        self.proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", "supervisor.progress=plain",
                                      *overrides, *(["resume=true"] if resume else [])],
                                     env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def table(self) -> dict:
        r = subprocess.run([*CLI, "ctl", "--run-dir", str(self.run_dir), "status", "--json"], env=self.env,
                           capture_output=True, text=True, timeout=30)
        return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}

    def wait(self, test, what: str, timeout_s: float = 120) -> dict:
        """The status table once ``test(table)`` holds."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            assert self.proc.poll() is None, f"the launch ended while waiting for {what}: {self.proc.stdout.read()[-3000:]}"
            if (t := self.table()) and test(t):
                return t
            time.sleep(0.2)
        raise AssertionError(f"{what}: not within {timeout_s} s")

    def kill(self, worker: str, when, what: str) -> None:
        """SIGKILL ``worker`` once ``when(table)`` holds and it runs."""
        t = self.wait(lambda t: when(t) and t.get(worker, {}).get("pid") and t[worker]["state"] not in (
            "starting", "rewinding"), what)
        os.kill(t[worker]["pid"], signal.SIGKILL)

    def finish(self, timeout_s: float = 300) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out


def new_pid(parent: int, marker: str, old: int, timeout_s: float = 30) -> int:
    """The pid of ``parent``'s child whose command line has ``marker``, once it is not ``old`` (from /proc: faster
    than ``ctl status``, so kills can come closer together than a worker takes to start)."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and int(proc.name) != old and marker in (
                        proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    return int(proc.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no new child of {parent} with {marker!r}")


class Sup:  # the supervisor section's fields the rules read
    max_restarts, restart_window_s, restart_backoff_s, restart_backoff_max_s = 3, 60.0, 1.0, 3.0


def test_the_budget_counts_failures_within_the_window_and_the_backoff_resets_after_it():
    spaced = [Failure(t, 0.0, "killed by SIGKILL") for t in (0, 100, 200, 300)]  # each past the last's window
    assert not recovery.crash_loop(spaced, 300, Sup) and recovery.backoff_s(spaced, 300, Sup) == 1.0
    crowded = [Failure(t, 0.0, "killed by SIGKILL") for t in (400, 410, 420, 430)]
    assert [recovery.backoff_s(crowded[:n], 400 + 10 * (n - 1), Sup) for n in (1, 2, 3)] == [1.0, 2.0, 3.0]  # capped
    assert recovery.crash_loop(crowded, 430, Sup)
    why = recovery.crash_loop_reason("verifier-0", spaced + crowded, 430, Sup)
    assert why.startswith("verifier-0 failed 4 times within supervisor.restart_window_s=60 s") and "SIGKILL" in why
    assert not recovery.crash_loop(crowded, 500, Sup)  # a minute later they have left the window


def test_a_restart_resumes_from_the_newest_checkpoint_only_when_there_is_one():
    args = ["--impl", "x", "--resume-from", "latest"]
    assert recovery.with_resume(args, True) == ["--impl", "x", "--resume-from", "latest"]
    assert recovery.with_resume(args, False) == ["--impl", "x"]


def test_a_full_disk_is_told_apart_from_other_errors(tmp_path):
    assert exits.disk_full(OSError(28, "No space left on device"))
    assert exits.disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    try:
        raise RuntimeError("unexpected pos 3361984") from OSError(122, "Disk quota exceeded")
    except RuntimeError as e:
        assert exits.disk_full(e)  # by its cause
    assert not exits.disk_full(ValueError("bad row"), tmp_path)  # this disk has room


def test_a_worker_sends_its_ready_again_to_an_orchestrator_that_restarted(tmp_path):
    """The orchestrator's ROUTER closed and bound again on the same endpoint (a restarted process): the worker's
    DEALER reconnects by itself and its IO thread sends the last Ready again, so the new one knows it."""
    endpoint, hello = f"ipc://{tmp_path}/o", Ready("verifier-0", "verifier", 32, domains=["math"])
    worker = WorkerLink("verifier-0", "verifier", endpoint, None, None, expect=(), status=dict).start()
    worker.send(hello)  # once, as the runtime does at its start
    try:
        for _ in range(2):
            router = RouterLink(endpoint, None, (Ready,), status=dict).start()
            ident, msg = router.inbox.get(timeout=10)
            assert ident == b"verifier-0" and msg == hello
            router.close()
        assert worker.reconnects == 1
    finally:
        worker.close()


def version(t: dict) -> int:
    return t.get("orchestrator", {}).get("version", 0)


def test_a_worker_fails_the_run_only_when_its_failures_crowd_into_the_window(tiny_model, math_data, tmp_path):
    """verifier-0 SIGKILLed five times, each after it has run longer than the 3 s window: restarted each time, the
    run goes on. Then killed as soon as it is back, four times: more than max_restarts=3 within the window, the run
    fails, naming the worker and the window; ``ctl status`` showed its recent failures, each with how it died."""
    run = Launch(tmp_path / "run", tmp_path, f"model.path={tiny_model}", *math_data, "run.steps=5000",
                 "supervisor.max_restarts=3", "supervisor.restart_window_s=3", "supervisor.restart_backoff_s=0.2",
                 "orchestrator.verifier_timeout_s=5", "orchestrator.eval_n=0")
    for i in range(5):
        run.kill("verifier-0", lambda t, i=i: t["verifier-0"]["restarts"] == i, f"verifier-0 running, kill {i + 1}")
        t = run.wait(lambda t, i=i: t["verifier-0"]["restarts"] == i + 1, f"restart {i + 1}")
        recent = t["verifier-0"]["failures"]  # ctl status: the failures in the window, the earlier ones gone
        assert len(recent) == 1 and recent[0]["why"].startswith("killed by SIGKILL (not the OOM killer"), recent
        time.sleep(3.5)  # the next kill comes after this one has left the window
    t = run.wait(lambda t: t["verifier-0"]["state"] == "running", "verifier-0 back after 5 failures")
    assert run.proc.poll() is None  # five failures, spaced: the run goes on
    pid = t["verifier-0"]["pid"]
    for i in range(4):  # each time as soon as it is back: a crash loop
        os.kill(pid, signal.SIGKILL)
        if i < 3:
            pid = new_pid(run.proc.pid, "--worker-id verifier-0", pid)
    rc, out = run.finish(120)
    assert rc == 1, out[-3000:]
    assert "verifier-0 failed 4 times within supervisor.restart_window_s=3 s" in " ".join(out.split()), out[-3000:]
    log = (tmp_path / "run" / "logs" / "verifier-0.log").read_text()
    assert log.count("supervisor: verifier-0 killed by SIGKILL") == 9  # how each death came, in the worker's log


def test_the_trainer_and_the_orchestrator_killed_mid_run_come_back_and_the_books_close(tiny_model, math_data,
                                                                                         tmp_path):
    """One launch of 10 steps, checkpoints every 2: the trainer SIGKILLed at version 3, the orchestrator mid-step at
    5, the trainer again at 7. Each death rewinds the data plane to the newest checkpoint; the launch finishes by
    itself with every dispatched id one terminal fate (the rolled-back ones ``rolled_back``), the trainer's ids the
    ledger's trained ids, and each of the 10 steps once in the final weights' history."""
    run_dir, steps = tmp_path / "run", 10
    run = Launch(run_dir, tmp_path, f"model.path={tiny_model}", *math_data, f"run.steps={steps}",
                 "trainer.save_every=2", "supervisor.restart_backoff_s=0.2", "orchestrator.eval_n=1")
    run.kill("trainer-0", lambda t: version(t) >= 3, "version 3")
    run.kill("orchestrator", lambda t: version(t) >= 5 and t["orchestrator"]["state"] in ("sampling", "training"),
             "version 5, mid-step")
    run.kill("trainer-0", lambda t: version(t) >= 7, "version 7")
    rc, out = run.finish()
    assert rc == 0, out[-4000:]
    assert out.count("start again from the newest checkpoint") == 3, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rewinds"] == 3 and summary["policy_version"] == steps
    assert summary["restarts"]["trainer-0"] == 2 and summary["restarts"]["orchestrator"] == 1
    books = audit(run_dir, steps)
    assert books["ok"], books["problems"]
    assert books["fates"]["trained"] == steps * 8 * 4 and books["fates"]["rolled_back"] > 0
    assert books["rolled_back_after_a_fate"] > 0  # trained in weights the rewind threw away, then redone
    assert summary["books"]["lost"] == 0 and summary["books"]["trainer_ids"]["match"]
    assert summary["books"]["rolled_back"] == books["fates"]["rolled_back"]


def logs(run_dir: Path) -> str:
    """The end of every log of the run: what a failed assertion shows."""
    return "".join(f"\n--- {f.name}\n" + f.read_text()[-2000:] for f in (run_dir / "logs").glob("*.log"))


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"no tmpfs to fill here (mount: {r.stderr.strip()}); needs root")


def test_a_full_disk_stops_the_run_cleanly_and_it_resumes_from_the_checkpoint_before(tiny_model, math_data,
                                                                                       tmp_path):
    """run_dir on a 96 MiB tmpfs (one checkpoint kept), filled once the checkpoint of step 2 is written until less than a checkpoint is
    left: the run stops with the reason (no bare traceback), the checkpoint of step 2 whole, the ledger readable;
    with room again, resume=true finishes the run with its books closed."""
    disk, steps = tmp_path / "disk", 6
    _mount_tmpfs(disk, 96)
    try:
        run_dir = disk / "run"
        args = [f"model.path={tiny_model}", *math_data, f"run.steps={steps}", "trainer.save_every=1",
                "trainer.keep_checkpoints=1",
                "orchestrator.eval_n=1"]
        run = Launch(run_dir, tmp_path, *args)
        saved = lambda: checkpoint_dirs.latest(run_dir / "checkpoints")  # noqa: E731
        run.wait(lambda t: saved() is not None and saved().name >= "step_000002", "the checkpoint of step 2")
        size = (96 << 20) - shutil.disk_usage(disk).free  # ~ one checkpoint, the data and the logs
        filler = disk / "filler"
        with open(filler, "wb") as f:  # leave half a checkpoint free
            f.write(b"\0" * max(0, shutil.disk_usage(disk).free - size // 2))
        rc, out = run.finish()
        text = " ".join(out.split())
        assert rc == 1 and "no space left on the disk of run_dir" in text and "resume=true" in text, out[-3000:] + logs(
            run_dir)
        assert "Traceback" not in out
        latest = checkpoint_dirs.latest(run_dir / "checkpoints")
        assert latest is not None and int(latest.name.removeprefix("step_")) >= 2
        assert not list((run_dir / "checkpoints").glob(".*tmp*"))  # the failed save left nothing behind
        filler.unlink()
        rc, out = Launch(run_dir, tmp_path, *args, resume=True).finish()
        assert rc == 0, out[-3000:] + logs(run_dir)
        books = audit(run_dir, steps)
        assert books["ok"], books["problems"]
        assert books["fates"]["trained"] == steps * 8 * 4
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)

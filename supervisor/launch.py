"""Supervisor: start a run's process groups, watch them, restart crashes, show progress.

    cascade-rl launch tiny run_dir=/tmp/r sampler.count=2

``launch`` first prepares the run's plan (supervisor/plan.py, where every refusal happens before any process or
socket): the resolved config, the data (supervisor/run_data.py: every row validated), the GPU layout
(supervisor/placement.py), the endpoints (``ipc://`` under a short temp dir, mode 0700, or ``tcp://`` on ``host``),
the CURVE keys (protocol/auth.py: every tcp socket of the run admits only holders of ``<run_dir>/auth.keys``,
mode 0600) and the processes to start. The supervisor writes ``<run_dir>/config.yaml`` (the key file's path, no
key) and starts, each as its own OS process: the orchestrator, the trainer, the samplers, the verifiers and,
for MOPD, one teacher server per distinct teacher checkpoint (``teacher.checkpoints``: domain -> checkpoint; LoRA
checkpoints of one base share one server: supervisor/procs.py ``teacher_groups``);
with ``sampler.engine=sglang``, one SGLang server per sampler too (supervisor/procs.py); with
``verifier.judge.serve``, the judge model's server, healthy before the verifiers start (supervisor/judge.py).
With ``--inline`` each role is a thread of this process instead (supervisor/inline.py). Each process sees
exactly the GPUs the config's ``gpus`` section gives its role (``CUDA_VISIBLE_DEVICES``, empty for CPU
processes). It then serves heartbeats (PULL) and ``cascade-rl ctl`` requests (REP) and watches every process as
its role's entry of ``procs.ROLES`` says, until the orchestrator exits: 0 ends the run, anything else fails it;
a crashed trainer stops it with the command that resumes it. Any other crashed process is restarted with
exponential backoff up to ``supervisor.max_restarts`` times; ``ctl scale`` and ``ctl swap`` start workers the
same way as the launch does (``add``), and drain the ones they retire. A run whose orchestrator stops completing
its waits gets ``<run_dir>/stall.txt`` (supervisor/stall.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import zmq
from omegaconf import DictConfig

from cascade_rl.learner import checkpoint_dirs
from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError
from cascade_rl.protocol.messages import Control, ControlReply, Heartbeat
from cascade_rl.protocol.sockets import recv, send
from cascade_rl.weights.common import shm_dir

from . import inline as inline_mode
from . import judge, placement, recovery, stall
from .display import Display
from .faults import MemoryWatch
from .inline import ThreadProc
from .launchers import LaunchError, Start
from .plan import check_scale, check_swap, prepare
from .procs import (
    ROLES,
    WORKER_ENV,
    Proc,
    free_ports,
    next_ids,
    resume_hint,
    sampler_procs,
    state_dir,
    worker_argv,
    worker_command,
)
from .stall import StallWatch

__all__ = ["Supervisor", "free_ports", "sampler_procs", "state_dir"]  # cli.py and tests import these from here


MEMORY_SAMPLE_S = 2.0  # how often the supervisor samples each process's RSS


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


class Supervisor:
    def __init__(self, cfg: DictConfig, inline: bool = False) -> None:
        """Prepare the launch (supervisor/plan.py: every refusal happens there, before any process or socket), then
        write config.yaml and bind the heartbeat and control sockets. ``inline``: every role a thread of this
        process (supervisor/inline.py), for debuggers and py-spy."""
        self.plan = plan = prepare(cfg, inline)
        self.cfg, self.run_dir, self.inline, self.data = plan.cfg, plan.run_dir, inline, plan.data
        self.launcher, self.sock_dir, self.config_path = plan.launcher, plan.sock_dir, plan.config_path
        if inline:
            inline_mode.configure_logging(self.run_dir)
        self.config_path.write_text(plan.config_yaml)
        self.ctx = zmq.Context.instance()
        self.beats = self.ctx.socket(zmq.PULL)
        auth.bind(self.beats, cfg.endpoints.heartbeat)
        self.control = self.ctx.socket(zmq.REP)
        auth.bind(self.control, cfg.endpoints.control)
        self.procs: dict[str, Proc] = {}
        self.retired: list[dict] = []  # workers a swap replaced, as they last reported
        self.told: set[str] = set()  # the dashboards whose failure the console has shown
        self.verifier_impls: dict[str, str] = {}  # domain -> verifier name, as swaps set them
        self.started = time.monotonic()
        self.stop_requested = False
        self.stall = StallWatch(cfg.orchestrator.stall_timeout_s)
        self.memory = MemoryWatch()  # RSS and OOM-kill counts: how a dead process died (supervisor/faults.py)
        self._next_memory_sample = 0.0
        self.rewinds = 0  # data-plane restarts from the newest checkpoint (supervisor/recovery.py)
        self.notices: list[str] = []  # what the live display has yet to say
        info = {"pid": os.getpid(), "control": cfg.endpoints.control, "run_dir": str(self.run_dir),
                "auth_keys": cfg.auth_keys}  # ctl reads the key file (same user) to reach the control socket
        (self.run_dir / "supervisor.json").write_text(json.dumps(info))
        state_dir().mkdir(parents=True, exist_ok=True)
        (state_dir() / "latest_run").write_text(str(self.run_dir))

    # ------------------------------------------------------------------ processes

    def spawn(self, proc: Proc) -> None:
        if self.inline and not proc.cmd:  # a server (the judge's) is a process of its own with --inline too
            proc.handle = ThreadProc(ROLES[proc.role].module, worker_argv(proc, self.config_path), proc.worker_id)
        else:
            env = dict(WORKER_ENV)
            if self.cfg.launcher == "local":  # Ray gives each process its GPUs itself
                env.update(placement.cuda_env(proc.gpus))
            log = str(self.run_dir / "logs" / f"{proc.worker_id}.log")
            proc.handle = self.launcher.spawn(Start(proc.worker_id, proc.role, worker_command(proc, self.config_path),
                                                    env, log, ranks=proc.ranks, prefix=proc.prefix))
        proc.state, proc.last_beat = "starting", time.monotonic()

    def start(self) -> None:
        """Start the plan's processes (supervisor/plan.py ``start_order``); a served judge first, healthy before
        the verifiers. Raises ``JudgeStartError`` when it never answers."""
        for proc in self.plan.procs:
            self.add(proc)
        if (served := self.plan.judge) is not None:
            judge.wait_healthy(self.cfg.verifier.judge.base_url, self.cfg.verifier.judge.startup_s,
                               lambda: served.handle.poll(), self.run_dir / "logs" / "judge.log",
                               tick=lambda: self.serve(timeout_ms=200))
            served.state = "serving"
        for proc in self.plan.after_judge:
            self.add(proc)

    def add(self, proc: Proc) -> Proc:
        """Start ``proc`` as a worker of the run (every start but a restart comes here)."""
        self.procs[proc.worker_id] = proc
        try:
            self.spawn(proc)
        except LaunchError:  # not placed (launcher=ray): not a worker of the run
            del self.procs[proc.worker_id]
            raise
        return proc

    def new_ids(self, role: str, n: int) -> list[str]:
        """``n`` ids for new workers of ``role``, after every id the run has had (retired workers' too)."""
        return next_ids(role, [*self.procs, *(r["id"] for r in self.retired)], n)

    def free_sampler_slot(self) -> int:
        """The first entry of gpus.samplers no sampler holds (a draining one holds its own until it exits);
        CPU samplers need none (0). Raises ValueError when every entry is held."""
        if not self.cfg.gpus.samplers:
            return 0
        held = {p.slot for p in self.procs.values() if p.role == "sampler"}
        free = [i for i in range(len(self.cfg.gpus.samplers)) if i not in held]
        if not free:
            raise ValueError(f"every entry of gpus.samplers={list(self.cfg.gpus.samplers)} holds a sampler: list "
                             f"more GPUs there to run more samplers")
        return free[0]

    def watch(self) -> str:
        """Check every process once, each as its role's entry of ``ROLES`` says; returns 'running', 'done' or a
        failure reason."""
        now, sup = time.monotonic(), self.cfg.supervisor
        self._retire()
        self._sample_memory(now)
        for p in list(self.procs.values()):
            if p.draining:
                continue
            if p.handle is None:
                if now >= p.restart_at and (failed := self._respawn(p, now)):
                    return failed
                continue
            role, rc = ROLES[p.role], p.handle.poll()
            if role.ready and rc is None and p.state == "starting" and role.ready(self.cfg):
                p.state = "serving"  # a restarted server: serving once it answers
            if role.ends_run and rc is not None and (outcome := role.ends_run(rc, self.run_dir)):
                return outcome
            silent = not role.server and now - p.last_beat > sup.heartbeat_timeout_s
            if rc is None and not silent:
                continue
            if rc is None or role.server:  # hung; or a server whose children outlive it (vLLM's engine)
                p.handle.kill()
            if p.serves in self.procs and self.procs[p.serves].handle is not None:
                self.procs[p.serves].handle.kill()  # a fresh server has the base weights: so must its sampler
            if failed := self._failed(p, now, rc):
                return failed
            if p.role in recovery.REWINDS_ON_DEATH:
                self._rewind(p, now)
        if sup.timeout_s and now - self.started > sup.timeout_s:
            return f"run exceeded supervisor.timeout_s={sup.timeout_s}"
        if self.stop_requested:
            return "stopped by ctl stop"
        return "running"

    def _failed(self, p: Proc, now: float, rc: int | None) -> str:
        """``p`` died (``rc``; None: it hung): its failure recorded, in its log too, and its restart scheduled; why
        the run fails when that makes a crash loop (supervisor/recovery.py)."""
        why = "lost with its node" if getattr(p.handle, "lost", "") else self.memory.explain(p.worker_id, rc)
        p.failures.append(recovery.Failure(now, time.time(), why))
        self._tell_log(p, f"supervisor: {p.worker_id} {why}")
        sup = self.cfg.supervisor
        if self.inline and not p.cmd:  # inline: the traceback is the answer
            return f"{p.worker_id} failed (see logs/{p.worker_id}.log)"
        if recovery.crash_loop(p.failures, now, sup):
            return recovery.crash_loop_reason(p.worker_id, p.failures, now, sup) + self._resume_hint(p)
        state = ("lost" if getattr(p.handle, "lost", "") else f"exited({rc})") if rc is not None else "hung"
        p.handle = None
        self._back_off(p, now, state)
        return ""

    def _rewind(self, dead: Proc, now: float) -> None:
        """``dead`` (the trainer or the orchestrator) died: stop the rest of the data plane and start it all again
        from the newest checkpoint after ``dead``'s backoff (supervisor/recovery.py)."""
        resume = checkpoint_dirs.latest(self.run_dir / "checkpoints") is not None
        for p in self.procs.values():
            if p.role not in recovery.REWOUND_ROLES or p.draining:
                continue
            if p.handle is not None:
                p.handle.kill()  # its whole process group: torchrun's ranks, an engine's children
                try:
                    p.handle.wait(30)
                except subprocess.TimeoutExpired:
                    pass  # a process in uninterruptible sleep: it goes when it wakes; its successor binds anyway
                p.handle, p.state = None, "rewinding"
            if p.role in recovery.REWINDS_ON_DEATH:
                p.args = recovery.with_resume(p.args, resume)
            p.restart_at = max(p.restart_at, dead.restart_at)
        self.rewinds += 1
        self.notices.append(f"{dead.worker_id} {dead.failures[-1].why}: the trainer, the orchestrator and the "
                            f"samplers start again from " + ("the newest checkpoint" if resume else "the start"))

    def _respawn(self, p: Proc, now: float) -> str:
        """Start ``p`` again (its backoff is over): "" once started or retried later; why the run fails when it
        still has no place after ``supervisor.max_restarts`` tries within the window."""
        try:
            self.spawn(p)
        except LaunchError as e:  # no room on the cluster now (launcher=ray): retried with the backoff
            p.failures.append(recovery.Failure(now, time.time(), f"could not be placed: {e}"))
            if recovery.crash_loop(p.failures, now, self.cfg.supervisor):
                return f"{p.worker_id} could not be placed again: {e}{self._resume_hint(p)}"
            self._back_off(p, now, "unplaced")
        return ""

    def _resume_hint(self, p: Proc) -> str:
        """What a failed run says after ``p``'s failure: the resume command when ``p`` is of the data plane."""
        return f"; {resume_hint(self.run_dir)}" if p.role in recovery.REWOUND_ROLES else ""

    def _back_off(self, p: Proc, now: float, state: str) -> None:
        """``p`` is not running (``state`` says why): its next start after a wait that doubles with each failure
        still in the restart window."""
        p.state, p.restart_at = state, now + recovery.backoff_s(p.failures, now, self.cfg.supervisor)
        p.restarts += 1

    def _sample_memory(self, now: float) -> None:
        """Every ``MEMORY_SAMPLE_S``: each process's RSS, the evidence an OOM kill is explained with."""
        if now < self._next_memory_sample or self.inline:
            return
        self._next_memory_sample = now + MEMORY_SAMPLE_S
        self.memory.sample({p.worker_id: p.handle.pid for p in self.procs.values()
                            if p.handle is not None and getattr(p.handle, "pid", None)})

    def _tell_log(self, p: Proc, line: str) -> None:
        """A line of the supervisor's in ``p``'s own log (how it died, next to what it wrote last)."""
        try:
            with open(self.run_dir / "logs" / f"{p.worker_id}.log", "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass  # a full disk: the console and ctl status still say it

    def _drain(self, p: Proc) -> None:
        """SIGTERM ``p``: it finishes what it holds, tells the orchestrator it takes no more, exits 0; never restarted."""
        if p.handle is not None and p.handle.poll() is None:
            p.handle.terminate()
        p.draining, p.state = True, "draining"

    def _retire(self) -> None:
        """Swaps in progress: once a retiring worker's replacements all run, drain it; once it has exited, drop it."""
        for p in list(self.procs.values()):
            if p.replaced_by and not p.draining and all(
                    self.procs[r].state == "running" for r in p.replaced_by if r in self.procs):
                self._drain(p)
            if p.draining and (p.handle is None or p.handle.poll() is not None):
                self.retired.append({**p.row(), "state": f"retired({p.handle.returncode if p.handle else None})"})
                del self.procs[p.worker_id]
                for server in [q for q in self.procs.values() if q.serves == p.worker_id]:  # its SGLang server
                    if server.handle is not None:
                        server.handle.kill()
                    del self.procs[server.worker_id]

    def scale(self, role: str, count: int) -> dict:
        """Run ``count`` workers of ``role`` (samplers, verifiers): start new ones (they get the current weights from
        the orchestrator before any work), or drain the newest ones (they finish what they hold, then exit)."""
        check_scale(role, count)
        live = [p for p in self.procs.values() if p.role == role and not p.draining and not p.replaced_by]
        started = self.new_ids(role, count - len(live))
        for worker_id in started:
            if role == "sampler":  # on the first free entry of gpus.samplers, with its server if the engine has one
                for proc in sampler_procs(self.cfg, worker_id, self.free_sampler_slot()):
                    self.add(proc)
            else:
                self.add(Proc(role, worker_id, args=list(live[0].args if live else [])))
        draining = live[count:][::-1]
        for p in draining:
            self._drain(p)
        return {"started": started, "draining": [p.worker_id for p in draining], role + "s": count}

    def swap(self, role: str, domain: str, impl: str) -> dict:
        """Replace the workers of ``role`` serving ``domain`` by as many new ones that score it with ``impl``."""
        check_swap(self.cfg, role, domain, impl)
        old = [p for p in self.procs.values() if p.role == "verifier" and not p.replaced_by and not p.draining]
        self.verifier_impls[domain] = impl
        args = [a for d, name in self.verifier_impls.items() for a in ("--impl", f"{d}={name}")]
        started = [self.add(Proc("verifier", worker_id, args=list(args))).worker_id
                   for worker_id in self.new_ids("verifier", len(old))]
        for p in old:
            p.replaced_by = started
        return {"started": started, "retiring": [p.worker_id for p in old], "impl": {domain: impl}}

    def stop_all(self) -> None:
        # --inline: the roles are daemon threads, which end with this process; only servers are processes
        procs = [p for p in self.procs.values() if p.handle is not None and (p.cmd or not self.inline)]
        for p in procs:
            if p.handle.poll() is None:
                p.handle.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.handle.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.handle.kill()
            if ROLES[p.role].server:  # another project's children (vLLM's engine core) must not outlive the run
                p.handle.kill()
        if not self.inline:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        shutil.rmtree(shm_dir(self.cfg.run_id), ignore_errors=True)
        self.launcher.close()

    # ------------------------------------------------------------------ sockets

    def serve(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        poller.register(self.beats, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        events = dict(poller.poll(timeout_ms))
        if self.beats in events:
            self._read_beats(quiet_ms=0)
        if self.control in events:
            try:
                reply = self._on_control(recv(self.control, (Control,)))
            except ProtocolError as e:
                reply = ControlReply(False, None, str(e))
            send(self.control, reply)

    def _read_beats(self, quiet_ms: int) -> None:
        """Take every heartbeat queued, and each that follows within ``quiet_ms`` of the last. At the end of a run
        (200 ms) these are the beats the workers sent as they stopped, with their final counters: without them
        summary.json's table held each worker's last periodic beat, up to a second of scores short."""
        while self.beats.poll(quiet_ms):
            try:
                self._on_beat(recv(self.beats, (Heartbeat,)))
            except ProtocolError:
                pass

    def _on_beat(self, hb: Heartbeat) -> None:
        p = self.procs.get(hb.worker_id)
        if p is None or p.handle is None or (p.handle.pid != hb.pid and not p.prefix):
            return  # a beat from a process we already replaced (a launcher prefix, e.g. ssh, changes pids)
        p.last_beat, p.state, p.version, p.counters = time.monotonic(), hb.state, hb.version, hb.counters

    def _on_control(self, msg: Control) -> ControlReply:
        if msg.op == "status":
            return ControlReply(True, {"run_dir": str(self.run_dir), "workers": self.table()})
        if msg.op == "stop":
            self.stop_requested = True
            return ControlReply(True, {"stopping": True})
        if msg.op == "scale":
            try:
                (key, value), = msg.args.items()
                return ControlReply(True, self.scale(key.removesuffix("s"), int(value)))
            except (ValueError, TypeError, LaunchError) as e:
                return ControlReply(False, None, f"scale: {e}")
        if msg.op == "swap":
            try:
                return ControlReply(True, self.swap(msg.args.get("role", ""), msg.args.get("domain", ""),
                                                    msg.args.get("impl", "")))
            except ValueError as e:
                return ControlReply(False, None, str(e))
        return ControlReply(False, None, f"op {msg.op!r} is not available in this version of the supervisor")

    def table(self) -> list[dict]:
        return [p.row(self.cfg.supervisor.restart_window_s) for p in self.procs.values()] + self.retired

    def report_stall(self, display: Display) -> None:
        """When the orchestrator's waits have stopped completing: stall.txt, and where to read it (supervisor/stall.py)."""
        now, orchestrator = time.monotonic(), self.procs["orchestrator"].counters
        if not self.stall.stalled(orchestrator, now):
            return
        rows = [{**p.row(), "beat_age_s": now - p.last_beat if p.handle else None} for p in self.procs.values()]
        text = stall.report(rows, orchestrator, self.stall.stalled_for(now), self.stall.timeout_s,
                            self.run_dir / "logs")
        path = self.run_dir / "stall.txt"
        path.with_suffix(".tmp").write_text(text)
        display.notice("\n".join(text.splitlines()[:2]) + f"\n(every worker and a stack dump of each process: {path})")
        path.with_suffix(".tmp").replace(path)  # whole, and after the notice: whoever reads it was told where it is

    # ------------------------------------------------------------------ main loop

    def report_dashboards(self, display: Display) -> None:
        """A dashboard the orchestrator dropped (no network, bad credentials: orchestrator/trackers.py), said once."""
        for name, why in self.procs["orchestrator"].counters.get("dashboards_failed", {}).items():
            if name not in self.told:
                self.told.add(name)
                display.notice(f"logger={name} failed ({why[:300]}); the run goes on without it (metrics.jsonl "
                               f"has every metric)")

    def run(self) -> int:
        display = Display(self.cfg.supervisor.progress, self.cfg.run.steps, self.run_dir)
        # SIGTERM (a CI timeout, `kill`) must stop the workers too, like Ctrl-C does
        signal.signal(signal.SIGTERM, _interrupt)
        outcome = "running"
        try:
            self.start()
            with display:
                while outcome == "running":
                    self.serve(timeout_ms=200)
                    outcome = self.watch()
                    display.update(self.procs["orchestrator"].counters, self.table())
                    self.report_stall(display)
                    self.report_dashboards(display)
                    while self.notices:
                        display.notice(self.notices.pop(0))
        except KeyboardInterrupt:
            outcome = "interrupted"
        except (judge.JudgeStartError, LaunchError) as e:  # the judge never answered, a worker has no place:
            outcome = str(e)  # the launch fails with why; everything started stops
        finally:
            self.stop_all()
            self._read_beats(quiet_ms=200)
            for s in (self.beats, self.control):
                s.close(linger=0)
        summary_path = self.run_dir / "summary.json"
        if outcome == "done" and summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            summary["restarts"] = {p.worker_id: p.restarts for p in self.procs.values()}
            summary["rewinds"] = self.rewinds  # data-plane restarts from the newest checkpoint
            summary["failures"] = {p.worker_id: [f.row(time.monotonic()) for f in p.failures]
                                   for p in self.procs.values() if p.failures}
            summary["workers"] = self.table()  # final counters of every worker, retired ones included
            summary_path.write_text(json.dumps(summary, indent=2))
            display.final(summary)
            return 0
        display.failed(outcome)
        return 1

"""Supervisor: start a run's process groups, watch them, restart crashes, show progress.

    cascade-rl launch tiny run_dir=/tmp/r sampler.count=2

``launch`` resolves the config, prepares the data (supervisor/run_data.py: every row
validated before any process starts), gives the run its endpoints (``ipc://`` under
a short temp dir, mode 0700, or ``tcp://`` on ``host``) and its CURVE keys (protocol/auth.py: every
tcp socket of the run admits only holders of ``<run_dir>/auth.keys``, mode 0600), writes
``<run_dir>/config.yaml`` (the key file's path, no key) and starts, each as its
own OS process: the orchestrator, the trainer, the samplers, the
verifiers and, for MOPD, one teacher server per distinct teacher checkpoint
(``teacher.checkpoints``: domain -> checkpoint); with ``sampler.engine=sglang``, one
SGLang server per sampler too (supervisor/procs.py); with ``verifier.judge.serve``, the judge
model's server, healthy before the verifiers start (supervisor/judge.py). With ``--inline`` each role is a
thread of this process instead (supervisor/inline.py). Each process sees exactly the GPUs the config's
``gpus`` section gives its role (supervisor/placement.py; ``CUDA_VISIBLE_DEVICES``,
empty for CPU processes); a layout the machine cannot hold is refused before any
process starts. It then serves heartbeats (PULL) and ``cascade-rl ctl`` requests
(REP) until the orchestrator exits: 0 ends the run, anything else fails it.
A crashed worker other than the orchestrator is restarted with exponential
backoff up to ``supervisor.max_restarts`` times; a run whose orchestrator stops
completing its waits gets ``<run_dir>/stall.txt`` (supervisor/stall.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import zmq
from omegaconf import DictConfig, OmegaConf

from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError
from cascade_rl.protocol.messages import Control, ControlReply, Heartbeat
from cascade_rl.protocol.sockets import recv, send
from cascade_rl.weights.common import shm_dir

from . import inline as inline_mode
from . import judge, placement, stall
from .config_errors import ConfigError
from .display import Display
from .inline import ThreadProc
from .launchers import LaunchError, Start, make_launcher
from .procs import (
    MODULES,
    SERVER_ROLES,
    Proc,
    free_ports,
    sampler_procs,
    state_dir,
    teacher_groups,
)
from .run_data import prepare_run_data
from .stall import StallWatch


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


class Supervisor:
    def __init__(self, cfg: DictConfig, inline: bool = False) -> None:
        """``inline``: every role a thread of this process (supervisor/inline.py), for debuggers and py-spy."""
        self.run_dir = Path(cfg.run_dir).resolve()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cfg.run_dir = str(self.run_dir)
        if inline and (refused := inline_mode.problems(cfg)):
            raise ConfigError("; ".join(refused))
        self.inline = cfg.inline = inline
        if inline:
            inline_mode.configure_logging(self.run_dir)
        # before any socket or process: bad rows (BadData) or a config the data contradicts (ConfigError)
        # refuse the launch here, and the orchestrator opens what this wrote to run_dir/data
        self.data = prepare_run_data(cfg)
        if problems := placement.check(cfg, len(teacher_groups(cfg.teacher.checkpoints)), placement.visible_gpus()):
            raise ConfigError("GPU layout:\n  " + "\n  ".join(problems))
        if cfg.sampler.engine == "sglang" and not cfg.sampler.sglang.url:
            from cascade_rl.samplers.sglang_engine import sglang_unavailable

            if reason := sglang_unavailable():
                raise ConfigError(f"sampler.engine=sglang: {reason}")
            if not cfg.gpus.samplers:
                raise ConfigError("sampler.engine=sglang: the SGLang servers need GPUs: set gpus.samplers")
        if (cfg.host or cfg.launcher == "ray") and cfg.get("auth", True) and not auth.curve_available():
            raise ConfigError(f"host={cfg.host or '(launcher=ray)'}: this libzmq ({zmq.zmq_version()}) has no CURVE security, so its tcp "
                              f"endpoints would admit anyone who reaches them: install a pyzmq wheel (it bundles "
                              f"libsodium), or set auth=false on a trusted network")
        run_id = uuid.uuid4().hex[:10]
        # ipc paths must stay under ~100 bytes, so they live in a short temp dir, not in run_dir; this user's only
        self.sock_dir = Path(tempfile.gettempdir()) / f"crl-{run_id}"
        self.sock_dir.mkdir(mode=0o700, parents=True)
        os.chmod(self.sock_dir, 0o700)  # whatever the umask
        cfg.run_id = run_id
        # the run's CURVE keys (protocol/auth.py): every tcp socket of the run, this process's first; the file
        # is 0600 and config.yaml holds its path only. Without CURVE in libzmq (and no host) there are no tcp
        # endpoints but the stream transport's, which then stays plain, as with auth=false.
        cfg.auth_keys = ""
        if cfg.get("auth", True) and auth.curve_available() and not inline:
            cfg.auth_keys = str(auth.RunKeys.generate().write(self.run_dir / auth.KEY_FILE))
        auth.install_from_config(cfg)
        # who starts the processes (supervisor/launchers/): ray joins its cluster here, and gives the run its host
        self.launcher = make_launcher(cfg)
        try:
            self.launcher.connect()
            cfg.host = self.launcher.host()
            self._endpoints(cfg, run_id, inline)
        except BaseException:  # a placement that failed: what was placed is given back
            self.launcher.close()
            shutil.rmtree(self.sock_dir, ignore_errors=True)
            raise
        cfg.model.path = str(Path(cfg.model.path).resolve())
        if judge.needed(cfg):  # the verifiers read the served judge's URL from config.yaml
            judge.assign_port(cfg.verifier.judge)
        self.cfg = cfg
        self.config_path = self.run_dir / "config.yaml"
        self.config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        self.ctx = zmq.Context.instance()
        self.beats = self.ctx.socket(zmq.PULL)
        auth.bind(self.beats, cfg.endpoints.heartbeat)
        self.control = self.ctx.socket(zmq.REP)
        auth.bind(self.control, cfg.endpoints.control)
        self.procs: dict[str, Proc] = {}
        self.retired: list[dict] = []  # workers a swap replaced, as they last reported
        self.verifier_impls: dict[str, str] = {}  # domain -> verifier name, as swaps set them
        self.started = time.monotonic()
        self.stop_requested = False
        self.stall = StallWatch(cfg.orchestrator.stall_timeout_s)
        info = {"pid": os.getpid(), "control": cfg.endpoints.control, "run_dir": str(self.run_dir),
                "auth_keys": cfg.auth_keys}  # ctl reads the key file (same user) to reach the control socket
        (self.run_dir / "supervisor.json").write_text(json.dumps(info))
        state_dir().mkdir(parents=True, exist_ok=True)
        (state_dir() / "latest_run").write_text(str(self.run_dir))

    def _endpoints(self, cfg: DictConfig, run_id: str, inline: bool) -> None:
        """The run's four sockets: inproc with --inline, tcp on ``host`` (a Ray run: the orchestrator's and the
        trainer's on the nodes they were placed on), else ipc under the run's socket folder."""
        names = ("orchestrator", "weights", "heartbeat", "control")
        if inline:  # one process, one ZeroMQ context: in memory
            endpoints = {name: f"inproc://{run_id}/{name}" for name in names}
        elif cfg.host:  # tcp: reachable from other hosts / network namespaces
            endpoints = {name: f"tcp://{cfg.host}:{port}" for name, port in zip(names, free_ports(len(names)))}
        else:
            endpoints = {name: f"ipc://{self.sock_dir}/{name}" for name in names}
        if cfg.launcher == "ray":  # the two that bind elsewhere: placed now, on their nodes' addresses
            for name, worker_id, role, ranks in (("orchestrator", "orchestrator", "orchestrator", 1),
                                                 ("weights", "trainer-0", "trainer", cfg.trainer.world_size)):
                ip, port = self.launcher.address_of(worker_id, role, ranks)
                endpoints[name] = f"tcp://{ip}:{port}"
        cfg.endpoints.update(endpoints)

    # ------------------------------------------------------------------ processes

    def spawn(self, proc: Proc) -> None:
        if self.inline and not proc.cmd:  # a server (the judge's) is a process of its own with --inline too
            proc.handle = ThreadProc(MODULES[proc.role], ["--config", str(self.config_path), "--worker-id",
                                                          proc.worker_id, *proc.args], proc.worker_id)
            proc.state, proc.last_beat = "starting", time.monotonic()
            return
        # PYTHONSAFEPATH (python -P): never put the cwd on sys.path, in this process's children and
        # theirs (torchrun's ranks): a checkout's top-level verifiers/ or kernels/ folders would shadow
        # the PyPI packages of those names
        env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONSAFEPATH": "1"}
        if self.cfg.launcher == "local":  # Ray gives each process its GPUs itself
            env.update(placement.cuda_env(proc.gpus))
        cmd = proc.cmd or ["python", "-P", "-m", MODULES[proc.role], "--config", str(self.config_path),
                           "--worker-id", proc.worker_id, *proc.args]
        proc.handle = self.launcher.spawn(Start(
            proc.worker_id, proc.role, cmd, env, str(self.run_dir / "logs" / f"{proc.worker_id}.log"),
            ranks=self.cfg.trainer.world_size if proc.role == "trainer" else 1,
            prefix=list(self.cfg.sampler.launcher) if proc.role == "sampler" else []))  # a netns, another host
        proc.state, proc.last_beat = "starting", time.monotonic()

    def start(self) -> None:
        """Start every role's processes; a served judge first, healthy before the verifiers (it loads while the
        trainer, samplers, environments and teachers do). Raises ``JudgeStartError`` when it never answers."""
        served = self.add(judge.judge_proc(self.cfg)) if judge.needed(self.cfg) else None
        self.add(Proc("orchestrator", "orchestrator"))
        self.add(Proc("trainer", "trainer-0", gpus=placement.gpus_of(self.cfg, "trainer")))
        for i in range(self.cfg.sampler.count):
            self.add_sampler(f"sampler-{i}", i)
        for i in range(self.cfg.environment.count if self.cfg.environment.serve else 0):
            self.add(Proc("environment", f"environment-{i}"))
        for i, (path, domains) in enumerate(teacher_groups(self.cfg.teacher.checkpoints).items()):
            self.add(Proc("teacher", f"teacher-{i}", args=["--model", path, "--domains", ",".join(domains)],
                          gpus=placement.gpus_of(self.cfg, "teacher", i)))
        if served is not None:
            judge.wait_healthy(self.cfg.verifier.judge.base_url, self.cfg.verifier.judge.startup_s,
                               lambda: served.handle.poll(), self.run_dir / "logs" / "judge.log",
                               tick=lambda: self.serve(timeout_ms=200))
            served.state = "serving"
        for i in range(self.cfg.verifier.count):
            self.add(Proc("verifier", f"verifier-{i}"))

    def add(self, proc: Proc) -> Proc:
        self.procs[proc.worker_id] = proc
        try:
            self.spawn(proc)
        except LaunchError:  # not placed (launcher=ray): not a worker of the run
            del self.procs[proc.worker_id]
            raise
        return proc

    def add_sampler(self, worker_id: str, slot: int) -> None:
        for proc in sampler_procs(self.cfg, worker_id, slot):
            self.add(proc)

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
        """Check every process once; returns 'running', 'done' or a failure reason."""
        now = time.monotonic()
        sup = self.cfg.supervisor
        self._retire()
        for p in self.procs.values():
            if p.draining:
                continue
            if p.handle is None:
                if now >= p.restart_at:
                    try:
                        self.spawn(p)
                    except LaunchError as e:  # no room on the cluster now (launcher=ray): retried with the backoff
                        if p.restarts >= sup.max_restarts:
                            return f"{p.worker_id} could not be placed again: {e}"
                        p.state, p.restart_at = "unplaced", now + sup.restart_backoff_s * 2**p.restarts
                        p.restarts += 1
                continue
            rc = p.handle.poll()
            if p.role == "judge" and rc is None and p.state == "starting":  # restarted: serving once healthy
                p.state = "serving" if judge.healthy(self.cfg.verifier.judge.base_url, 0.2) else p.state
            if p.role == "orchestrator" and rc is not None:
                return "done" if rc == 0 else f"orchestrator exited with code {rc} (see logs/orchestrator.log)"
            if p.role == "trainer" and rc is not None:  # a fresh trainer would restart at version 0: resume instead
                return (f"trainer exited with code {rc} (see logs/trainer-0.log); continue from the last checkpoint "
                        f"with: cascade-rl launch ... run_dir={self.run_dir} resume=true")
            silent = p.role not in SERVER_ROLES and now - p.last_beat > sup.heartbeat_timeout_s
            if rc is None and not silent:
                continue
            if rc is None or p.role in SERVER_ROLES:  # hung; or a server whose children outlive it (vLLM's engine)
                p.handle.kill()
            if p.serves in self.procs and self.procs[p.serves].handle is not None:
                self.procs[p.serves].handle.kill()  # a fresh server has the base weights: so must its sampler
            if p.restarts >= sup.max_restarts or (self.inline and not p.cmd):  # inline: the traceback is the answer
                return f"{p.worker_id} failed {p.restarts + 1} times (see logs/{p.worker_id}.log)"
            p.state = ("lost" if getattr(p.handle, "lost", "") else f"exited({rc})") if rc is not None else "hung"
            p.handle = None
            p.restart_at = now + sup.restart_backoff_s * 2**p.restarts
            p.restarts += 1
        if sup.timeout_s and now - self.started > sup.timeout_s:
            return f"run exceeded supervisor.timeout_s={sup.timeout_s}"
        if self.stop_requested:
            return "stopped by ctl stop"
        return "running"

    def _retire(self) -> None:
        """Swaps in progress: once a retiring worker's replacements all run, SIGTERM it (it drains: finishes
        what it holds, tells the orchestrator it takes no more, exits 0); once it has exited, drop it."""
        for p in list(self.procs.values()):
            if p.replaced_by and not p.draining and all(
                    self.procs[r].state == "running" for r in p.replaced_by if r in self.procs):
                if p.handle is not None and p.handle.poll() is None:
                    p.handle.terminate()
                p.draining, p.state = True, "draining"
            if p.draining and (p.handle is None or p.handle.poll() is not None):
                self.retired.append({**p.row(), "state": f"retired({p.handle.returncode if p.handle else None})"})
                del self.procs[p.worker_id]
                for server in [q for q in self.procs.values() if q.serves == p.worker_id]:  # its SGLang server
                    if server.handle is not None:
                        server.handle.kill()
                    del self.procs[server.worker_id]

    def scale(self, role: str, count: int) -> dict:
        """Run ``count`` workers of ``role`` (samplers): start new ones (they get the current weights from the
        orchestrator before any work), or drain the newest ones (they finish what they hold, then exit)."""
        if role not in ("sampler", "verifier") or count < 1:
            raise ValueError(f"scale wants samplers=N or verifiers=N with N >= 1, got {role}s={count}")
        live = [p for p in self.procs.values() if p.role == role and not p.draining and not p.replaced_by]
        started, draining = [], []
        taken = {int(w.split("-")[-1]) for w in [*self.procs, *(r["id"] for r in self.retired)]
                 if w.startswith(f"{role}-")}
        for i in range(count - len(live)):
            worker_id = f"{role}-{max(taken | {-1}) + 1 + i}"
            if role == "sampler":  # on the first free entry of gpus.samplers, with its server if the engine has one
                self.add_sampler(worker_id, self.free_sampler_slot())
            else:
                self.add(Proc(role, worker_id, args=list(live[0].args if live else [])))
            started.append(worker_id)
        for p in live[count:][::-1] if len(live) > count else []:
            if p.handle is not None and p.handle.poll() is None:
                p.handle.terminate()
            p.draining, p.state = True, "draining"
            draining.append(p.worker_id)
        return {"started": started, "draining": draining, role + "s": count}

    def swap(self, role: str, domain: str, impl: str) -> dict:
        """Replace the workers of ``role`` serving ``domain`` by as many new ones that score it with ``impl``."""
        if role != "verifier":
            raise ValueError(f"swap supports verifiers, not {role!r}")
        if domain not in self.cfg.verifier.domains:
            raise ValueError(f"no verifier serves domain {domain!r} (served: {list(self.cfg.verifier.domains)})")
        from cascade_rl.verifiers.registry import GROUP_VERIFIERS, VERIFIERS

        if impl not in VERIFIERS and impl not in GROUP_VERIFIERS:
            raise ValueError(f"no verifier named {impl!r} (registered: {sorted(set(VERIFIERS) | set(GROUP_VERIFIERS))})")
        old = [p for p in self.procs.values() if p.role == "verifier" and not p.replaced_by and not p.draining]
        self.verifier_impls[domain] = impl
        args = [a for d, name in self.verifier_impls.items() for a in ("--impl", f"{d}={name}")]
        taken = {int(w.split("-")[-1]) for w in [*self.procs, *(r["id"] for r in self.retired)] if w.startswith("verifier-")}
        started = []
        for i in range(len(old)):
            n = max(taken | {-1}) + 1 + i
            proc = Proc("verifier", f"verifier-{n}", args=args)
            self.procs[proc.worker_id] = proc
            self.spawn(proc)
            started.append(proc.worker_id)
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
            if p.role in SERVER_ROLES:  # another project's children (vLLM's engine core) must not outlive the run
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
        while self.beats in events and self.beats.poll(0):
            try:
                self._on_beat(recv(self.beats, (Heartbeat,)))
            except ProtocolError:
                pass
        if self.control in events:
            try:
                reply = self._on_control(recv(self.control, (Control,)))
            except ProtocolError as e:
                reply = ControlReply(False, None, str(e))
            send(self.control, reply)

    def _last_beats(self, quiet_ms: int = 200) -> None:
        """The beats the workers sent as they stopped, with their final counters: without them summary.json's table
        held each worker's last periodic beat, up to a second of scores short."""
        while self.beats.poll(quiet_ms):
            try:
                self._on_beat(recv(self.beats, (Heartbeat,)))
            except ProtocolError:
                pass

    def _on_beat(self, hb: Heartbeat) -> None:
        p = self.procs.get(hb.worker_id)
        remote = p is not None and p.role == "sampler" and bool(self.cfg.sampler.launcher)
        if p is None or p.handle is None or (p.handle.pid != hb.pid and not remote):
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
        return [p.row() for p in self.procs.values()] + self.retired

    def report_stall(self, display: Display) -> None:
        """When the orchestrator's waits have stopped completing: stall.txt, and where to read it (supervisor/stall.py)."""
        now, orchestrator = time.monotonic(), self.procs["orchestrator"].counters
        if not self.stall.stalled(orchestrator, now):
            return
        rows = [{**p.row(), "beat_age_s": now - p.last_beat if p.handle else None} for p in self.procs.values()]
        text = stall.report(rows, orchestrator, self.stall.stalled_for(now), self.stall.timeout_s,
                            self.run_dir / "logs")
        (self.run_dir / "stall.txt").write_text(text)
        display.notice("\n".join(text.splitlines()[:2]) + f"\n(every worker and a stack dump of each process: "
                       f"{self.run_dir / 'stall.txt'})")

    # ------------------------------------------------------------------ main loop

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
        except KeyboardInterrupt:
            outcome = "interrupted"
        except (judge.JudgeStartError, LaunchError) as e:  # the judge never answered, a worker has no place:
            outcome = str(e)  # the launch fails with why; everything started stops
        finally:
            self.stop_all()
            self._last_beats()
            for s in (self.beats, self.control):
                s.close(linger=0)
        summary_path = self.run_dir / "summary.json"
        if outcome == "done" and summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            summary["restarts"] = {p.worker_id: p.restarts for p in self.procs.values()}
            summary["workers"] = self.table()  # final counters of every worker, retired ones included
            summary_path.write_text(json.dumps(summary, indent=2))
            display.final(summary)
            return 0
        display.failed(outcome)
        return 1

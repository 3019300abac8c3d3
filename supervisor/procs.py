"""The processes of a run: each role's policy (what it runs, how it is watched), a process's record, how one starts.

The supervisor (supervisor/launch.py) keeps one ``Proc`` per process it started and treats each by its role's
entry of ``ROLES``; ``sampler_procs`` says which processes make one sampler (with the sglang engine, its server
too); ``worker_command`` is the command line of a worker (the launchers run it as is).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cascade_rl.protocol import exits
from cascade_rl.weights import adapters

from . import placement
from .recovery import SHOW_FAILURES, Failure, in_window

# the environment of every process the supervisor starts. PYTHONSAFEPATH (python -P): never put the cwd on
# sys.path, in its children and theirs (torchrun's ranks): a checkout's top-level verifiers/ or kernels/ folders
# would shadow the PyPI packages of those names
WORKER_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONSAFEPATH": "1"}


@dataclasses.dataclass(frozen=True)
class Role:
    """How the supervisor runs and watches the processes of one role. A crash is restarted with the backoff, up to
    ``supervisor.max_restarts`` times within ``supervisor.restart_window_s`` (supervisor/recovery.py)."""

    module: str = ""  # what a worker runs (python -m MODULE); "": a server, started by its own command (Proc.cmd)
    # an exit that ends the run: (exit code, run_dir) -> the outcome, "" for a fault the supervisor recovers from
    ends_run: Callable[[int, Path], str] | None = None
    ready: Callable[[Any], bool] | None = None  # a server: "serving" once this holds of the config

    @property
    def server(self) -> bool:
        """Not our worker: no heartbeats, watched by its exit alone, and killed (its children with it: vLLM's
        engine core outlives its server) whenever it exits, hangs up or the run stops."""
        return not self.module


def resume_hint(run_dir: Path) -> str:
    return f"continue from the last checkpoint with: cascade-rl launch ... run_dir={run_dir} resume=true"


def _disk_full(role: str, run_dir: Path) -> str:
    import shutil

    free = shutil.disk_usage(run_dir).free
    return (f"{role}: no space left on the disk of run_dir={run_dir} ({free / 2**20:.1f} MiB free now; see "
            f"logs/{role}.log). The checkpoints and the ledger written before are whole: free space (or move "
            f"run_dir), then {resume_hint(run_dir)}")


def _run_outcome(rc: int, run_dir: Path) -> str:
    """The orchestrator's exit is the run's: 0 done, 1 (an error it raised: bad data, no group survived the refills)
    failed, a full disk stopped; killed (a signal): "", the supervisor rewinds the data plane and goes on."""
    if rc == 0:
        return "done"
    if rc == exits.DISK_FULL:
        return _disk_full("orchestrator", run_dir)
    return f"orchestrator exited with code {rc} (see logs/orchestrator.log)" if rc == exits.FAILED else ""


def _trainer_outcome(rc: int, run_dir: Path) -> str:
    """The trainer stops only with the run: a full disk stops the run; any other death rewinds the data plane to
    the newest checkpoint (counted against its restart budget, so an error that repeats fails the run)."""
    return _disk_full("trainer-0", run_dir) if rc == exits.DISK_FULL else ""


def _judge_answers(cfg) -> bool:
    from .judge import healthy  # judge.py imports this module

    return healthy(cfg.verifier.judge.base_url, 0.2)


ROLES = {
    "orchestrator": Role("cascade_rl.orchestrator.main", ends_run=_run_outcome),
    "trainer": Role("cascade_rl.learner.trainer", ends_run=_trainer_outcome),
    "sampler": Role("cascade_rl.samplers.worker"),
    "verifier": Role("cascade_rl.verifiers.worker"),
    "teacher": Role("cascade_rl.teachers.server"),
    "environment": Role("cascade_rl.environments.worker"),
    "gateway": Role("cascade_rl.gateway.server"),  # the agents' OpenAI-compatible gateway (supervisor/gateway_setup.py)
    "sglang": Role(),  # one sampler's SGLang server (sampler_procs)
    "judge": Role(ready=_judge_answers),  # the judge model's server (supervisor/judge.py: ours or vLLM's)
}
SERVER_ROLES = {name for name, role in ROLES.items() if role.server}


def teacher_groups(teachers) -> dict[str, dict[str, str]]:
    """MOPD teachers by server: {the model a teacher server loads: {domain: LoRA checkpoint, or "" (the model
    itself)}}. One server per distinct full checkpoint; the checkpoints that are LoRA adapters (peft's
    adapter_config.json) of one base share one server, which holds the base once and one adapter per checkpoint
    (teachers/server.py), with the base's own domains if the base teaches some too."""
    groups: dict[str, dict[str, str]] = {}
    for domain, path in sorted(teachers.items()):
        path = Path(path).resolve()
        if adapters.is_adapter(path):
            base = adapters.base_of(path)
            base = str(Path(base).resolve()) if Path(base).is_dir() else base  # missing: the server says so
            groups.setdefault(base or str(path), {})[domain] = str(path) if base else ""
        else:
            groups.setdefault(str(path), {})[domain] = ""
    return groups


def teacher_args(model: str, heads: dict[str, str]) -> list[str]:
    """A teacher server's command line (``teacher_groups``' model and heads)."""
    return ["--model", model, "--domains", ",".join(heads),
            *(a for d, p in heads.items() if p for a in ("--adapter", f"{d}={p}"))]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervisor dies, however it dies (Linux); and start with
    SIGUSR1 ignored (an ignored signal stays ignored across exec), so a stall report's stack-dump request cannot
    kill a process that has not yet registered its dump (``worker_start``)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the supervisor's own SIGTERM handler still stops the workers


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free now (the OS picks them; held together so they differ)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def state_dir() -> Path:
    """Where the supervisor records the newest run (for ``ctl`` without --run-dir)."""
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return base / "cascade-rl"


@dataclasses.dataclass
class Proc:
    role: str
    worker_id: str
    handle: Any = None  # what the launcher returned (supervisor/launchers/: a Popen's, a Ray actor's); None: not running
    restarts: int = 0
    failures: list[Failure] = dataclasses.field(default_factory=list)  # each death, newest last (recovery.py)
    restart_at: float = 0.0
    last_beat: float = 0.0
    state: str = "starting"
    version: int = 0
    counters: dict = dataclasses.field(default_factory=dict)
    args: list[str] = dataclasses.field(default_factory=list)  # extra arguments (a verifier's --impl)
    gpus: tuple[int, ...] = ()  # config ids of the GPUs it sees (supervisor/placement.py); () = the CPU
    cmd: list[str] = dataclasses.field(default_factory=list)  # a server's own command (SERVER_ROLES)
    ranks: int = 1  # processes it runs as (the trainer: trainer.world_size, one per rank)
    prefix: list[str] = dataclasses.field(default_factory=list)  # a sampler's sampler.launcher (a netns, ssh)
    serves: str = ""  # a server: the worker that uses it (restarted with it, so it reloads the weights)
    slot: int = 0  # a sampler: its entry of gpus.samplers
    replaced_by: list[str] = dataclasses.field(default_factory=list)  # a swap retires this once they run
    draining: bool = False  # SIGTERM sent: it finishes what it holds and exits; never restarted

    def row(self, window_s: float = 0.0) -> dict:
        """Its row of ``ctl status``: ``failures`` are those of the last ``window_s`` (the restart window)."""
        now = time.monotonic()
        return {
            "role": self.role,
            "id": self.worker_id,
            "pid": self.handle.pid if self.handle else None,
            "node": self.handle.node if self.handle else "",
            "state": self.state,
            "version": self.version,
            "restarts": self.restarts,
            "failures": [f.row(now) for f in in_window(self.failures, now, window_s)][-SHOW_FAILURES:],
            "counters": self.counters,
            "gpus": list(self.gpus),
        }


def worker_command(proc: Proc, config_path: Path) -> list[str]:
    """The command line of ``proc``: a server's own, else its role's module on the run's config.yaml."""
    return proc.cmd or ["python", "-P", "-m", ROLES[proc.role].module, *worker_argv(proc, config_path)]


def worker_argv(proc: Proc, config_path: Path) -> list[str]:
    """A worker's arguments (its ``main(argv)``'s, with --inline)."""
    return ["--config", str(config_path), "--worker-id", proc.worker_id, *proc.args]


def next_ids(role: str, existing: Iterable[str], n: int) -> list[str]:
    """``n`` new worker ids of ``role``, numbered after every id of ``existing`` (live and retired workers), so
    no two workers of a run, nor their logs, share an id."""
    taken = {int(w.split("-")[-1]) for w in existing if w.startswith(f"{role}-")}
    first = max(taken | {-1}) + 1
    return [f"{role}-{first + i}" for i in range(n)]


def sampler_procs(cfg, worker_id: str, slot: int, port: int | None = None) -> list[Proc]:
    """The processes of one sampler on entry ``slot`` of gpus.samplers: the sampler on that GPU; with the
    sglang engine (and no sampler.sglang.url), first an SGLang server on that GPU, and the sampler, which then
    holds no model, on none, told the server's URL."""
    gpus = placement.gpus_of(cfg, "sampler", slot)
    sg = cfg.sampler.sglang
    prefix = list(cfg.sampler.launcher)
    if cfg.sampler.engine != "sglang" or sg.url:
        return [Proc("sampler", worker_id, gpus=gpus, slot=slot, prefix=prefix)]
    from cascade_rl.samplers.sglang_engine import server_command

    port = port or (sg.port + slot if sg.port else free_ports(1)[0])
    server = Proc("sglang", f"sglang-{worker_id.split('-')[-1]}", gpus=gpus, cmd=server_command(cfg, port),
                  serves=worker_id)
    return [server, Proc("sampler", worker_id, args=["--engine-url", f"http://127.0.0.1:{port}"], slot=slot,
                         prefix=prefix)]

"""The processes of a run: which module each role runs, a process's record, and how one is started.

The supervisor (supervisor/launch.py) keeps one ``Proc`` per process it started; ``sampler_procs`` says which
processes make one sampler (with the sglang engine, its server too).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

from . import placement

MODULES = {
    "orchestrator": "cascade_rl.orchestrator.main",
    "trainer": "cascade_rl.learner.trainer",
    "sampler": "cascade_rl.samplers.worker",
    "verifier": "cascade_rl.verifiers.worker",
    "teacher": "cascade_rl.teachers.server",
    "environment": "cascade_rl.environments.worker",
}
# processes that are not our workers (no heartbeats, watched by their exit alone): SGLang servers, and the judge
# model's server (supervisor/judge.py: samplers/chat_server.py or vLLM's)
SERVER_ROLES = {"sglang", "judge"}


def teacher_groups(teachers) -> dict[str, list[str]]:
    """MOPD teachers by checkpoint: one teacher server per distinct checkpoint, serving its domains."""
    by_path: dict[str, list[str]] = {}
    for domain, path in sorted(teachers.items()):
        by_path.setdefault(str(Path(path).resolve()), []).append(domain)
    return by_path


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
    restart_at: float = 0.0
    last_beat: float = 0.0
    state: str = "starting"
    version: int = 0
    counters: dict = dataclasses.field(default_factory=dict)
    args: list[str] = dataclasses.field(default_factory=list)  # extra arguments (a verifier's --impl)
    gpus: tuple[int, ...] = ()  # config ids of the GPUs it sees (supervisor/placement.py); () = the CPU
    cmd: list[str] = dataclasses.field(default_factory=list)  # a server's own command (SERVER_ROLES)
    serves: str = ""  # a server: the worker that uses it (restarted with it, so it reloads the weights)
    slot: int = 0  # a sampler: its entry of gpus.samplers
    replaced_by: list[str] = dataclasses.field(default_factory=list)  # a swap retires this once they run
    draining: bool = False  # SIGTERM sent: it finishes what it holds and exits; never restarted

    def row(self) -> dict:
        return {
            "role": self.role,
            "id": self.worker_id,
            "pid": self.handle.pid if self.handle else None,
            "node": self.handle.node if self.handle else "",
            "state": self.state,
            "version": self.version,
            "restarts": self.restarts,
            "counters": self.counters,
            "gpus": list(self.gpus),
        }


def sampler_procs(cfg, worker_id: str, slot: int, port: int | None = None) -> list[Proc]:
    """The processes of one sampler on entry ``slot`` of gpus.samplers: the sampler on that GPU; with the
    sglang engine (and no sampler.sglang.url), first an SGLang server on that GPU, and the sampler, which then
    holds no model, on none, told the server's URL."""
    gpus = placement.gpus_of(cfg, "sampler", slot)
    sg = cfg.sampler.sglang
    if cfg.sampler.engine != "sglang" or sg.url:
        return [Proc("sampler", worker_id, gpus=gpus, slot=slot)]
    from cascade_rl.samplers.sglang_engine import server_command

    port = port or (sg.port + slot if sg.port else free_ports(1)[0])
    server = Proc("sglang", f"sglang-{worker_id.split('-')[-1]}", gpus=gpus, cmd=server_command(cfg, port),
                  serves=worker_id)
    return [server, Proc("sampler", worker_id, args=["--engine-url", f"http://127.0.0.1:{port}"], slot=slot)]

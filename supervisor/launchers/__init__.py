"""Who starts a run's processes: this machine's process table (``local``) or a Ray cluster (``ray``).

    launcher = LAUNCHERS[cfg.launcher](cfg)        # registered by name; launcher=local|ray
    launcher.connect()                              # ray: join the cluster, give the run its tcp host
    handle = launcher.spawn(Start(...))             # one worker (the trainer: all its ranks)
    handle.poll(), handle.terminate(), handle.kill(), handle.node

The supervisor (supervisor/launch.py) decides what runs and when; a launcher decides where and how. Every
launcher starts the same worker command (``python -P -m MODULE --config RUN_DIR/config.yaml --worker-id ID``)
and returns a handle with the parts of ``subprocess.Popen`` the supervisor reads, so its restart policy, drains
and swaps are the same on one machine and on a cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class LaunchError(RuntimeError):
    """A launcher cannot start a worker (no room on the cluster, a node that cannot see the run): the message
    says what to change; the run stops with it."""


@dataclasses.dataclass
class Start:
    """One process (or the trainer's ranks) to start."""

    worker_id: str
    role: str
    cmd: list[str]  # the worker's command; ``python`` is the interpreter of wherever it runs
    env: dict[str, str]  # set on top of the launcher's environment
    log_path: str
    ranks: int = 1  # the trainer's world size: one process per rank
    prefix: list[str] = dataclasses.field(default_factory=list)  # local: a command prefix (a netns, ssh)


class Handle(Protocol):
    pid: int | None  # the worker's (rank 0's) pid on its node; None until it runs
    node: str  # where it runs: "" on this machine, else the node's address
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...

    def terminate(self) -> None: ...  # SIGTERM to its process group: it drains and exits

    def kill(self) -> None: ...  # SIGKILL to its process group, then reap it


def _local():
    from .local import LocalLauncher

    return LocalLauncher


def _ray():
    from .ray_launcher import RayLauncher

    return RayLauncher


# name -> the launcher class, imported when chosen (Ray only where it is used)
LAUNCHERS = {"local": _local, "ray": _ray}


def make_launcher(cfg):
    return LAUNCHERS[cfg.get("launcher", "local")]()(cfg)

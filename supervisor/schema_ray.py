"""The ``launcher`` choice and the ``ray`` section of the launch schema: where each process of a run is placed
when the supervisor starts it on a Ray cluster (supervisor/launchers/ray_launcher.py); every field documented
where it is declared.

    cascade-rl launch tiny launcher=ray ray.address=HEAD:6379 weights_transport=stream \
        'ray.sampler.labels=[{pool: rollout}, {}]' ray.trainer.gpus=1 trainer.world_size=8
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class LauncherName(StrEnum):
    """``launcher``: who starts the run's processes (supervisor/launchers/)."""

    local = "local"  # child processes of the supervisor, on its machine (torchrun for a multi-rank trainer)
    ray = "ray"  # Ray actors placed on a running Ray cluster, each starting the same worker process


class Strategy(StrEnum):
    """``ray.trainer_strategy``: Ray's placement-group strategy for the trainer's ranks (one bundle per rank)."""

    PACK = "PACK"  # as few nodes as possible, more if one cannot hold them all
    SPREAD = "SPREAD"  # across nodes where possible
    STRICT_PACK = "STRICT_PACK"  # one node, or wait
    STRICT_SPREAD = "STRICT_SPREAD"  # one rank per node, or wait


@dataclass
class RayRole:
    """What one process of a role reserves on its node, and which nodes may hold it. The process's threads are
    the config's (``sampler.threads``...), as with the local launcher: the reservation only places it."""

    cpus: float = 1.0
    """Ray CPUs reserved per process (logical: they place, they do not pin)."""
    gpus: float = 0.0
    """GPUs per process (a fraction shares one: pair with ``gpus.memory``); Ray sets the process's
    CUDA_VISIBLE_DEVICES and the role runs on cuda (trainer: per rank)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per process, e.g. {rollout_slot: 1} (nodes declare them: ``ray start --resources``)."""
    labels: list[dict[str, str]] = field(default_factory=list)
    """Node label selectors in order of preference (nodes declare labels: ``ray start --labels k=v``): each
    placement takes the first one some live node matches, so [{pool: rollout}, {}] prefers the rollout nodes
    and falls back to any node when none is left. Empty: any node."""


def _role(cpus: float = 1.0) -> RayRole:
    return RayRole(cpus=cpus)


@dataclass
class RayConfig:
    """The Ray cluster a ``launcher=ray`` run is placed on and what each role reserves there. Every node must
    see the run directory, the model and the data at the same paths (a shared file system, as under Slurm), and
    run the same Python environment; ZeroMQ stays the data plane between the placed processes."""

    address: str = "auto"
    """The cluster: ``auto`` (RAY_ADDRESS, else the cluster started on this machine) or HOST:PORT of its head."""
    placement_timeout_s: float = 120.0
    """How long a placement may wait for room on the cluster before the launch (or ``ctl scale``) fails with
    what it asked for and what the nodes hold."""
    suspect_s: float = 60.0
    """A node where a worker's host was lost (its node died or is dying) takes no new placement this long while
    another node can; Ray itself declares a node dead only after its missed health checks (~15 s)."""
    trainer_strategy: Strategy = Strategy.PACK
    """How the trainer's ranks spread over nodes (one placement group, one bundle per rank)."""
    orchestrator: RayRole = field(default_factory=_role)
    """The orchestrator process."""
    trainer: RayRole = field(default_factory=_role)
    """Each trainer rank (``trainer.world_size`` of them; rank 0 publishes the weights)."""
    sampler: RayRole = field(default_factory=_role)
    """Each sampler."""
    verifier: RayRole = field(default_factory=_role)
    """Each verifier worker (its scoring pool's processes share the reservation)."""
    teacher: RayRole = field(default_factory=_role)
    """Each MOPD teacher server."""
    environment: RayRole = field(default_factory=_role)
    """Each environment worker of multi-turn rows."""

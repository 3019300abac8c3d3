"""A launch plan: everything a run decides before its first process starts, and every refusal of the launch.

    plan = prepare(cfg)                # ConfigError, BadData or LaunchError: refused, nothing started
    plan.cfg.endpoints.control         # ipc:// under plan.sock_dir, tcp:// on ``host``, inproc:// with --inline
    plan.procs, plan.after_judge       # the processes to start, in order; the second list once a served judge answers
    plan.config_yaml                   # what <run_dir>/config.yaml holds: every worker reads it

``prepare`` resolves the config in place, in this order: ``run_dir`` absolute (its ``logs/`` made); what
``--inline`` cannot run (supervisor/inline.py); the data (supervisor/run_data.py: every row validated, written to
``run_dir/data``, the served domains settled); what this machine must offer the config (``MACHINE_CHECKS``: the GPU
layout of supervisor/placement.py, SGLang's servers, CURVE for tcp endpoints); the run id and the socket folder (ipc
paths must stay under ~100 bytes, so a short temp dir, mode 0700); the run's CURVE keys (protocol/auth.py:
``run_dir/auth.keys``, mode 0600, config.yaml holds its path only); the launcher (supervisor/launchers/: ray joins
its cluster and places the two workers that bind) and the run's four endpoints; the model's absolute path; a served
judge's port (supervisor/judge.py); the agents' gateway's URL and secret (supervisor/gateway_setup.py). It starts no
process and binds no socket, so tests build plans from the presets and inspect them. What a running supervisor is
asked (``ctl scale``, ``ctl swap``) is checked here too, before it touches a process: ``check_scale``,
``check_swap``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import zmq
from omegaconf import DictConfig, OmegaConf

from cascade_rl.data.prepare import Report
from cascade_rl.protocol import auth

from . import gateway_setup, judge, placement
from . import inline as inline_mode
from .config_errors import ConfigError
from .launchers import make_launcher
from .memory_report import seq_tokens
from .procs import Proc, free_ports, sampler_procs, teacher_args, teacher_groups
from .run_data import prepare_run_data

ENDPOINTS = ("orchestrator", "weights", "heartbeat", "control")  # the run's sockets (config.yaml ``endpoints``)
SCALABLE = ("sampler", "verifier")  # the roles ``ctl scale`` runs more or fewer of


@dataclasses.dataclass
class Plan:
    """A prepared launch: the resolved config and what follows from it."""

    cfg: DictConfig  # resolved: run id, endpoints, the key file's path, the served judge's URL filled in
    data: Report  # the data as written to run_dir/data (supervisor/run_data.py)
    launcher: object  # connected (supervisor/launchers/): who starts the processes, and where
    sock_dir: Path  # the ipc endpoints' folder (mode 0700); removed when the run stops
    procs: list[Proc]  # started first, in this order: the served judge (if any), then every worker but the verifiers
    after_judge: list[Proc]  # started once the served judge answers /health (at once without one): the verifiers
    judge: Proc | None  # the served judge's process (also first in ``procs``), or None
    config_yaml: str  # <run_dir>/config.yaml: the resolved config, as every worker reads it

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"


def prepare(cfg: DictConfig, inline: bool = False) -> Plan:
    """Resolve ``cfg`` (in place) into a launch plan; raises on the first refusal (module docstring: the order).
    ``inline``: every role a thread of this process (supervisor/inline.py)."""
    run_dir = Path(cfg.run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    if inline and (refused := inline_mode.problems(cfg)):
        raise ConfigError("; ".join(refused))
    cfg.inline = inline
    # before any socket or process: bad rows (BadData) or a config the data contradicts (ConfigError) refuse the
    # launch here, and the orchestrator opens what this wrote to run_dir/data
    data = prepare_run_data(cfg)
    for check in MACHINE_CHECKS:
        if refused := check(cfg):
            raise ConfigError(refused)
    cfg.run_id = uuid.uuid4().hex[:10]
    sock_dir = Path(tempfile.gettempdir()) / f"crl-{cfg.run_id}"  # this user's only
    sock_dir.mkdir(mode=0o700, parents=True)
    os.chmod(sock_dir, 0o700)  # whatever the umask
    cfg.auth_keys = run_keys(cfg, run_dir, inline)
    # the one process-wide effect of a plan: this process's sockets (the supervisor's, ray's placements) use them
    auth.install_from_config(cfg)
    launcher = make_launcher(cfg)
    try:  # ray joins its cluster here, gives the run its host and places the two workers that bind
        launcher.connect()
        cfg.host = launcher.host()
        cfg.endpoints.update(endpoints(cfg, sock_dir, inline, launcher))
    except BaseException:  # a placement that failed: what was placed is given back
        launcher.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    cfg.model.path = str(Path(cfg.model.path).resolve())
    if cfg.sampler.engine == "vllm" and not cfg.sampler.vllm.max_model_len:
        cfg.sampler.vllm.max_model_len = vllm_context(cfg)
    if judge.needed(cfg):  # the verifiers read the served judge's URL from config.yaml
        judge.assign_port(cfg.verifier.judge)
    if gateway_setup.needed(cfg):  # the orchestrator hands the gateway's URL to every agent
        gateway_setup.assign(cfg, run_dir)
    procs, after_judge, served = start_order(cfg)
    return Plan(cfg, data, launcher, sock_dir, procs, after_judge, served, OmegaConf.to_yaml(cfg, resolve=True))


def vllm_context(cfg: DictConfig) -> int:
    """vLLM's ``max_model_len`` when ``sampler.vllm.max_model_len`` is 0: the stage's longest row (prompt cap plus
    response, or the multi-turn budget), at most the model's own context. vLLM sizes its KV cache and checks that one
    row fits by it: the model's own (262,144 for Nemotron-3-Nano) would ask a 17K-token stage for a 256K row."""
    own = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("max_position_embeddings") or 0
    rows = seq_tokens(cfg)
    return min(rows, own) if own else rows


# ---------------------------------------------------------------------------------------------
# what this machine must offer the config: each check returns its refusal ("" if none)
# ---------------------------------------------------------------------------------------------

def gpu_layout(cfg: DictConfig) -> str:
    """A GPU layout this machine cannot hold (supervisor/placement.py)."""
    problems = placement.check(cfg, len(teacher_groups(cfg.teacher.checkpoints)), placement.visible_gpus())
    return "GPU layout:\n  " + "\n  ".join(problems) if problems else ""


def sglang_servers(cfg: DictConfig) -> str:
    """SGLang servers the supervisor would start (sampler.engine=sglang, no sampler.sglang.url) need SGLang and GPUs."""
    if cfg.sampler.engine != "sglang" or cfg.sampler.sglang.url:
        return ""
    from cascade_rl.samplers.sglang_engine import sglang_unavailable

    if reason := sglang_unavailable():
        return f"sampler.engine=sglang: {reason}"
    if not cfg.gpus.samplers:
        return "sampler.engine=sglang: the SGLang servers need GPUs: set gpus.samplers"
    return ""


def curve(cfg: DictConfig) -> str:
    """tcp endpoints (``host``, or a Ray run) with ``auth`` need CURVE in this libzmq."""
    if not (cfg.host or cfg.launcher == "ray") or not cfg.auth or auth.curve_available():
        return ""
    return (f"host={cfg.host or '(launcher=ray)'}: this libzmq ({zmq.zmq_version()}) has no CURVE security, so its tcp "
            f"endpoints would admit anyone who reaches them: install a pyzmq wheel (it bundles libsodium), or set "
            f"auth=false on a trusted network")


MACHINE_CHECKS = (gpu_layout, sglang_servers, curve)  # in this order; the first refusal is the launch's


# ---------------------------------------------------------------------------------------------
# keys, endpoints, processes
# ---------------------------------------------------------------------------------------------

def run_keys(cfg: DictConfig, run_dir: Path, inline: bool) -> str:
    """The run's CURVE key file, made anew (every tcp socket of the run admits only its holders), or "": with
    auth=false, --inline (no tcp socket) or a libzmq without CURVE (and no host: then the only tcp endpoints are
    the stream transport's, which stay plain, as with auth=false)."""
    if not cfg.auth or not auth.curve_available() or inline:
        return ""
    return str(auth.RunKeys.generate().write(run_dir / auth.KEY_FILE))


def endpoints(cfg: DictConfig, sock_dir: Path, inline: bool, launcher) -> dict[str, str]:
    """The run's four sockets: inproc with --inline (one process, one ZeroMQ context), tcp on ``host`` (reachable
    from other hosts and network namespaces; a Ray run: the orchestrator's and the trainer's on the nodes the
    launcher placed them on now), else ipc under the run's socket folder."""
    if inline:
        out = {name: f"inproc://{cfg.run_id}/{name}" for name in ENDPOINTS}
    elif cfg.host:
        out = {name: f"tcp://{cfg.host}:{port}" for name, port in zip(ENDPOINTS, free_ports(len(ENDPOINTS)))}
    else:
        out = {name: f"ipc://{sock_dir}/{name}" for name in ENDPOINTS}
    if cfg.launcher == "ray":  # the two that bind elsewhere: placed now, on their nodes' addresses
        for name, worker_id, role, ranks in (("orchestrator", "orchestrator", "orchestrator", 1),
                                             ("weights", "trainer-0", "trainer", cfg.trainer.world_size)):
            ip, port = launcher.address_of(worker_id, role, ranks)
            out[name] = f"tcp://{ip}:{port}"
    return out


def start_order(cfg: DictConfig) -> tuple[list[Proc], list[Proc], Proc | None]:
    """The run's processes: (started first, started once the served judge answers, the served judge). A served
    judge goes first (it loads while the trainer, samplers, environments and teachers do); the verifiers call it."""
    served = judge.judge_proc(cfg) if judge.needed(cfg) else None
    first = [served] if served else []
    first += [Proc("orchestrator", "orchestrator"),
              Proc("trainer", "trainer-0", gpus=placement.gpus_of(cfg, "trainer"), ranks=cfg.trainer.world_size)]
    for i in range(cfg.sampler.count):
        first += sampler_procs(cfg, f"sampler-{i}", i)
    first += [Proc("environment", f"environment-{i}") for i in range(cfg.environment.count if cfg.environment.serve else 0)]
    first += [Proc("gateway", "gateway-0")] if gateway_setup.needed(cfg) else []
    for i, (path, heads) in enumerate(teacher_groups(cfg.teacher.checkpoints).items()):
        first.append(Proc("teacher", f"teacher-{i}", args=teacher_args(path, heads),
                          gpus=placement.gpus_of(cfg, "teacher", i)))
    return first, [Proc("verifier", f"verifier-{i}") for i in range(cfg.verifier.count)], served


# ---------------------------------------------------------------------------------------------
# what a running supervisor is asked (cascade-rl ctl): refused here, before any process is touched
# ---------------------------------------------------------------------------------------------

def check_scale(role: str, count: int) -> None:
    """``ctl scale ROLEs=N``: ValueError unless ``role`` scales and ``count`` >= 1."""
    if role not in SCALABLE or count < 1:
        raise ValueError(f"scale wants samplers=N or verifiers=N with N >= 1, got {role}s={count}")


def check_swap(cfg: DictConfig, role: str, domain: str, impl: str) -> None:
    """``ctl swap ROLE DOMAIN IMPL``: ValueError unless verifiers serve ``domain`` and ``impl`` is registered."""
    if role != "verifier":
        raise ValueError(f"swap supports verifiers, not {role!r}")
    if domain not in cfg.verifier.domains:
        raise ValueError(f"no verifier serves domain {domain!r} (served: {list(cfg.verifier.domains)})")
    from cascade_rl.verifiers.registry import GROUP_VERIFIERS, VERIFIERS

    if impl not in VERIFIERS and impl not in GROUP_VERIFIERS:
        raise ValueError(f"no verifier named {impl!r} (registered: {sorted(set(VERIFIERS) | set(GROUP_VERIFIERS))})")

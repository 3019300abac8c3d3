"""The GPU plan: which GPUs each process of a run sees, and the layouts refused before launch.

    problems = check(cfg, teachers=2, visible=torch.cuda.device_count())    # [] or what to change
    gpus = gpus_of(cfg, "sampler", 1)                                          # (1,): sampler-1's GPUs
    env = cuda_env(gpus)                                                      # {"CUDA_VISIBLE_DEVICES": "1"}

The config's ``gpus`` section names, per role, the GPUs of its processes: the trainer's
ranks (``gpus.trainer``, one per rank), each sampler (``gpus.samplers[i]`` for the i-th
sampler slot) and each teacher server (``gpus.teachers[i]``). The supervisor starts every
process with exactly its GPUs visible (``CUDA_VISIBLE_DEVICES``; none for a process of a
role without GPUs, and for the orchestrator and verifiers), so inside the process they
are ``cuda:0..`` and protocol/devices.py ``role_device`` picks them from the same config.
Ids are the machine's, or positions in the supervisor's own ``CUDA_VISIBLE_DEVICES``
when it has one (a job scheduler's allocation).

Refused before any process starts, each with what to change:
- a GPU the machine does not have (or any GPU on a machine without CUDA);
- fewer GPUs than processes: trainer ranks, samplers, distinct teacher checkpoints;
- a GPU shared by several processes where a role on it has no ``gpus.memory`` share,
  or where the shares sum to more than 1;
- ``weights_transport=cuda_ipc`` (the samplers read the trainer's GPU buffers in place)
  with a trainer of more than one rank or without a GPU, a sampler not on the trainer's
  GPU, or an engine whose model is not in the sampler process (sglang);
- ``weights_transport=nccl`` over NCCL (a trainer on GPUs, ``backend`` auto or nccl) with a
  sampler without a GPU or on the GPU of the trainer's rank 0 (NCCL puts no two ranks of a
  group on one GPU), and ``backend=nccl`` with a trainer without a GPU.
"""

from __future__ import annotations

import os
from collections import defaultdict

from cascade_rl.protocol.devices import GPU_KEYS


def gpus_of(cfg, role: str, index: int = 0) -> tuple[int, ...]:
    """The GPUs of process ``index`` of ``role`` (the trainer's: all its ranks'); () runs on the CPU."""
    if role not in GPU_KEYS:
        return ()
    ids = [int(g) for g in cfg.gpus[GPU_KEYS[role]]]
    if role == "trainer" or not ids:
        return tuple(ids)
    if index >= len(ids):
        raise IndexError(f"{role}-{index} has no GPU: gpus.{GPU_KEYS[role]}={ids} names {len(ids)}")
    return (ids[index],)


def cuda_env(gpus: tuple[int, ...], visible: str | None = None) -> dict[str, str]:
    """The environment that makes ``gpus`` (config ids) a process's only devices; ``visible`` is the
    supervisor's own CUDA_VISIBLE_DEVICES (default: read from the environment), which config ids index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    return {"CUDA_VISIBLE_DEVICES": ",".join(names[g] if names else str(g) for g in gpus)}


def processes(cfg, teachers: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """worker id -> (role, GPUs) for every GPU-capable process the config can start: each trainer rank (one
    process per rank under torchrun), every listed sampler slot (scaling up may use all of them), every teacher."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rank, gpu in enumerate(cfg.gpus.trainer):
        out[f"trainer-0/rank{rank}"] = ("trainer", (int(gpu),))
    for i in range(len(cfg.gpus.samplers)):
        out[f"sampler-{i}"] = ("sampler", gpus_of(cfg, "sampler", i))
    for i in range(min(len(cfg.gpus.teachers), teachers)):
        out[f"teacher-{i}"] = ("teacher", gpus_of(cfg, "teacher", i))
    return out


def check(cfg, teachers: int, visible: int) -> list[str]:
    """What is wrong with the config's GPU layout on a machine with ``visible`` GPUs ([] if nothing)."""
    g, problems = cfg.gpus, []
    world, samplers = cfg.trainer.world_size, cfg.sampler.count
    if g.trainer and len(g.trainer) != world:
        problems.append(f"gpus.trainer={list(g.trainer)} names {len(g.trainer)} GPUs for trainer.world_size={world}: "
                        f"one GPU per rank")
    if len(set(g.trainer)) != len(g.trainer):
        problems.append(f"gpus.trainer={list(g.trainer)} names a GPU twice: one GPU per rank")
    if g.samplers and len(g.samplers) < samplers:
        problems.append(f"gpus.samplers={list(g.samplers)} names {len(g.samplers)} GPUs for sampler.count={samplers}"
                        f": one entry per sampler (an id may repeat, with gpus.memory.sampler)")
    if g.teachers and len(g.teachers) < teachers:
        problems.append(f"gpus.teachers={list(g.teachers)} names {len(g.teachers)} GPUs for {teachers} teacher "
                        f"checkpoints: one entry per distinct checkpoint")
    if bad := {k: v for k, v in g.memory.items() if not 0 <= float(v) <= 1}:
        problems.append(f"gpus.memory: shares must lie in [0, 1] (0: no cap), got {dict(bad)}")
    named = sorted({int(x) for key in GPU_KEYS.values() for x in g[key]})
    if named and visible == 0:
        problems.append(f"gpus.* names GPUs {named} but this machine has no CUDA device visible to torch: "
                        f"empty gpus.trainer/samplers/teachers to run on the CPU")
    elif missing := [x for x in named if not 0 <= x < visible]:
        problems.append(f"gpus.* names GPUs {missing} but this machine has {visible} (ids 0..{visible - 1}"
                        f"{', as CUDA_VISIBLE_DEVICES numbers them' if os.environ.get('CUDA_VISIBLE_DEVICES') else ''})")
    problems += _cuda_ipc(cfg) + _nccl(cfg)
    if problems:
        return problems
    return _sharing(cfg, processes(cfg, teachers))


IPC_ENGINES = ("torch", "vllm")  # engines whose model lives in the sampler process: they can read the trainer's buffer


def _cuda_ipc(cfg) -> list[str]:
    """``weights_transport=cuda_ipc`` maps the trainer's GPU buffers into each sampler: that needs one trainer
    process on one GPU, and every sampler process on that same GPU (each process sees only its own GPUs, so a
    sampler on another GPU could not open the handle) with an engine that loads in its own process."""
    if cfg.get("weights_transport") != "cuda_ipc":
        return []
    g, problems = cfg.gpus, []
    fix = "or use weights_transport=shm"
    if cfg.trainer.world_size != 1 or len(g.trainer) != 1:
        problems.append(f"weights_transport=cuda_ipc needs the trainer on one GPU (trainer.world_size=1 and "
                        f"gpus.trainer=[G]), got world_size={cfg.trainer.world_size}, gpus.trainer={list(g.trainer)}: "
                        f"{'set gpus.trainer=[0]' if not g.trainer else 'train on one GPU'}, {fix}")
    elif not g.samplers or any(int(x) != int(g.trainer[0]) for x in g.samplers):
        gpu = int(g.trainer[0])
        problems.append(f"weights_transport=cuda_ipc needs every sampler on the trainer's GPU {gpu} (a process sees "
                        f"only its own GPU, so the trainer's buffer cannot be opened elsewhere), got gpus.samplers="
                        f"{list(g.samplers)}: set gpus.samplers=[{', '.join([str(gpu)] * max(1, cfg.sampler.count))}]"
                        f" with a gpus.memory split, {fix}")
    if cfg.sampler.engine not in IPC_ENGINES:
        problems.append(f"weights_transport=cuda_ipc needs a sampler engine that loads weights in its own process "
                        f"({' or '.join(IPC_ENGINES)}), got sampler.engine={cfg.sampler.engine}: "
                        f"choose one of those, {fix}")
    return problems


def _nccl(cfg) -> list[str]:
    """``weights_transport=nccl`` broadcasts from the trainer's rank 0 to every sampler over NCCL when the trainer is
    on a GPU: each sampler needs a GPU of its own, not that one (weights/nccl.py)."""
    if cfg.get("weights_transport") != "nccl" or cfg.weights_options.nccl.backend == "gloo":
        return []
    g, fix = cfg.gpus, "or set weights_options.nccl.backend=gloo"
    if not g.trainer:
        return [f"weights_options.nccl.backend=nccl needs the trainer on a GPU (gpus.trainer=[G]), {fix}"] if (
            cfg.weights_options.nccl.backend == "nccl") else []
    rank0 = int(g.trainer[0])
    if not g.samplers:
        return [f"weights_transport=nccl broadcasts over NCCL from the trainer's GPU {rank0}, and the samplers have "
                f"no GPU (gpus.samplers=[]): give each a GPU other than {rank0}, {fix}"]
    on_it = [f"sampler-{i}" for i, x in enumerate(g.samplers) if int(x) == rank0]
    if on_it:
        return [f"weights_transport=nccl: {', '.join(on_it)} on the trainer's GPU {rank0}, where NCCL cannot add "
                f"them to its group: move them to other GPUs, use weights_transport=cuda_ipc (one GPU), {fix}"]
    return []


def _sharing(cfg, procs: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """A GPU shared by several processes needs a memory share for each role on it, summing to at most 1."""
    on: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for worker_id, (role, gpus) in procs.items():
        for gpu in gpus:
            on[gpu].append((worker_id, role))
    problems = []
    for gpu, members in sorted(on.items()):
        if len(members) < 2:
            continue
        ids = ", ".join(w for w, _ in members)
        unset = sorted({role for _, role in members if not cfg.gpus.memory.get(role)})
        if unset:
            problems.append(f"GPU {gpu} is shared by {ids} without a memory split: set gpus.memory."
                            f"{unset[0]}=SHARE for {', '.join(unset)} (e.g. gpus.memory={{trainer: 0.5, sampler: 0.3, "
                            f"teacher: 0.15}}; the shares on one GPU sum to at most 1)")
            continue
        total = sum(float(cfg.gpus.memory[role]) for _, role in members)
        if total > 1.0 + 1e-9:
            problems.append(f"GPU {gpu} is shared by {ids} whose gpus.memory shares sum to {total:.2f} > 1: lower them")
    return problems


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0

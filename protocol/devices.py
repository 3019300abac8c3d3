"""Where a worker's model lives: the contract between the supervisor's GPU plan and each process.

    device = role_device(cfg, "trainer")      # cuda:LOCAL_RANK if gpus.trainer (ray.trainer.gpus) asks, else cpu
    dtype = torch_dtype(cfg.model.dtype)      # bf16 | bfloat16 | fp32 | float32

The supervisor (supervisor/placement.py) gives each process of a role the GPUs the
config's ``gpus`` section assigns it as its only visible ones (``CUDA_VISIBLE_DEVICES``),
so inside the process they are ``cuda:0`` (or ``cuda:LOCAL_RANK`` for the trainer's
torchrun ranks). A role with no GPUs runs on the CPU. Every role calls ``role_device``
with the config it was started with, so the code that picks ``cpu`` in the tests is the
code that picks ``cuda`` on a GPU machine (docs/ARCHITECTURE.md §10).
"""

from __future__ import annotations

import os
import threading
from enum import StrEnum

# Held while a model is built and loaded. Roles are threads of one process under ``launch --inline``: transformers'
# loading (modules built on the meta device, then materialised) is not thread-safe, and two at once left a trainer
# or a teacher with meta tensors ("Cannot copy out of meta tensor") in 2 inline MOPD launches of 3.
MODEL_LOADING = threading.Lock()

# the config's ``gpus`` key of each role that runs a model
GPU_KEYS = {"trainer": "trainer", "sampler": "samplers", "teacher": "teachers"}

_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
Dtype = StrEnum("Dtype", {name: name for name in _DTYPE_NAMES})  # model.dtype: the schema's type (its aliases)


class DeviceError(RuntimeError):
    """A role was given a GPU its process cannot see, or a dtype no role serves."""


def dtype_name(name: str) -> str:
    """The canonical name of ``model.dtype`` (``bf16`` -> ``bfloat16``), as vLLM and SGLang take it."""
    if name not in _DTYPE_NAMES:
        raise DeviceError(f"model.dtype={name!r}: choose bf16 or fp32 (or bfloat16, float32)")
    return _DTYPE_NAMES[name]


def torch_dtype(name: str):
    """``model.dtype`` as a torch dtype."""
    import torch

    return getattr(torch, dtype_name(name))


def role_device(cfg, role: str, apply_memory_fraction: bool = True):
    """This process's device for ``role`` (trainer | sampler | teacher), from ``cfg.gpus``.

    A role with GPUs gets ``cuda:LOCAL_RANK`` (0 outside torchrun), made the current device;
    with ``apply_memory_fraction`` (torch-based roles; vLLM and SGLang take the fraction as
    their own option) ``gpus.memory[role]`` caps the process's share of that GPU."""
    import torch

    if not uses_gpus(cfg, role):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        asked = (f"ray.{role}.gpus={cfg.ray[role].gpus}" if cfg.get("launcher") == "ray"
                 else f"gpus.{GPU_KEYS[role]}={list(cfg.gpus[GPU_KEYS[role]])}")
        raise DeviceError(f"{asked} but this {role} process sees no CUDA device "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch "
                          f"{torch.__version__}): run on a GPU machine with a CUDA build of torch, or ask for none")
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(index)
    fraction = memory_fraction(cfg, role)
    if apply_memory_fraction and fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    return torch.device("cuda", index)


def uses_gpus(cfg, role: str) -> bool:
    """Whether the processes of ``role`` run on GPUs: with ``launcher=ray`` when ``ray.<role>.gpus`` > 0 (Ray
    gives each its GPUs as CUDA_VISIBLE_DEVICES), else when ``gpus.<role's key>`` names some."""
    if cfg.get("launcher") == "ray":
        return float(cfg.ray[role].gpus) > 0
    return bool(cfg.gpus[GPU_KEYS[role]])


def memory_fraction(cfg, role: str) -> float | None:
    """``gpus.memory[role]``: the share of its GPU this role's process may take (None: no cap)."""
    value = cfg.gpus.memory.get(role)
    return float(value) if value else None

"""Shared by the benchmarks: the machine a figure was measured on (every result JSON names it)."""

from __future__ import annotations

import os
import platform


def machine() -> str:
    """GPU name with torch/CUDA versions, else CPU model, cores and torch threads; plus Linux and Python."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch
    except ImportError:
        return f"{where}, Linux {platform.release()}, Python {platform.python_version()}"
    if torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), {where}"
    else:
        where += ", no GPU"
    return f"{where}, torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}"

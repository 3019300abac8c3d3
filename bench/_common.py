"""Shared by the benchmarks: the machine a figure was measured on (every result JSON names it), and the data
and model of ``make run`` (the built-in tasks as files, the SFT'd tiny model), made the same way if missing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
SFT_TASKS = ("arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if", "chat")  # make run's SFT files


def builtin_data() -> dict[str, dict[str, str]]:
    """{split: {task: path}} of make run's data files (runs/data/demo), written first if missing (as make run does)."""
    out = ROOT / "runs" / "data" / "demo"
    if not (out / "manifest.json").exists():
        subprocess.run([*CLI, "make-data", "demo", "--out", str(out), "--heldout", "128", "--sft", "2000"],
                       check=True, stdout=subprocess.DEVNULL)
    return manifest_files(out)


def manifest_files(out: Path) -> dict[str, dict[str, str]]:
    """{split: {task: path}} of a ``make-data`` directory (its manifest's paths are relative to it)."""
    files = json.loads((out / "manifest.json").read_text())["files"]
    return {split: {task: str(out / path) for task, path in by_task.items()} for split, by_task in files.items()}


def math_data(heldout_per_domain: int = 0) -> list[str]:
    """Launch overrides: the arithmetic (math) prompts of make run and their held-out questions."""
    files = builtin_data()
    return [f"data.files=[{files['rl']['arithmetic']}]", f"data.eval_files=[{files['heldout']['arithmetic']}]",
            f"data.eval_per_domain={heldout_per_domain}"]


def sft_model() -> Path:
    """make run's SFT'd tiny model (models/tiny-sft); built the same way if missing (about 4 minutes)."""
    tiny, sft = ROOT / "models" / "tiny", ROOT / "models" / "tiny-sft"
    if not (sft / "config.json").exists():
        if not (tiny / "config.json").exists():
            subprocess.run([*CLI, "make-tiny-model", "--out", str(tiny), "--task", "demo", "--vocab-size", "1024"],
                           check=True)
        files = ",".join(f"{builtin_data()['sft'][t]}:{2 if t == 'chat' else 1}" for t in SFT_TASKS)  # as make run
        subprocess.run([*CLI, "sft", f"model={tiny}", f"out={sft}", f"files=[{files}]", "steps=800"], check=True)
    return sft


def full_sft_model() -> tuple[Path, dict[str, dict[str, str]]]:
    """make full's SFT'd model (models/full-sft: every policy domain, 2,000 steps) and its data files
    ({split: {task: path}} of runs/data/full); built by ``make full-sft`` if missing (about 25 minutes)."""
    sft, out = ROOT / "models" / "full-sft", ROOT / "runs" / "data" / "full"
    if not (sft / "config.json").exists() or not (out / "manifest.json").exists():
        subprocess.run(["make", "full-sft"], check=True, cwd=ROOT)
    return sft, manifest_files(out)


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

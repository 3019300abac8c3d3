"""Shared by the benchmarks: where a result goes and the tail that writes it (``write_result``), the machine a
figure was measured on (every result JSON names it), and the data and model of ``make run`` (the built-in tasks
as files, the SFT'd tiny model), made the same way if missing; in a smoke run (``--smoke``: seconds, tiny sizes,
the real code path; tests/test_benches.py runs every script so) small data and a random tiny model instead.

Result files go to $CASCADE_BENCH_RESULTS when it is set (the test: a temporary directory), else to
bench/results, or bench/results/smoke for a smoke run, so a smoke run never overwrites recorded figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from math import prod
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
SFT_TASKS = ("arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if", "chat")  # make run's SFT files
RESULTS_ENV = "CASCADE_BENCH_RESULTS"  # a directory for the result files instead of bench/results


# --- results ---------------------------------------------------------------------------------------------------


def results_dir(smoke: bool = False) -> Path:
    """$CASCADE_BENCH_RESULTS if set, else bench/results (bench/results/smoke for a smoke run); made if missing."""
    default = ROOT / "bench" / "results" / ("smoke" if smoke else "")
    out = Path(os.environ.get(RESULTS_ENV) or default)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_result(summary: dict, record: dict | None = None, *, smoke: bool = False, name: str | None = None) -> dict:
    """The tail of every benchmark: ``record`` (default: the summary itself), stamped with the date and whether
    it was a smoke run, written as <results>/<name>.json (``name``: default the summary's), then the summary
    printed as the last stdout line, the row bench/run_all.py reads. Returns the summary."""
    record = {**(summary if record is None else record), "smoke": smoke}
    record.setdefault("date", time.strftime("%Y-%m-%d %H:%M:%S"))
    (results_dir(smoke) / f"{name or summary['name']}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary), flush=True)
    return summary


# --- data and models -------------------------------------------------------------------------------------------


def builtin_data(smoke: bool = False) -> dict[str, dict[str, str]]:
    """{split: {task: path}} of make run's data files (runs/data/demo), written first if missing (as make run
    does); ``smoke``: the same tasks, a few rows each, under the results directory."""
    out = results_dir(True) / "data" if smoke else ROOT / "runs" / "data" / "demo"
    sizes = ["--heldout", "8", "--rl", "64", "--sft", "8"] if smoke else ["--heldout", "128", "--sft", "2000"]
    if not (out / "manifest.json").exists():
        subprocess.run([*CLI, "make-data", "demo", "--out", str(out), *sizes], check=True, stdout=subprocess.DEVNULL)
    return manifest_files(out)


def manifest_files(out: Path) -> dict[str, dict[str, str]]:
    """{split: {task: path}} of a ``make-data`` directory (its manifest's paths are relative to it)."""
    files = json.loads((out / "manifest.json").read_text())["files"]
    return {split: {task: str(out / path) for task, path in by_task.items()} for split, by_task in files.items()}


def math_data(heldout_per_domain: int = 0, smoke: bool = False) -> list[str]:
    """Launch overrides: the arithmetic (math) prompts of make run and their held-out questions."""
    files = builtin_data(smoke)
    return [f"data.files=[{files['rl']['arithmetic']}]", f"data.eval_files=[{files['heldout']['arithmetic']}]",
            f"data.eval_per_domain={heldout_per_domain}"]


def sft_model(smoke: bool = False) -> Path:
    """make run's SFT'd tiny model (models/tiny-sft); built the same way if missing (about 4 minutes). ``smoke``:
    a random tiny model of the same shape under the results directory (seconds, no SFT)."""
    if smoke:
        return random_model("tiny", results_dir(True) / "models")[0]
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


def random_model(size: str, under: Path | None = None) -> tuple[Path, int]:
    """A random-weight ``make-tiny-model --size`` Qwen3-MoE (tokenizer trained on the arithmetic text) and its
    parameter count, built once under ``under`` (default bench/results/models, as scaling-<size>)."""
    from safetensors import safe_open

    out = (under or ROOT / "bench" / "results" / "models") / f"scaling-{size}"
    if not (out / "config.json").exists():
        from cascade_rl.learner.tiny_model import make_tiny_model  # transformers: seconds of imports, when needed

        make_tiny_model(out, size=size, task="arithmetic")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        params = sum(prod(f.get_slice(k).get_shape()) for k in f.keys())
    return out, params


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


def bench_parser(doc: str, quick: str, smoke: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring's first line as the description, and the two modes every
    script has (``--quick``: ``make bench``'s; ``--smoke``: tests/test_benches.py's, no figures)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--smoke", action="store_true", help=smoke)
    return ap


def run_child(script: str, args: list[str], timeout: float) -> dict:
    """``script`` run with ``args`` in a child process of its own (a measurement's peak RSS is then its own): its last
    stdout line as JSON, or {"error": ...} (a timeout, a non-zero exit with the last line of its stderr)."""
    try:
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def launch_run(args: list[str], run_dir: Path, work: Path, what: str, timeout: float = 3600) -> tuple[dict, list[dict]]:
    """``cascade-rl launch`` with ``args`` (its state under ``work``): the run's summary.json and metrics.jsonl lines;
    a failed launch raises with ``what`` it was and the end of its output."""
    r = subprocess.run([*CLI, "launch", *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, XDG_STATE_HOME=str(work / "state")))
    if r.returncode != 0:
        raise RuntimeError(f"launch failed ({what}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), metrics

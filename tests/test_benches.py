"""Benches that cannot rot: every script of bench/ runs here in its smoke mode (``--smoke``: seconds, tiny sizes,
the real code path), as a subprocess with the venv's python, and must write a valid result JSON with the keys
bench/run_all.py reads. The results go to a temporary directory ($CASCADE_BENCH_RESULTS), never bench/results.

    .venv/bin/pytest -q tests/test_benches.py                  # all of it

What does not run here: the GPU parts (gpu_checks.sh is rehearsed on the CPU by tests/test_gpu_checks.py;
gpu_launch.py and gpu_checks_machine.py have their arguments parsed), TRL's side of vs_trl.py (its venv,
.venv-trl, is built by a full run only), the sandbox without root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("[!_]*.py")
                 if p.stem not in ("run_all", "chaos") and not p.stem.startswith("gpu_"))  # chaos: tests/test_chaos.py
# bench/run_all.py's columns: the summary line of every script has them
SUMMARY_KEYS = {"name", "metric", "value", "baseline", "baseline_value", "ratio", "target", "pass"}
# none is marked slow: a smoke run is one launch at most, `--inline` (every role a thread of one process; about
# 12-16 s of CPU), publish_memory one torchrun of 2 ranks (about 17 s); all of them about 2 minutes of CPU together
LAUNCHES = {"async_vs_sync", "mopd_vs_grpo", "publish_memory", "vs_trl"}  # a longer time limit
NEEDS_ROOT = {"sandbox"}  # namespaces and a uid drop


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One directory for the module: the smoke data and model are made once, each script writes its own file."""
    return tmp_path_factory.mktemp("bench-results")


def smoke(script: str, results: Path, *args: str, timeout: float = 300) -> dict:
    """Run bench/<script>.py --smoke; its summary line (the last line of stdout, as run_all reads it)."""
    env = dict(os.environ, CASCADE_BENCH_RESULTS=str(results))
    r = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--smoke", *args], capture_output=True,
                       text=True, env=env, timeout=timeout, cwd=BENCH.parent)
    assert r.returncode == 0, f"bench/{script}.py --smoke exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def strict_json(path: Path) -> dict:
    """The file as JSON, refusing NaN and Infinity (valid for Python, not for other readers)."""
    def refuse(name):
        raise ValueError(f"{path.name}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def marks(script: str) -> list:
    if script in NEEDS_ROOT:
        return [pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")]
    return []


@pytest.mark.parametrize("script", [pytest.param(s, marks=marks(s)) for s in SCRIPTS])
def test_every_bench_runs_in_smoke_mode_and_writes_its_result(script, results):
    summary = smoke(script, results, timeout=600 if script in LAUNCHES else 300)
    assert SUMMARY_KEYS <= summary.keys(), f"{script}: the summary line lacks {SUMMARY_KEYS - summary.keys()}"
    record = strict_json(results / f"{summary['name']}.json")
    assert record["smoke"] is True and record["date"]
    body = record.get("summary", record)  # weight_transport and publish_memory nest their summary
    assert {k: body[k] for k in SUMMARY_KEYS} == {k: summary[k] for k in SUMMARY_KEYS}
    assert summary["value"] is not None or summary["name"] == "logprob_kernel"  # its figure needs a GPU


def test_run_all_smoke_writes_the_table(results):
    env = dict(os.environ, CASCADE_BENCH_RESULTS=str(results))
    r = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--smoke", "--only", "logprob_kernel"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = strict_json(results / "summary.json")
    assert out["smoke"] and [b["name"] for b in out["benchmarks"]] == ["logprob_kernel"]
    assert "failed" not in out["benchmarks"][0]["metric"]
    assert "(smoke mode)" in (results / "summary.md").read_text()


@pytest.mark.parametrize("script", ["gpu_launch", "gpu_checks_machine"])
def test_gpu_only_scripts_parse_their_arguments(script):
    r = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]

"""Soak: RSS growth of every process of a long tiny run, and its steps/s. Not in CI.

    .venv/bin/python bench/soak.py [--quick] [--steps N] [--model DIR] [--interval S] [--keep]

Workload: ``cascade-rl launch tiny`` on the tiny Qwen3-MoE model (built in a
temporary directory unless ``--model`` names one), shrunk so that steps are
short and many: 2 prompts x 2 samples per step, 8 new tokens, 4 held-out
questions evaluated once, no greedy pass. ``--quick`` runs 100 steps (under a
minute on 2 idle cores, a few on busy ones), the full run 1,000.

While it runs, the process table comes from ``cascade-rl ctl status --json``
(pids of the orchestrator, trainer, samplers and verifiers; re-read every
``--pids-every`` seconds, so a restarted worker is followed) plus the
supervisor's own pid; every ``--interval`` seconds each process's VmRSS is read
from ``/proc/<pid>/status``, with that of its descendants (the verifier's
scoring processes, torchrun's ranks) summed into the worker's figure. The
completed step comes from ``metrics.jsonl``.

Growth of a worker: median RSS over the samples of the last 10 % of the
training time against the median over its first 10 % (training time: from
step 1 done to the last step; start-up, evaluations and the final checkpoint
are left out; by time, not steps, as the step rate of a shared machine
changes mid-run). Headline: the worst growth over the workers and the
supervisor; target <= 10 %. Also reported: training steps/s (the steps' own
time from metrics.jsonl) and steps/s over the whole stage. A leak of a few
KiB a step shows only in a full run: --quick mostly measures warm-up.

Writes bench/results/soak.json (every sample included); the last stdout line is
the summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import machine, math_data  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
TARGET_PCT = 10.0
# tiny preset, shrunk: many short steps (the schema's fields: supervisor/config.py)
OVERRIDES = [
    "run.prompts_per_step=2",
    "run.group_size=2",
    "sampling.max_tokens=8",
    "orchestrator.eval_n=1",
    "orchestrator.eval_greedy=false",
    "supervisor.progress=none",
]



def vm_rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def tree_rss_kib(pid: int) -> tuple[int | None, int]:
    """(the process's own RSS, its descendants' RSS summed) in KiB."""
    own = vm_rss_kib(pid)
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    return own, sum(vm_rss_kib(c.pid) or 0 for c in children)


def ctl_status(run_dir: Path, env: dict) -> list[dict] | None:
    r = subprocess.run(
        [*CLI, "ctl", "--run-dir", str(run_dir), "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    return json.loads(r.stdout) if r.returncode == 0 else None


class Steps:
    """The last completed step, read incrementally from metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step, self.step_s = path, 0, 0, []

    def poll(self) -> int:
        if self.path.is_file():
            with open(self.path) as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # half-written: read it next time
                    self.offset += len(line)
                    row = json.loads(line)
                    if "version" in row:  # a training step (evaluations have no version)
                        self.step = max(self.step, row["step"])
                        self.step_s.append(row.get("step_s", 0.0))
        return self.step


def growth(samples: list[dict], key: str, steps: int) -> dict | None:
    """Median RSS of ``key`` over the first and the last 10 % of the training time, and the growth between.

    Training time: from the first sample after step 1 completed to the last before step ``steps`` did (the
    first step's warm-up, the evaluations and the final checkpoint are left out). Windows are by time, not
    by step: on a shared machine the step rate changes during a run, and a window must hold samples."""
    train = [s for s in samples if 1 <= s["step"] < steps and key in s["rss"]]
    if len(train) < 2:
        return None
    t0, t1 = train[0]["t"], train[-1]["t"]
    span = (t1 - t0) / 10
    first = [s["rss"][key] for s in train if s["t"] <= t0 + span]
    last = [s["rss"][key] for s in train if s["t"] >= t1 - span]
    a, b = statistics.median(first), statistics.median(last)
    return {
        "first_mib": round(a / 1024, 1),
        "last_mib": round(b / 1024, 1),
        "growth_pct": round(100 * (b - a) / a, 2),
        "samples": [len(first), len(last)],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 steps instead of 1,000")
    ap.add_argument("--steps", type=int, default=0, help="override the number of steps")
    ap.add_argument("--model", default="", help="a tiny model directory (default: build one in a temp dir)")
    ap.add_argument("--interval", type=float, default=0.0, help="seconds between RSS samples (default 1, quick 0.25)")
    ap.add_argument("--pids-every", type=float, default=15.0, help="seconds between `ctl status` calls")
    ap.add_argument("--timeout", type=float, default=0.0, help="give up after this long (default 5 s a step + 300)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    args = ap.parse_args(argv)
    steps = args.steps or (100 if args.quick else 1000)
    interval = args.interval or (0.25 if args.quick else 1.0)
    timeout = args.timeout or 5.0 * steps + 300

    # --------------------------------------------------------------------------- model, run dir
    tmp = Path(tempfile.mkdtemp(prefix="crl-soak-"))
    env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"))  # leave the user's "latest run" alone
    model = Path(args.model) if args.model else tmp / "tiny"
    if not (model / "config.json").is_file():
        subprocess.run(
            [*CLI, "make-tiny-model", "--out", str(model)],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    run_dir = tmp / "run"

    # --------------------------------------------------------------------------- launch and sample
    cmd = [*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={model}", f"run.steps={steps}", *OVERRIDES,
           *math_data(4)]
    log = open(tmp / "launch.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    progress = Steps(run_dir / "metrics.jsonl")
    workers: dict[str, int] = {}  # key -> pid
    samples: list[dict] = []
    next_pids = 0.0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout:
                raise SystemExit(f"bench/soak.py: run not done after {timeout:.0f} s (see {tmp / 'launch.log'})")
            if now >= next_pids and (run_dir / "supervisor.json").is_file():
                table = ctl_status(run_dir, env)
                if table:
                    workers = {f"{w['role']}:{w['id']}": w["pid"] for w in table if w["pid"]}
                    workers["supervisor"] = json.loads((run_dir / "supervisor.json").read_text())["pid"]
                    next_pids = now + args.pids_every
            step = progress.poll()
            rss, own = {}, {}
            for key, pid in workers.items():
                mine, children = tree_rss_kib(pid)
                if mine is not None:  # the supervisor's descendants are the workers: its own RSS only
                    rss[key], own[key] = mine + (children if key != "supervisor" else 0), mine
            if rss:
                samples.append({"t": round(now - t0, 2), "step": step, "rss": rss, "own": own})
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        log.close()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"bench/soak.py: launch exited {proc.returncode} (see {tmp / 'launch.log'} and {run_dir / 'logs'})"
        )
    progress.poll()
    summary_run = json.loads((run_dir / "summary.json").read_text())

    # --------------------------------------------------------------------------- report
    keys = sorted({k for s in samples for k in s["rss"]})
    per_worker = {k: g for k in keys if (g := growth(samples, k, steps)) is not None}
    if not per_worker:
        raise SystemExit("bench/soak.py: too few RSS samples during training; lower --interval")
    worst = max(per_worker, key=lambda k: per_worker[k]["growth_pct"])
    w = per_worker[worst]
    train_s = sum(progress.step_s)
    full = {
        "name": "soak",
        "metric": f"worst RSS growth % over workers (process + children), median over the first 10 % of the "
        f"training time of {steps} steps -> over the last 10 % ({worst})",
        "value": w["growth_pct"],
        "baseline": f"median RSS over the first 10 % of the training time, MiB ({worst})",
        "baseline_value": w["first_mib"],
        "ratio": round(1 + w["growth_pct"] / 100, 4),  # last / first
        "target": TARGET_PCT,
        "pass": w["growth_pct"] <= TARGET_PCT,
        "machine": machine(),
        "steps": steps,
        "steps_per_s": round(steps / train_s, 3) if train_s else None,  # the training steps' own time
        "steps_per_s_wall": round(steps / summary_run["wall_s"], 3),  # the stage, evaluations included
        "wall_s": round(wall, 1),
        "per_worker": per_worker,
        "own_rss": {k: g for k in keys if (g := growth([{**s, "rss": s["own"]} for s in samples], k, steps))},
        "books": summary_run["books"],
        "malformed_messages": summary_run.get("malformed_messages"),
        "interval_s": interval,
        "n_samples": len(samples),
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "samples": samples,
    }
    results = ROOT / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "soak.json").write_text(json.dumps(full, indent=2))
    for key, g in per_worker.items():
        print(
            f"{key:24s} {g['first_mib']:8.1f} MiB -> {g['last_mib']:8.1f} MiB  {g['growth_pct']:+6.2f} %",
            file=sys.stderr,
        )
    print(
        f"{steps} steps: {full['steps_per_s']} steps/s training, {full['steps_per_s_wall']} over the stage "
        f"(wall {full['wall_s']} s, {len(samples)} samples)",
        file=sys.stderr,
    )
    if args.keep:
        print(f"run kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        k: full[k]
        for k in ("name", "metric", "value", "baseline", "baseline_value", "ratio", "target", "pass", "machine")
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

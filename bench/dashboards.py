"""What the dashboards cost a step: W&B (offline), MLflow (sqlite) and TensorBoard beside metrics.jsonl.

    python bench/dashboards.py            # 1,000 metrics lines
    python bench/dashboards.py --quick    # 300
    python bench/dashboards.py --smoke    # 20: the code path in seconds

A metrics line as a launch writes it (80 numbers: sampling, scores, the trainer's, per-domain accuracy) goes through
``MetricsLog.log`` N times, as the orchestrator's step loop calls it:

- **baseline, jsonl**: ``logger=[jsonl]``, the line appended to metrics.jsonl;
- **ours, dashboards**: ``logger=[jsonl,tensorboard,wandb,mlflow]``: the same, and the line queued for the
  trackers' thread (orchestrator/trackers.py), which sends it to each dashboard.

Measured: the time the step loop spends in ``log`` (the headline: with the dashboards against jsonl alone, per line;
target: under a millisecond more, against a step of seconds), what opening the dashboards costs (started on that
thread: the step loop does not wait for it), and how fast the thread drains the queue (lines/s, the slowest
dashboard's pace: a step writes one line, so any pace above a line a second keeps up); then each dashboard alone.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

TARGET_MS = 1.0  # what the dashboards may add to the step loop's time per metrics line
METRICS = 80


def line(step: int) -> dict:
    names = [f"trainer/m{i}" for i in range(40)] + [f"heldout_accuracy/d{i}" for i in range(20)] + [
        f"m{i}" for i in range(METRICS - 60)]
    return {"step": step, "version": step + 1, **{k: (step * 31 + i) % 97 / 97 for i, k in enumerate(names)}}


def measure(names: list[str], n: int, root: Path) -> dict:
    from cascade_rl.orchestrator.report import MetricsLog
    from cascade_rl.orchestrator.trackers import RunIdentity, Trackers

    run_dir = root / "-".join(names)
    run_dir.mkdir()
    identity = RunIdentity(run_dir, run_dir.name, {"run": {"steps": n}}, {"project": "bench", "mode": "offline"},
                           {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}"})
    t0 = time.perf_counter()
    trackers = Trackers(names, identity)
    started = time.perf_counter() - t0
    trackers.run_ids()  # opened (on the thread)
    opened = time.perf_counter() - t0
    log, spent = MetricsLog(run_dir, trackers), 0.0
    t_loop = time.perf_counter()
    for step in range(n):
        t = time.perf_counter()
        log.log(line(step))
        spent += time.perf_counter() - t
    trackers.close()
    drained = time.perf_counter() - t_loop
    assert not trackers.failed, trackers.failed
    return {"log_ms": 1000 * spent / n, "start_ms": 1000 * started, "open_s": opened, "drain_lines_per_s": n / drained}


def main() -> None:
    args = bench_parser(__doc__, "300 lines", "20 lines").parse_args()
    n = 20 if args.smoke else 300 if args.quick else 1000
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        base = measure(["jsonl"], n, Path(tmp))
        ours = measure(["jsonl", "tensorboard", "wandb", "mlflow"], n, Path(tmp))
        alone = {} if args.smoke else {name: measure([name], n, Path(tmp)) for name in ("tensorboard", "wandb",
                                                                                       "mlflow")}
    ratio, added = ours["log_ms"] / base["log_ms"], ours["log_ms"] - base["log_ms"]
    summary = {"name": "dashboards",
               "metric": "ms of the step loop per metrics line (81 numbers) with W&B (offline), MLflow (sqlite) and "
                         "TensorBoard on",
               "value": round(ours["log_ms"], 4),
               "baseline": "logger=[jsonl]: metrics.jsonl alone", "baseline_value": round(base["log_ms"], 4),
               "ratio": round(ratio, 3), "target": f"< {TARGET_MS:g} ms more a line", "pass": added < TARGET_MS}
    write_result(summary, {**summary, "lines": n, "metrics_per_line": METRICS + 1, "jsonl": base,
                           "dashboards": ours, "each_alone": alone, "machine": machine()}, smoke=args.smoke)


if __name__ == "__main__":
    main()

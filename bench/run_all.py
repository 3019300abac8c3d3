"""Run every benchmark of bench/ and print one table: benchmark, our figure, baseline, ratio, target, pass.

    .venv/bin/python bench/run_all.py [--quick | --smoke] [--only vs_trl,packing]      (make bench: --quick)

Each script's last stdout line is its summary (JSON: name, metric, value, baseline, baseline_value, ratio,
target, pass); a script that fails is a row saying so, and the others still run. Writes
bench/results/summary.json and bench/results/summary.md (the table with the machine and the date, as it goes
into BENCHMARKS.md). ``--smoke``: every script in its smoke mode (seconds each, tiny sizes, the real code path;
no figures), the files under bench/results/smoke or $CASCADE_BENCH_RESULTS (bench/_common.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, machine, results_dir  # noqa: E402

BENCH = Path(__file__).resolve().parent
COLUMNS = ("benchmark", "ours", "baseline", "ratio", "target", "pass")


def fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "pass" if x else "FAIL"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def row(s: dict) -> list[str]:
    ours = f"{fmt(s.get('value'))}"
    base = f"{fmt(s.get('baseline_value'))} ({s['baseline']})" if s.get("baseline") else fmt(s.get("baseline_value"))
    ratio = fmt(s.get("ratio"))
    if s.get("ratio_range"):
        ratio += f" [{fmt(s['ratio_range'][0])}–{fmt(s['ratio_range'][1])}]"
    return [f"{s['name']}: {s.get('metric', '')}", ours, base, ratio, fmt(s.get("target")), fmt(s.get("pass"))]


def run(script: Path, mode: list[str]) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(script), *mode], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    try:
        summary = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        summary = {"name": script.stem, "metric": f"failed (exit {r.returncode}): {(r.stderr or r.stdout)[-300:]}",
                   "pass": False}
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    ap = bench_parser(__doc__, quick="every script in its quick mode",
                      smoke="every script in its smoke mode (the code paths, no figures)")
    ap.add_argument("--only", default="", help="comma-separated script names (default: all)")
    args = ap.parse_args(argv)
    mode = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
    label = f" ({mode[0].removeprefix('--')})" if mode else ""
    only = {n for n in args.only.split(",") if n}
    # gpu_*.py are GPU checks without a baseline of their own: bench/gpu_checks.sh runs them
    scripts = [p for p in sorted(BENCH.glob("[!_]*.py")) if p.name != Path(__file__).name
               and not p.stem.startswith("gpu_") and (not only or p.stem in only)]
    console = Console(stderr=True)
    summaries = []
    for script in scripts:
        with console.status(f"bench/{script.name} {' '.join(mode)}"):
            summaries.append(run(script, mode))
        console.print(f"bench/{script.name}: {summaries[-1]['seconds']} s")
    table = Table(title=f"cascade-rl benchmarks{label} — {machine()}")
    for c in COLUMNS:
        table.add_column(c, overflow="fold")
    for s in summaries:
        table.add_row(*row(s))
    Console().print(table)
    date = time.strftime("%Y-%m-%d %H:%M")
    md = [f"Measured {date} on {machine()}{label.replace(')', ' mode)')}.", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in row(s)) + " |" for s in summaries]
    out = results_dir(args.smoke)
    (out / "summary.json").write_text(json.dumps({"date": date, "machine": machine(), "quick": args.quick,
                                                  "smoke": args.smoke, "benchmarks": summaries}, indent=1))
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return summaries


if __name__ == "__main__":
    main()

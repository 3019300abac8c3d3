"""How a strictly on-policy GRPO step grows with model size and with samplers, on this machine.

    .venv/bin/python bench/scaling.py [--quick]

Model sizes: ``make-tiny-model --size`` tiny, 10m and 50m (Qwen3-MoE, random weights: their responses run to
the 64-token limit, so every size samples the same 8 x 8 x 64 tokens a step); samplers: 1 and 2 (with 2, each
runs one thread; the trainer, the samplers and the verifiers share the machine's cores). Each point is one real
``cascade-rl launch`` (8 prompts x 8 rollouts, lr 3e-6, max_staleness 0), the median step wall time after
warm-up, split into sampling (generation and scoring) and training. Writes bench/results/scaling.json and the
README's figure, docs/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, math_data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
SIZES = ("tiny", "10m", "50m")
STEPS = {"tiny": 12, "10m": 8, "50m": 5}


def build(size: str) -> tuple[Path, int]:
    from safetensors import safe_open

    from cascade_rl.learner.tiny_model import make_tiny_model

    out = RESULTS / "models" / f"scaling-{size}"
    if not (out / "config.json").exists():
        make_tiny_model(out, size=size, task="arithmetic")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return out, params


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def launch(model: Path, samplers: int, steps: int, work: Path) -> dict:
    run_dir = work / f"{model.name}-s{samplers}-{time.monotonic_ns()}"
    args = ["launch", "tiny", f"run_dir={run_dir}", f"model.path={model}", f"run.steps={steps}",
            "run.prompts_per_step=8", "run.group_size=8", "sampling.max_tokens=64", "trainer.lr=3e-6",
            *math_data(), "orchestrator.eval_n=0",
            "orchestrator.eval_greedy=false", "orchestrator.sampler_timeout_s=600", f"sampler.count={samplers}",
            f"sampler.threads={0 if samplers == 1 else 1}", "supervisor.progress=none"]
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, XDG_STATE_HOME=str(work / "state")))
    if r.returncode != 0:
        raise RuntimeError(f"launch failed ({model.name}, {samplers} samplers):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [(m["time"] - p["time"], m["sample_s"], m["trainer/train_s"]) for p, m in zip(rows, rows[1:])
              if "version" in m]
    after = steps_[2:] or steps_
    return {"step_s": statistics.median(s[0] for s in after), "sample_s": statistics.median(s[1] for s in after),
            "train_s": statistics.median(s[2] for s in after), "steps": steps}


def plot(points: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for samplers, style in ((1, "o-"), (2, "s-")):
        xs = [p for p in points if p["samplers"] == samplers]
        ax.plot([p["params"] / 1e6 for p in xs], [p["step_s"] for p in xs], style, label=f"step, {samplers} sampler(s)")
    one = [p for p in points if p["samplers"] == 1]
    ax.plot([p["params"] / 1e6 for p in one], [p["train_s"] for p in one], "^--", label="train part (1 sampler)")
    ax.plot([p["params"] / 1e6 for p in one], [p["sample_s"] for p in one], "v--", label="sample part (1 sampler)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([p["params"] / 1e6 for p in one], [f"{p['params'] / 1e6:.1f}M\n({p['size']})" for p in one])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds per GRPO step (median)")
    ax.set_title("cascade-rl step time, 8x8 rollouts x 64 tokens, 2 CPU cores", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny and 10m only, fewer steps")
    ap.add_argument("--plot-only", action="store_true", help="redraw docs/scaling.png from bench/results/scaling.json")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads((RESULTS / "scaling.json").read_text())["points"], ROOT / "docs" / "scaling.png")
        return {}
    sizes = SIZES[:2] if args.quick else SIZES
    work = Path(tempfile.mkdtemp(prefix="crl-scaling-"))
    points = []
    for size in sizes:
        model, params = build(size)
        for samplers in (1, 2):
            steps = 6 if args.quick else STEPS[size]
            p = {"size": size, "params": params, "samplers": samplers, **launch(model, samplers, steps, work)}
            points.append(p)
            print(f"{size} ({params / 1e6:.1f}M), {samplers} sampler(s): {p['step_s']:.3f} s/step "
                  f"(sample {p['sample_s']:.3f}, train {p['train_s']:.3f})", file=sys.stderr)
    figure = ROOT / "docs" / "scaling.png"
    if not args.quick:
        plot(points, figure)
    first, last = points[0], [p for p in points if p["samplers"] == 1][-1]
    two = {p["size"]: p["step_s"] for p in points if p["samplers"] == 2}
    one = {p["size"]: p["step_s"] for p in points if p["samplers"] == 1}
    summary = {"name": "scaling", "metric": f"step time {last['size']} / tiny (1 sampler)",
               "value": round(last["step_s"], 3), "baseline": "tiny model, 1 sampler",
               "baseline_value": round(first["step_s"], 3), "ratio": round(last["step_s"] / first["step_s"], 2),
               "target": None, "pass": None, "two_vs_one_sampler": {k: round(two[k] / one[k], 3) for k in one},
               "machine": machine()}
    out = {**summary, "points": points, "figure": str(figure.relative_to(ROOT)) if not args.quick else None,
           "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

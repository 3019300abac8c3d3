"""The cascade's report: ``<run_dir>/report.md`` and its PNG plots, from ``cascade.json`` and each stage's
``metrics.jsonl`` / ``summary.json``.

    from cascade_rl.supervisor.report import write_report
    write_report(Path("runs/cascade"), json.loads(Path("runs/cascade/cascade.json").read_text()))

- ``accuracy.png``: held-out accuracy per domain at every evaluated checkpoint, stage by stage (the
  paper's Figure 2 in miniature);
- ``training.png``: each stage's training reward per step, and MOPD's reverse KL to its teachers;
- report.md: the per-domain accuracy after each stage, every checkpoint, the MOPD teacher table and the
  rollout books of each stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KL = "trainer/mopd/reverse_kl"  # the MOPD metric plotted: mean of log π_θ − log π_teacher over response tokens


def stage_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoints(record: dict) -> list[tuple[str, dict]]:
    """(stage, evaluation) in cascade order, the starting model first."""
    rows = [("start", record["initial"])] if "initial" in record else []
    for name in record.get("order", []):
        rows += [(name, c) for c in record["stages"].get(name, {}).get("checkpoints", [])]
    return rows


def plot_accuracy(record: dict, out: Path) -> None:
    rows = checkpoints(record)
    domains = sorted({d for _, c in rows for d in c["domains"]})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for d in domains:
        ax.plot(range(len(rows)), [c["domains"].get(d, float("nan")) for _, c in rows], marker="o", label=d)
    ax.plot(range(len(rows)), [c["accuracy"] for _, c in rows], color="black", ls="--", label="mean")
    ax.set_xticks(range(len(rows)), [f"{s} {c['step']}" for s, c in rows], fontsize=7, rotation=45, ha="right")
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axvline(i - 0.5, color="grey", lw=0.5)
    ax.set_ylabel(f"held-out accuracy (avg@{rows[0][1]['n']})" if rows else "held-out accuracy")
    ax.set_xlabel("stage / step")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Per-domain accuracy through the cascade")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_training(record: dict, out: Path) -> None:
    stages = [(n, record["stages"][n]) for n in record.get("order", []) if n in record["stages"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for name, s in stages:
        steps = [m for m in stage_metrics(Path(s["run_dir"])) if "reward_mean" in m]
        x = [offset + m["step"] for m in steps]
        axes[0].plot(x, [m["reward_mean"] for m in steps], label=name)
        kl = [(offset + m["step"], m[KL]) for m in steps if KL in m]
        if kl:
            axes[1].plot(*zip(*kl), label=name)
        offset += s.get("steps", len(steps))
    axes[0].set(title="training reward (verifier) per step", xlabel="cascade step", ylabel="reward mean")
    axes[1].set(title="MOPD: reverse KL to the teachers", xlabel="cascade step", ylabel="E[log π_θ − log π_teacher]")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def where(record: dict, path: str) -> str:
    """A checkpoint's name in the report: stage/step."""
    for stage, c in checkpoints(record):
        if c["path"] == path:
            return f"{stage}/step {c['step']}"
    return path


def write_report(run_dir: Path, record: dict) -> Path:
    rows = checkpoints(record)
    if not rows:
        return run_dir / "report.md"
    plot_accuracy(record, run_dir / "accuracy.png")
    plot_training(record, run_dir / "training.png")
    domains = sorted({d for _, c in rows for d in c["domains"]})
    first = rows[0][1]
    lines = [
        "# Cascade report",
        "",
        f"Starting model: `{record['model']}`. Held-out accuracy is avg@{first['n']} at temperature "
        f"{first['temperature']}, {', '.join(f'{d} {q}' for d, q in first['questions'].items())} questions.",
        "",
        "## Accuracy after each stage",
        "",
        "| after | " + " | ".join(domains) + " | mean |",
        "| --- | " + " | ".join("---" for _ in domains) + " | --- |",
    ]
    finals = [("start (SFT)", record["initial"])] + [
        (n, record["stages"][n]["checkpoints"][-1]) for n in record.get("order", [])
        if record["stages"].get(n, {}).get("checkpoints")]
    for name, c in finals:
        lines.append(f"| {name} | " + " | ".join(f"{c['domains'].get(d, float('nan')):.3f}" for d in domains)
                     + f" | {c['accuracy']:.3f} |")
    lines += ["", "![accuracy](accuracy.png)", "", "![training](training.png)", "", "## Every checkpoint", "",
              "| stage | step | " + " | ".join(domains) + " | mean | eval s |",
              "| --- | --- | " + " | ".join("---" for _ in domains) + " | --- | --- |"]
    for stage, c in rows:
        lines.append(f"| {stage} | {c['step']} | " + " | ".join(f"{c['domains'].get(d, float('nan')):.3f}"
                                                               for d in domains)
                     + f" | {c['accuracy']:.3f} | {c['seconds']:.1f} |")
    for name in record.get("order", []):
        s = record["stages"].get(name, {})
        if s.get("teachers"):
            lines += ["", f"## Teachers of {name}", "", "| domain | teacher | its accuracy on the domain |",
                      "| --- | --- | --- |"]
            for d, path in sorted(s["teachers"].items()):
                acc = next((c["domains"].get(d) for _, c in rows if c["path"] == path), None)
                lines.append(f"| {d} | {where(record, path)} | {acc:.3f} |" if acc is not None
                             else f"| {d} | `{path}` | — |")
    lines += ["", "## Stages and rollout books", "",
              "| stage | algorithm | data | steps | status | wall s | dispatched | trained | filtered | stale | lost |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in record.get("order", []):
        s = record["stages"].get(name)
        if s is None:
            continue
        summary_path = Path(s["run_dir"]) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        b = summary.get("books", {})
        lines.append(f"| {name} | {s.get('algorithm', '')} | {', '.join(Path(f).name for f in s.get('files', []))} | {s.get('steps', '')} | "
                     f"{s.get('status', '')} | {summary.get('wall_s', float('nan')):.0f} | {b.get('dispatched', '')} | "
                     f"{b.get('trained', '')} | {b.get('filtered', '')} | {b.get('stale', '')} | {b.get('lost', '')} |")
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out

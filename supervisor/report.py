"""The cascade's report: ``<run_dir>/report.md`` and its PNG plots, from ``cascade.json`` and each stage's
``metrics.jsonl`` / ``summary.json``.

    from cascade_rl.supervisor.report import write_report
    write_report(Path("runs/cascade"), json.loads(Path("runs/cascade/cascade.json").read_text()))

- ``accuracy.png``: held-out accuracy per domain at every evaluated checkpoint, stage by stage (the
  paper's Figure 2 in miniature);
- ``training.png``: each stage's training reward per step, and MOPD's reverse KL to its teachers;
- report.md: the per-domain accuracy after each stage, each stage's change per domain with its paired 95 %
  interval (the same held-out questions before and after the stage: ``orchestrator.evaluate.paired_gain``),
  every checkpoint, the MOPD teacher table and the rollout books of each stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

from cascade_rl.orchestrator.evaluate import interval, paired_gain

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


def question_domains(record: dict) -> np.ndarray | None:
    """The domain of each held-out question, in the order of every checkpoint's ``per_question``."""
    domains = record.get("heldout", {}).get("domains")
    return np.array(domains) if domains else None


def by_domain(c: dict, domains: np.ndarray | None) -> dict[str, np.ndarray]:
    """A checkpoint's per-question accuracies split by domain ({} for a record without them)."""
    pq = c.get("per_question")
    if domains is None or pq is None or len(pq) != len(domains):
        return {}
    pq = np.asarray(pq, dtype=float)
    return {d: pq[domains == d] for d in sorted(set(domains.tolist()))}


def finals(record: dict) -> list[tuple[str, dict]]:
    """(stage, its final evaluation) in cascade order, the starting model first."""
    return [("start (SFT)", record["initial"])] + [
        (n, record["stages"][n]["checkpoints"][-1]) for n in record.get("order", [])
        if record["stages"].get(n, {}).get("checkpoints")]


def stage_changes(record: dict) -> list[tuple[str, dict[str, dict]]]:
    """Per stage: {domain or "mean": paired_gain} of its final checkpoint against the model it started from (the
    previous stage's final one), over the same held-out questions."""
    domains = question_domains(record)
    out = []
    rows = finals(record)
    for (_, before), (name, after) in zip(rows, rows[1:]):
        b, a = by_domain(before, domains), by_domain(after, domains)
        gains = {d: paired_gain(a[d], b[d]) for d in a if d in b}
        if gains:
            gains["mean"] = paired_gain(np.asarray(after["per_question"], float),
                                        np.asarray(before["per_question"], float))
        out.append((name, gains))
    return out


def fmt_gain(g: dict) -> str:
    """"+0.094 [+0.011, +0.177]", bold when the interval excludes 0."""
    text = f"{g['delta']:+.3f} [{g['ci95_low']:+.3f}, {g['ci95_high']:+.3f}]"
    return f"**{text}**" if g["ci95_low"] > 0 or g["ci95_high"] < 0 else text


def plot_accuracy(record: dict, out: Path) -> None:
    rows = checkpoints(record)
    domains = sorted({d for _, c in rows for d in c["domains"]})
    qd = question_domains(record)
    fig, ax = plt.subplots(figsize=(9, 5))
    for d in domains:
        y = [c["domains"].get(d, float("nan")) for _, c in rows]
        line, = ax.plot(range(len(rows)), y, marker="o", label=d)
        bands = [by_domain(c, qd).get(d) for _, c in rows]  # each checkpoint's 95 % interval, where recorded
        if all(b is not None and len(b) > 1 for b in bands):
            lo, hi = zip(*(interval(b) for b in bands))
            ax.fill_between(range(len(rows)), lo, hi, color=line.get_color(), alpha=0.12, lw=0)
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
    for name, c in finals(record):
        lines.append(f"| {name} | " + " | ".join(f"{c['domains'].get(d, float('nan')):.3f}" for d in domains)
                     + f" | {c['accuracy']:.3f} |")
    changes = [(name, g) for name, g in stage_changes(record) if g]
    if changes:
        lines += ["", "## Change over each stage", "",
                  "Each stage's final checkpoint against the model it started from, on the same held-out questions: "
                  "the mean change with its paired 95 % interval; **bold** where the interval excludes 0.", "",
                  "| stage | " + " | ".join(domains) + " | mean |",
                  "| --- | " + " | ".join("---" for _ in domains) + " | --- |"]
        for name, g in changes:
            lines.append(f"| {name} | " + " | ".join(fmt_gain(g[d]) if d in g else "—" for d in domains)
                         + f" | {fmt_gain(g['mean'])} |")
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
              "Sampled per trained: rollouts dispatched per rollout trained (what dynamic filtering and stale or lost "
              "rollouts cost the samplers; 1.00: nothing thrown away).", "",
              "| stage | algorithm | data | steps | status | wall s | dispatched | trained | filtered | stale | lost "
              "| sampled per trained |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in record.get("order", []):
        s = record["stages"].get(name)
        if s is None:
            continue
        summary_path = Path(s["run_dir"]) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        b = summary.get("books", {})
        per_trained = f"{b['dispatched'] / b['trained']:.2f}" if b.get("trained") else "—"
        lines.append(f"| {name} | {s.get('algorithm', '')} | {', '.join(Path(f).name for f in s.get('files', []))} | {s.get('steps', '')} | "
                     f"{s.get('status', '')} | {summary.get('wall_s', float('nan')):.0f} | {b.get('dispatched', '')} | "
                     f"{b.get('trained', '')} | {b.get('filtered', '')} | {b.get('stale', '')} | {b.get('lost', '')} | "
                     f"{per_trained} |")
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out

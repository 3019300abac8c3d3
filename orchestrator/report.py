"""What a stage writes for people: ``metrics.jsonl`` (and its dashboards: orchestrator/trackers.py) as it goes,
``summary.json`` at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .trackers import Trackers


class MetricsLog:
    """One JSON line per evaluation and per step in ``run_dir/metrics.jsonl``, and the same line to the run's
    dashboards (``trackers``: TensorBoard, W&B, MLflow; orchestrator/trackers.py)."""

    def __init__(self, run_dir: Path, trackers: Trackers | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers

    def log(self, metrics: dict) -> dict:
        """Append ``metrics`` with the wall clock (with max_staleness > 0 steps overlap: the time between two lines
        is what a step costs); returns the line written."""
        metrics = {**metrics, "time": time.time()}
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.trackers is not None:
            self.trackers.log(metrics)
        return metrics


def live_metrics(metrics: dict) -> dict:
    """The part of a metrics line the supervisor's live display shows (its heartbeat's ``last``)."""
    return {k: v for k, v in metrics.items()
            if not k.startswith("trainer/") or k.startswith(("trainer/mismatch/", "trainer/mopd/"))}


def write_summary(run_dir: Path, before: dict, after: dict, **rest) -> dict:
    """``summary.json``: every metric before and after the stage, its per-domain accuracy, and ``rest``."""
    books = rest.get("books") or {}
    summary = {
        **{f"{k}_before": v for k, v in before.items()},
        # what filtering cost over the stage: rollouts sampled per rollout trained
        "sampled_per_trained": books.get("dispatched", 0) / max(1, books.get("trained", 0)),
        **{f"{k}_after": v for k, v in after.items()},
        "heldout_domains": {k.split("/", 1)[1]: {"before": v, "after": after.get(k)}
                            for k, v in before.items() if k.startswith("heldout_accuracy/")},
        **rest,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

"""The dashboards a run's metrics go to besides ``run_dir/metrics.jsonl``: TensorBoard, Weights & Biases, MLflow
(``logger=[jsonl,tensorboard,wandb,mlflow]``; sections ``wandb`` and ``mlflow``: supervisor/schema_logging.py).

    trackers = Trackers(["wandb", "mlflow"], RunIdentity.of(cfg))
    trackers.log({"step": 3, "reward_mean": 0.4, "trainer/loss": 1.2})
    trackers.attach([run_dir / "summary.json"])
    trackers.close()

Every dashboard gets what metrics.jsonl holds, under the same names and steps: its numbers (``step`` is the step
axis; ``time`` is the dashboards' own; MLflow, which refuses some characters in names, gets them as ``_``). The
resolved config is logged once, when the run is made. The trackers work on a thread of their own, so a slow server
never holds up a step; one that fails (no network, bad credentials) warns once and is dropped, and the run goes
on (metrics.jsonl has everything). Their run ids are kept in ``run_dir/trackers.json``: a resumed run (the same
run_dir) continues the same runs. A cascade (supervisor/cascade.py) is a run of its own whose stages are grouped
under it: the W&B group, the MLflow parent run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("trackers")
IDS_FILE = "trackers.json"
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # logger name -> its import
WANDB_MODES = ("", "online", "offline", "disabled")
CLOSE_TIMEOUT_S = 60.0  # at the end, how long the dashboards may take to send what is queued


@dataclass
class RunIdentity:
    """Which dashboard runs one run_dir writes to, and what they are told about it."""

    run_dir: Path
    name: str
    """The run's name on the dashboards (the run_dir's name: a cascade's stage is its directory)."""
    config: dict[str, Any]
    """The resolved config, logged once when the dashboards' runs are made."""
    wandb: dict[str, Any] = field(default_factory=dict)
    mlflow: dict[str, Any] = field(default_factory=dict)
    job_type: str = "stage"
    """W&B's job type: stage (a launch) or cascade."""
    ids: dict[str, str] = field(default_factory=dict)
    """The runs this run_dir already has (trackers.json): resumed, not made again."""

    @classmethod
    def of(cls, cfg, job_type: str = "stage") -> RunIdentity:
        """The identity of a launch's (or a cascade's) config: an OmegaConf config with run_dir, wandb, mlflow."""
        from omegaconf import OmegaConf

        run_dir = Path(cfg.run_dir).resolve()
        return cls(run_dir, run_dir.name, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                   dict(cfg.wandb), dict(cfg.mlflow), job_type, read_ids(run_dir))

    def remember(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        path = self.run_dir / IDS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**read_ids(self.run_dir), tracker: run_id}, indent=2))
        os.replace(tmp, path)


def read_ids(run_dir: Path) -> dict[str, str]:
    path = Path(run_dir) / IDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def mlflow_uri(mlflow: dict, run_dir: Path) -> str:
    """The MLflow store: the configured one, else ``MLFLOW_TRACKING_URI``, else a sqlite file in ``run_dir``."""
    return mlflow.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"


def artifact_root(uri: str) -> str | None:
    """Where a new experiment keeps its files: beside a sqlite store (``mlartifacts/``; MLflow's own default is the
    working directory's ``mlruns/``), else where the server says (None)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def problems(cfg) -> list[str]:
    """What is wrong with ``logger`` and its sections, checked at launch (the supervisor's validate)."""
    out = []
    for name in cfg.logger:
        if name == "jsonl":
            continue
        if name not in PACKAGES:
            out.append(f"logger={name!r}: choose among jsonl, {', '.join(PACKAGES)}")
        elif importlib.util.find_spec(PACKAGES[name]) is None:
            out.append(f"logger={name} needs the {PACKAGES[name]} package: pip install -e .[dashboards]")
    if cfg.wandb.mode not in WANDB_MODES:
        out.append(f"wandb.mode={cfg.wandb.mode!r}: choose online, offline or disabled (empty: WANDB_MODE)")
    return out


def numbers(metrics: dict) -> dict[str, float]:
    """The part of a metrics line a dashboard plots: its numbers, less the step axis and the wall clock."""
    return {k: float(v) for k, v in metrics.items()
            if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)}


# ---------------------------------------------------------------------------------------------- the dashboards

class TensorBoardTracker:
    """Scalars under ``run_dir/tensorboard`` (torch's SummaryWriter; TensorBoard has no artifacts)."""

    def __init__(self, run: RunIdentity) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def attach(self, paths: list[Path]) -> None:
        pass

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run (resumed by id), in the configured group; files attached as one artifact."""

    def __init__(self, run: RunIdentity) -> None:
        import wandb

        w, resumed = run.wandb, run.ids.get("wandb")
        self.wandb, self.name = wandb, run.name
        self.run = wandb.init(
            project=w.get("project") or None, entity=w.get("entity") or None, group=w.get("group") or None,
            name=run.name, id=resumed or None, resume="allow", config=None if resumed else run.config,
            dir=str(run.run_dir), mode=w.get("mode") or None, tags=list(w.get("tags") or []) or None,
            job_type=run.job_type, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, init_timeout=float(w.get("init_timeout_s", 60))))
        run.remember("wandb", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def attach(self, paths: list[Path]) -> None:
        artifact = self.wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{self.name}-files"), type="run-files")
        for path in paths:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """An MLflow run (resumed by id), nested under ``mlflow.parent_run_id`` when set; the config as params."""

    BAD_NAME = re.compile(r"[^\w\-. :/]")  # what MLflow refuses in metric and param names
    PARAM_CHARS = 500  # the longest param value every MLflow server takes (config.yaml, attached, has it all)

    def __init__(self, run: RunIdentity) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        m = run.mlflow
        self.client = MlflowClient(mlflow_uri(m, run.run_dir))
        self.run_id = run.ids.get("mlflow", "")
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = m.get("experiment") or "cascade-rl"
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=artifact_root(self.client.tracking_uri))
            tags = {"mlflow.parentRunId": m["parent_run_id"]} if m.get("parent_run_id") else {}
            self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
            params = [Param(self.BAD_NAME.sub("_", k), str(v)[:self.PARAM_CHARS]) for k, v in flatten(run.config)]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        run.remember("mlflow", self.run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.BAD_NAME.sub("_", k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def attach(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def flatten(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"a": {"b": 1}, "c": [2]}`` as ``[("a.b", 1), ("c", [2])]``: lists and empty sections stay values."""
    if isinstance(config, dict) and config:
        return [pair for k, v in config.items() for pair in flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, config)] if prefix else []


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


# ---------------------------------------------------------------------------------------------- the thread

class Trackers:
    """The dashboards of one run, each opened, fed and closed on one thread of their own (queued in order)."""

    def __init__(self, names: list[str], run: RunIdentity) -> None:
        self.names = [n for n in names if n != "jsonl"]
        self.run, self.opened = run, threading.Event()
        self.inbox: queue.Queue = queue.Queue()
        self.failed: dict[str, str] = {}  # tracker -> why it was dropped
        self.thread = None
        if self.names:
            self.thread = threading.Thread(target=self._serve, name="trackers", daemon=True)
            self.thread.start()
        else:
            self.opened.set()

    def log(self, metrics: dict) -> None:
        """Queue a metrics line (its ``step`` the step axis) for every dashboard."""
        if self.thread is not None:
            self.inbox.put(("log", numbers(metrics), int(metrics.get("step", 0))))

    def attach(self, paths: list[Path]) -> None:
        """Queue files (a report, plots, summary.json) to attach to every dashboard's run; missing ones skipped."""
        if self.thread is not None:
            self.inbox.put(("attach", [Path(p) for p in paths if Path(p).is_file()]))

    def run_ids(self, timeout_s: float = CLOSE_TIMEOUT_S) -> dict[str, str]:
        """The dashboards' run ids, once they are open (a cascade hands its MLflow run to its stages)."""
        self.opened.wait(timeout_s)
        return {k: v for k, v in self.run.ids.items() if k in self.names and k not in self.failed}

    def close(self, ok: bool = True) -> None:
        """Send what is queued and finish every run (FAILED when not ``ok``); gives up after 60 s."""
        if self.thread is None:
            return
        self.inbox.put(("close", ok))
        self.thread.join(CLOSE_TIMEOUT_S)
        if self.thread.is_alive():
            log.warning("the dashboards (%s) took over %g s to finish; leaving them (metrics.jsonl has every metric)",
                        ", ".join(self.names), CLOSE_TIMEOUT_S)
        self.thread = None

    def _serve(self) -> None:
        live = {}
        for name in self.names:
            try:
                live[name] = TRACKERS[name](self.run)
            except Exception as e:  # noqa: BLE001 (a dashboard never stops the run)
                self._drop(name, e)
        self.opened.set()
        while True:
            op, *args = self.inbox.get()
            for name, tracker in list(live.items()):
                try:
                    getattr(tracker, op)(*args)
                except Exception as e:  # noqa: BLE001
                    self._drop(name, e)
                    live.pop(name)
            if op == "close":
                return

    def _drop(self, name: str, error: Exception) -> None:
        self.failed[name] = f"{type(error).__name__}: {error}"
        log.warning("logger=%s failed (%s); the run goes on without it (run_dir/metrics.jsonl has every metric)",
                    name, self.failed[name][:300])

"""Where a run's metrics go besides ``run_dir/metrics.jsonl`` (``logger=[jsonl,tensorboard,wandb,mlflow]``) and
the options of each dashboard (orchestrator/trackers.py). Sections of the launch schema (supervisor/schema.py) and
of a cascade's (supervisor/cascade.py), whose stages are grouped under it; every field documented where declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # jsonl is always written; the others are orchestrator/trackers.py's


@dataclass
class WandbConfig:
    """Weights & Biases (``logger=[...,wandb]``, ``pip install -e .[dashboards]``). Credentials as W&B reads them
    (``WANDB_API_KEY``, ``wandb login``)."""

    project: str = "cascade-rl"
    """The W&B project of the run."""
    entity: str = ""
    """The team or user (empty: the API key's default entity)."""
    group: str = ""
    """The run's group; a cascade fills it with its own (every stage of one cascade in one group)."""
    mode: str = ""
    """online | offline (written under run_dir/wandb, uploaded later with ``wandb sync``) | disabled; empty:
    ``WANDB_MODE``, else online."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    init_timeout_s: float = 60.0
    """How long starting the W&B run may take before the logger gives up (warns once; the run goes on)."""


@dataclass
class MlflowConfig:
    """MLflow (``logger=[...,mlflow]``, ``pip install -e .[dashboards]``)."""

    tracking_uri: str = ""
    """The tracking server or store: ``http://HOST:5000``, ``sqlite:///path/mlflow.db``, ...; empty:
    ``MLFLOW_TRACKING_URI``, else ``sqlite:///RUN_DIR/mlflow.db`` (a cascade's own run_dir for all its stages)."""
    experiment: str = "cascade-rl"
    """The experiment the run is filed under (made when missing)."""
    parent_run_id: str = ""
    """The run this one is nested under; a cascade fills it with its own run (every stage a child of it)."""

"""The run's dashboards (orchestrator/trackers.py), in one process: TensorBoard's events, W&B's offline run files
and MLflow's sqlite store hold what metrics.jsonl holds; a resumed run_dir continues the same runs; a dashboard
that fails warns once and the metrics go on."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from cascade_rl.orchestrator.report import MetricsLog
from cascade_rl.orchestrator.trackers import RunIdentity, Trackers, flatten, read_ids

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from dashboards import jsonl_by_step, mlflow_metrics, wandb_runs  # noqa: E402

LINES = [{"step": 0, "heldout_accuracy": 0.25, "heldout_accuracy/math": 0.5},
         {"step": 0, "reward_mean": 0.25, "trainer/loss": -0.5, "note": "text is skipped", "ok": True},
         {"step": 1, "reward_mean": 0.75, "trainer/loss": -0.25, "odd name (x)": 2}]


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One MLflow store for the module (making its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def identity(run_dir, **mlflow):
    config = {"run": {"steps": 2, "seed": 0}, "data": {"files": ["a.jsonl"]}, "logger": ["jsonl", "wandb", "mlflow"]}
    return RunIdentity(run_dir, run_dir.name, config, {"project": "p", "group": "g", "mode": "offline"},
                       {"experiment": "e", **mlflow}, ids=read_ids(run_dir))


def write(run_dir, names, lines, **mlflow):
    trackers = Trackers(names, identity(run_dir, **mlflow))
    log = MetricsLog(run_dir, trackers)
    for line in lines:
        log.log(line)
    (run_dir / "summary.json").write_text("{}")
    trackers.attach([run_dir / "summary.json", run_dir / "missing.png"])
    trackers.close()
    return trackers


def test_tensorboard_gets_the_numbers_of_each_line(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write(tmp_path, ["jsonl", "tensorboard"], LINES)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 0.25), (1, 0.75)]
    assert [e.value for e in events.Scalars("trainer/loss")] == [-0.5, -0.25]
    assert "note" not in events.Tags()["scalars"] and "time" not in events.Tags()["scalars"]


def test_wandb_and_mlflow_hold_metrics_jsonl_and_a_resumed_run_dir_continues_their_runs(tmp_path, uri):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = write(run_dir, ["jsonl", "wandb", "mlflow"], LINES, tracking_uri=uri)
    assert not first.failed
    ids = read_ids(run_dir)
    write(run_dir, ["jsonl", "wandb", "mlflow"], [{"step": 2, "reward_mean": 0.7, "trainer/loss": 0.0}],
          tracking_uri=uri)
    assert read_ids(run_dir) == ids  # the same runs, continued

    expected = jsonl_by_step(run_dir / "metrics.jsonl")
    assert sorted(expected) == [0, 1, 2] and expected[0]["heldout_accuracy/math"] == 0.5

    runs = wandb_runs(run_dir)
    assert [r["id"] for r in runs] == [ids["wandb"]] * 2 and runs[0]["group"] == "g"
    history = {}
    for r in runs:
        history.update(r["history"])
    assert history == expected
    assert runs[0]["config"]["run"] == {"steps": 2, "seed": 0}  # the config, logged once
    assert "run" not in runs[1]["config"]
    assert [r["artifacts"] for r in runs] == [["run-files"], ["run-files"]] and runs[0]["job_type"] == "stage"

    from mlflow.tracking import MlflowClient

    got = mlflow_metrics(uri, ids["mlflow"])
    assert got == {s: {k.replace("(", "_").replace(")", "_"): v for k, v in m.items()} for s, m in expected.items()}
    client = MlflowClient(uri)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["run.steps"] == "2" and run.data.params["data.files"] == "['a.jsonl']"
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert [a.path for a in client.list_artifacts(ids["mlflow"])] == ["summary.json"]


def test_a_nested_mlflow_run_names_its_parent(tmp_path, uri):
    from mlflow.tracking import MlflowClient

    parent = tmp_path / "cascade"
    parent.mkdir()
    write(parent, ["mlflow"], [], tracking_uri=uri)
    stage = parent / "stage"
    stage.mkdir()
    write(stage, ["mlflow"], LINES, tracking_uri=uri, parent_run_id=read_ids(parent)["mlflow"])
    run = MlflowClient(uri).get_run(read_ids(stage)["mlflow"])
    assert run.data.tags["mlflow.parentRunId"] == read_ids(parent)["mlflow"]


def test_a_failing_dashboard_warns_once_and_the_metrics_go_on(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    bad = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"  # a store that cannot be made
    with caplog.at_level(logging.WARNING, logger="trackers"):
        trackers = write(tmp_path, ["jsonl", "mlflow"], LINES * 3, tracking_uri=bad)
    warnings = [r.getMessage() for r in caplog.records if r.name == "trackers"]
    assert len(warnings) == 1 and "logger=mlflow failed" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert list(trackers.failed) == ["mlflow"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(LINES) * 3


def test_flatten_names_every_leaf_by_its_dotted_path():
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1, 2]}) == [("a.b", 1), ("a.c", {}), ("d", [1, 2])]


@pytest.mark.parametrize("override, message", [
    ("logger=[jsonl,neptune]", "logger='neptune': choose among jsonl, tensorboard, wandb, mlflow"),
    ("wandb.mode=sometimes", "wandb.mode='sometimes': choose online, offline or disabled"),
])
def test_a_launch_refuses_an_unknown_logger(override, message, tiny_model, math_data, tmp_path):
    from test_launch import cli

    r = cli("launch", "tiny", f"run_dir={tmp_path}", f"model.path={tiny_model}", *math_data, override, "--dry-run")
    assert r.returncode != 0 and message in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr

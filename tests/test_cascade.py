"""The cascade runner (supervisor/cascade.py) and its report: a real two-stage cascade on the tiny model
(GRPO, then MOPD with teacher servers chosen from the record), resumable, with the report and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from cascade_rl.supervisor.cascade import Cascade, load_config
from cascade_rl.supervisor.config_errors import ConfigError
from cascade_rl.supervisor.report import write_report

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from console_lines import foreign_lines  # noqa: E402

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


def tiny_cascade(tmp_path: Path, model: str, data: dict) -> Path:
    """Two stages of two steps: GRPO on instruction following, then MOPD over all four domains."""
    heldout = [data["heldout"][t] for t in ("arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if")]
    rl = ",".join(f"{data['rl'][t]}:1" for t in ("arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if"))
    path = tmp_path / "cascade.yaml"
    path.write_text(f"""
run_dir: {tmp_path / "run"}
model: {model}
run: tiny
overrides: [orchestrator.eval_n=0, orchestrator.eval_greedy=false, run.steps=2, trainer.save_every=1,
            supervisor.progress=plain]
eval: {{files: {json.dumps(heldout)}, per_domain: 4, n: 2, max_tokens: 24}}
logger: [jsonl, wandb, mlflow]
wandb: {{mode: offline}}
stages:
  # a random model scores 0 everywhere: dynamic filtering (the IF-RL preset's) would drop every group
  - {{name: if_rl, stage: if_rl, overrides: ["data.files=[{data['rl']['arithmetic_if']}]", sampling.max_tokens=24,
                                             orchestrator.dynamic_filtering=false]}}
  - {{name: mopd, stage: mopd, teachers: best,
      overrides: ["data.files=[{rl}]", sampling.max_tokens=24, run.steps=2, trainer.warmup_steps=1]}}
""")
    return path


@pytest.mark.slow
def test_cascade_runs_stages_records_every_checkpoint_and_distils_from_the_best(tiny_model, tiny_data, tmp_path):
    config = tiny_cascade(tmp_path, tiny_model, tiny_data)
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run([*CLI, "cascade", str(config)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    run_dir = tmp_path / "run"
    # the console: the supervisor's lines and the report's path, no dependency's; what the libraries print is in
    # the logs (supervisor/console.py): the cascade process's own, and each worker's (transformers' bar, the trainer's)
    assert not foreign_lines(r.stdout + r.stderr), "\n".join(foreign_lines(r.stdout + r.stderr))
    assert f"report {run_dir / 'report.md'}" in r.stdout
    assert (run_dir / "logs" / "cascade.log").is_file()
    assert "Loading weights" in (run_dir / "if_rl" / "logs" / "trainer-0.log").read_text()
    record = json.loads((run_dir / "cascade.json").read_text())
    assert record["order"] == ["if_rl", "mopd"]
    domains = {"math", "mcqa", "structured_output", "instruction_following"}
    assert set(record["initial"]["domains"]) == domains  # every domain evaluated, not only the trained ones
    for name in record["order"]:
        stage = record["stages"][name]
        assert stage["status"] == "done"
        assert [c["step"] for c in stage["checkpoints"]] == [1, 2]  # save_every=1: every checkpoint evaluated
        assert all(set(c["domains"]) == domains for c in stage["checkpoints"])
        summary = json.loads((Path(stage["run_dir"]) / "summary.json").read_text())
        assert summary["books"]["lost"] == 0 and summary["books"]["trained"] > 0
    # MOPD started from the first stage's final checkpoint, taught by the best checkpoint per domain
    mopd = record["stages"]["mopd"]
    assert mopd["model"] == record["stages"]["if_rl"]["final"]
    candidates = [record["initial"], *record["stages"]["if_rl"]["checkpoints"]]
    for domain in sorted(domains):
        best = max(c["domains"][domain] for c in candidates)
        chosen = next(c for c in candidates if c["path"] == mopd["teachers"][domain])
        assert chosen["domains"][domain] == best
    metrics = [json.loads(x) for x in (run_dir / "mopd" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "version" in m]
    assert len(steps) == 2 and all("trainer/mopd/reverse_kl" in m for m in steps)
    # the report: tables and two real PNGs
    report = (run_dir / "report.md").read_text()
    assert "## Accuracy after each stage" in report and "## Teachers of mopd" in report
    assert "| if_rl |" in report and "| mopd |" in report
    assert "sampled per trained |" in report  # each stage's filtering cost
    for png in ("accuracy.png", "training.png"):
        assert matplotlib.image.imread(run_dir / png).shape[0] > 100

    # a rerun skips the finished stages (the record says done) and changes nothing
    r2 = subprocess.run([*CLI, "cascade", str(config)], capture_output=True, text=True, env=env, timeout=300)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert r2.stdout.count("skipping") == 2
    assert json.loads((run_dir / "cascade.json").read_text())["stages"] == record["stages"]
    dashboards_hold_the_cascade(run_dir, record)


def dashboards_hold_the_cascade(run_dir: Path, record: dict) -> None:
    """logger=[jsonl,wandb,mlflow] on the cascade: one W&B group (the cascade's run and each stage's), one MLflow
    store with the cascade's run the stages' parent; each stage's metrics.jsonl on both; the report and plots
    attached to the cascade's runs; the rerun continued the cascade's runs, not made new ones."""
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from dashboards import jsonl_by_step, mlflow_metrics, wandb_runs

    cascade_ids = json.loads((run_dir / "trackers.json").read_text())
    runs = wandb_runs(run_dir)
    assert [r["id"] for r in runs] == [cascade_ids["wandb"]] * 2  # the first run and the rerun: one W&B run
    assert runs[0]["job_type"] == "cascade" and runs[0]["group"] == record["group"]
    assert runs[0]["history"][0]["heldout_accuracy"] == record["initial"]["accuracy"]
    assert sorted(runs[0]["history"]) == [0, 1, 2]  # the starting model, after each stage
    assert any(r["artifacts"] for r in runs)
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(uri)
    assert {a.path for a in client.list_artifacts(cascade_ids["mlflow"])} >= {
        "report.md", "accuracy.png", "training.png", "cascade.json"}
    for name in record["order"]:
        stage_dir = run_dir / name
        ids = json.loads((stage_dir / "trackers.json").read_text())
        expected = jsonl_by_step(stage_dir / "metrics.jsonl")
        [stage] = wandb_runs(stage_dir)
        assert stage["group"] == record["group"] and stage["job_type"] == "stage" and stage["id"] == ids["wandb"]
        assert stage["history"] == expected
        assert mlflow_metrics(uri, ids["mlflow"]) == expected
        run = client.get_run(ids["mlflow"])
        assert run.data.tags["mlflow.parentRunId"] == cascade_ids["mlflow"] and run.info.status == "FINISHED"
        assert run.data.params["run.steps"] == "2"


def test_teachers_best_picks_each_domains_best_checkpoint_and_pins_explicit_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {tmp_path}\neval: {{files: [heldout.jsonl]}}\n"
                    "stages: [{name: a}, {name: b}]\n")
    cascade = Cascade(load_config(str(path), []))

    def ev(path, step, **acc):
        return {"path": path, "step": step, "domains": acc, "accuracy": sum(acc.values()) / len(acc)}

    cascade.record.update(initial=ev("/sft", 0, math=0.5, mcqa=0.2),
                          stages={"a": {"checkpoints": [ev("/a1", 1, math=0.7, mcqa=0.1), ev("/a2", 2, math=0.7,
                                                                                              mcqa=0.3)]},
                                  "b": {"checkpoints": [ev("/b1", 1, math=0.6, mcqa=0.3)]}})
    # ties go to the earliest checkpoint: /a1 for math (0.7 twice), /a2 for mcqa (0.3 at a2 and b1)
    assert cascade.teachers("best", ["math", "mcqa"]) == {"math": "/a1", "mcqa": "/a2"}
    assert cascade.teachers({"math": str(tmp_path)}, ["math"]) == {"math": str(tmp_path.resolve())}
    with pytest.raises(ValueError, match="no recorded checkpoint"):
        cascade.teachers("best", ["code"])


def test_load_config_refuses_unnamed_or_duplicate_stages(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stages: [{name: a}, {name: a}]\n")
    with pytest.raises(ConfigError, match="distinct"):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match="no cascade config"):
        load_config("no-such-cascade", [])
    path.write_text("stages: [{name: a}]\n")
    with pytest.raises(ConfigError, match="eval.files is empty"):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match=r"eval.filez: no such setting \(did you mean eval.files\?\)"):
        load_config(str(path), ["eval.filez=[x]"])


def test_report_from_a_record(tmp_path):
    stage_dir = tmp_path / "s1"
    stage_dir.mkdir()
    (stage_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in [
        {"step": 1, "version": 1, "reward_mean": 0.2}, {"step": 2, "version": 2, "reward_mean": 0.4}]) + "\n")
    (stage_dir / "summary.json").write_text(json.dumps({"wall_s": 12.0, "books": {
        "dispatched": 16, "trained": 16, "filtered": 0, "stale": 0, "lost": 0}}))
    ev = {"n": 2, "temperature": 1.0, "questions": {"math": 4}, "seconds": 1.0}
    record = {"model": "/sft", "order": ["s1"],
              "initial": {"path": "/sft", "step": 0, "accuracy": 0.25, "domains": {"math": 0.25}, **ev},
              "stages": {"s1": {"run_dir": str(stage_dir), "status": "done", "algorithm": "grpo", "files": ["/d/rl.jsonl"],
                                "steps": 2, "checkpoints": [
                                    {"path": "/c2", "step": 2, "accuracy": 0.5, "domains": {"math": 0.5}, **ev}]}}}
    report = write_report(tmp_path, record).read_text()
    assert "| start (SFT) | 0.250 | 0.250 |" in report
    assert "| s1 | 0.500 | 0.500 |" in report
    assert "| s1 | grpo | rl.jsonl | 2 | done | 12 | 16 | 16 | 0 | 0 | 0 |" in report
    assert matplotlib.image.imread(tmp_path / "accuracy.png").ndim == 3

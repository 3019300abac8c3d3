"""Cascade runner: RL stages one after another, every checkpoint evaluated per domain, MOPD teachers
chosen from that record (docs/ARCHITECTURE.md §7, the paper's Figure 2 pipeline).

    cascade-rl cascade demo                        # configs/cascade/demo.yaml
    cascade-rl cascade demo run_dir=runs/c2 eval.n=8
    cascade-rl cascade my_cascade.yaml             # a file of the same form

A cascade config names a starting checkpoint (the SFT model), held-out files
(``eval.files``: every domain of the cascade, evaluated after every stage, not
only the domains a stage trains) and the stages in order, each with its own
training files (``data.files=[...]`` among its overrides). Each stage is a
``cascade-rl launch`` of a run preset plus a stage preset plus overrides,
started from the previous stage's final checkpoint, in ``<run_dir>/<stage>``;
its ``data.eval_files`` are the cascade's held-out files, so no stage trains on
a held-out prompt.
After a stage, every checkpoint it saved is evaluated on each domain's
held-out questions (orchestrator/evaluate.py) and recorded in
``<run_dir>/cascade.json``. A stage with ``teachers: best`` (MOPD) gets, per
domain it trains, the recorded checkpoint with the best accuracy on that
domain (the starting model included); ``teachers: {domain: path}`` pins them.

A LoRA stage (``trainer.lora``) saves adapters, not models. It hands the next stage the MERGED model: its final
adapter merged into its base once, into ``<stage_dir>/merged`` (supervisor/export.py ``merge_to``, the function
of ``cascade-rl export --merge``; reused when there), is the next stage's ``model.path``. The next stage's own
adapter is then trained on that model; stacking the stages' adapters instead would make every sampler hold several
per request, and vLLM applies one adapter per request. The record keeps the adapter checkpoints themselves:
they are evaluated through a merged copy (deleted after), and a MOPD teacher chosen among them is served as an
adapter (teachers of one base share one server: teachers/server.py).

Rerunning skips the stages the record marks done; a stage that was cut off
resumes from its newest checkpoint. The report (report.md and PNG plots) is
rewritten after every stage (supervisor/report.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cascade_rl.data.prepare import prepare
from cascade_rl.data.promptset import PromptSet
from cascade_rl.learner import checkpoint_dirs
from cascade_rl.orchestrator.trackers import RunIdentity, Trackers, mlflow_uri
from cascade_rl.orchestrator.trackers import problems as tracker_problems
from cascade_rl.verifiers.registry import JUDGED_DOMAINS, SETTINGS

from .config import CONFIG_DIR, compose, validate
from .config_errors import ConfigError, explain
from .judge import served_name, serving_judge
from .run_data import BadData, registered_domains
from .schema import DataConfig
from .schema_logging import MlflowConfig, WandbConfig


@dataclass
class EvalConfig:
    files: list[str] = field(default_factory=list)
    """Held-out data files of every domain of the cascade (rows as data/rows.py); accuracy is recorded per
    domain, and every stage gets them as its data.eval_files."""
    per_domain: int = 0
    """At most this many held-out rows per domain, the first in file order (0: all)."""
    engine: str = "torch"
    """Sampler engine of the evaluation: torch (qwen3, qwen3_moe, nemotron_h) | vllm (any architecture vLLM serves)."""
    device: str = "auto"
    """Where the evaluation samples, between stages (no stage holds a GPU then): auto (the first GPU this
    process sees, else the CPU) | cpu | cuda | cuda:N."""
    n: int = 4
    """Samples per question (avg@n)."""
    temperature: float = 1.0
    max_tokens: int = 96
    seed: int = 0
    judge_args: list[str] = field(default_factory=list)
    """Options added to ``verifier.judge.args`` for the judge the evaluations call (served for the whole cascade,
    busy only while an evaluation scores), e.g. ``[--threads, 2]``: the stages' judge shares the CPU with the
    sampler and the trainer, the evaluation's has it to itself."""


@dataclass
class StageConfig:
    name: str = ""
    """Names the stage's directory under run_dir and its row in the record."""
    run: str = ""
    """Run preset (configs/run/NAME.yaml); empty: the cascade's ``run``."""
    stage: str = ""
    """Stage preset (configs/stage/NAME.yaml): what this stage of the paper changes."""
    overrides: list[str] = field(default_factory=list)
    """Launch overrides for this stage (after the cascade's ``overrides``)."""
    teachers: Any = None
    """MOPD: "best" (per domain, the recorded checkpoint with the best accuracy) or {domain: path}."""


@dataclass
class CascadeConfig:
    run_dir: str = "runs/cascade"
    model: str = "models/tiny-sft"
    """The starting checkpoint (HF directory): version 0 of the first stage."""
    run: str = ""
    """Run preset every stage launches with, unless the stage names its own."""
    overrides: list[str] = field(default_factory=list)
    """Launch overrides of every stage."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    stages: list[StageConfig] = field(default_factory=list)
    report: bool = True
    """Write report.md and the PNG plots after every stage."""
    logger: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where metrics go (every stage's, and the cascade's own: its held-out accuracy after each stage, its report
    and plots at the end): jsonl and any of tensorboard | wandb | mlflow. Set here, not in a stage's overrides:
    the stages are one W&B group and children of the cascade's MLflow run."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B for the cascade and its stages (its group: empty, the run_dir's name and an id kept in cascade.json)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow for the cascade (the parent run) and its stages (its children), in one store."""


def load_config(name: str, overrides: list[str]) -> DictConfig:
    """configs/cascade/NAME.yaml (or a YAML path) over the schema's defaults, then ``key=value`` overrides."""
    path = Path(name)
    if not path.is_file():
        path = CONFIG_DIR / "cascade" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIG_DIR / "cascade").glob("*.yaml"))
        raise ConfigError(f"no cascade config {name!r} (known: {known}, or a YAML path)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(CascadeConfig), OmegaConf.load(path),
                              OmegaConf.from_dotlist(overrides))
    except Exception as e:  # an unknown key or a value of the wrong type: one line, exit 2
        raise ConfigError(f"{path}: {explain(e, CascadeConfig)}") from None
    names = [s.name for s in cfg.stages]
    if not names or "" in names or len(set(names)) != len(names):
        raise ConfigError(f"cascade {name}: stages need distinct, non-empty names (got {names})")
    if not cfg.eval.files:
        raise ConfigError(f"cascade {name}: eval.files is empty: name the held-out files of every domain")
    if wrong := tracker_problems(cfg):
        raise ConfigError(f"cascade {name}: " + "; ".join(wrong))
    return cfg


class Cascade:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.record_path = self.run_dir / "cascade.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.exists() else {
            "model": str(Path(cfg.model).resolve()), "stages": {}}
        self.record["order"] = [s.name for s in cfg.stages]
        self.record.setdefault("group", f"{self.run_dir.name}-{os.urandom(3).hex()}")  # its stages' W&B group
        self.heldout: list = []  # the held-out rows, loaded (and validated) when the cascade runs
        self.thinking = True  # rendered as the stages render their prompts (data.thinking)
        self.trackers: Trackers | None = None  # the cascade's own dashboards, open while it runs

    def load_heldout(self) -> list:
        """The held-out rows, validated as a launch validates its data (bad rows refuse the cascade)."""
        from cascade_rl.data.tokenizer import load_tokenizer

        e = self.cfg.eval
        # what every stage launches with (the cascade's run preset and overrides): its reward modules score the
        # held-out rows too, and its prompts are rendered the same way
        common = compose(self.cfg.run or None, list(self.cfg.overrides), check=False)
        self.thinking = common.data.thinking
        self.common = common  # multi-turn rows are evaluated with the stages' environments and turn limit
        data = OmegaConf.structured(DataConfig(eval_files=list(e.files), eval_per_domain=e.per_domain,
                                               thinking=self.thinking))
        out = self.run_dir / "eval_data"
        plugins = list(common.verifier.plugins)
        report = prepare(data, load_tokenizer(self.cfg.model), out, registered_domains(plugins))
        if report.bad:
            raise BadData(report)
        return PromptSet(out / "eval.arrow").rows()

    def run(self) -> int:
        self.heldout = self.load_heldout()
        # every evaluation's per_question is in this order: the report pairs them question by question
        self.record["heldout"] = {"ids": [r.id for r in self.heldout], "domains": [r.domain for r in self.heldout]}
        identity = RunIdentity.of(self.cfg, job_type="cascade")
        identity.wandb["group"] = identity.wandb["group"] or self.record["group"]
        self.trackers = Trackers(list(self.cfg.logger), identity)
        rc = 1
        try:
            with self.judge():  # one judge server for every evaluation of the cascade; idle while the stages train
                rc = self.run_stages()
        finally:
            self.trackers.attach([self.run_dir / name for name in ("report.md", "accuracy.png", "training.png",
                                                                   "cascade.json")])
            self.trackers.close(ok=rc == 0)
        return rc

    def run_stages(self) -> int:
        if "initial" not in self.record:
            self.record["initial"] = self.evaluate(self.record["model"], step=0)
            self.save()
        self.track(0, self.record["initial"])
        model = self.record["model"]
        for index, stage in enumerate(self.cfg.stages, 1):
            done = self.record["stages"].get(stage.name, {})
            if done.get("status") == "done" and Path(done["final"]).is_dir():
                print(f"cascade: {stage.name} done earlier (final {done['final']}); skipping")
                model = self.handoff(done["final"], self.run_dir / stage.name)
                continue
            rc = self.run_stage(stage, model)
            if rc != 0:
                self.record["stages"][stage.name] = {**self.record["stages"].get(stage.name, {}), "status": "failed",
                                                     "rc": rc}
                self.save()
                print(f"cascade: stage {stage.name} failed (rc {rc}); rerun the same command to resume it")
                return rc
            model = self.handoff(self.record["stages"][stage.name]["final"], self.run_dir / stage.name)
            if checkpoints := self.record["stages"][stage.name].get("checkpoints"):
                self.track(index, checkpoints[-1])  # its final checkpoint (one done earlier was logged then)
        report = f"; report {self.run_dir / 'report.md'}" if self.cfg.report else ""
        print(f"cascade: done; record {self.record_path}{report}")
        return 0

    def run_stage(self, stage: DictConfig, model: str) -> int:
        from .launch import Supervisor

        stage_dir = self.run_dir / stage.name
        launch = self.stage_config(stage, model, stage_dir)
        entry = {"status": "running", "run_dir": str(stage_dir), "model": model, "stage": stage.stage,
                 "files": list(launch.data.files), "algorithm": launch.run.algorithm, "steps": launch.run.steps,
                 "teachers": dict(launch.teacher.checkpoints)}
        self.record["stages"][stage.name] = entry
        self.save()
        print(f"cascade: stage {stage.name} ({launch.run.algorithm} on {len(launch.data.files)} files, "
              f"{launch.run.steps} steps) from {model}")
        rc = Supervisor(launch).run()
        if rc != 0:
            return rc
        ckpts = sorted((p for p in (stage_dir / "checkpoints").glob("step_*") if p.is_dir()),
                       key=lambda p: int(p.name.removeprefix("step_")))
        entry["checkpoints"] = [self.evaluate(str(p), int(p.name.removeprefix("step_"))) for p in ckpts]
        final = checkpoint_dirs.latest(stage_dir / "checkpoints")
        entry.update(status="done", final=str(final))
        self.save()
        return 0

    @staticmethod
    def handoff(final: str, stage_dir: Path) -> str:
        """The model the next stage starts from: the stage's final checkpoint, or, a LoRA checkpoint, its merge
        into ``<stage_dir>/merged`` (made once, reused when there)."""
        from cascade_rl.weights.adapters import is_adapter

        from .export import merge_to

        if not is_adapter(Path(final)):
            return final
        merged = stage_dir / "merged"
        if not (merged / "config.json").is_file():
            print(f"cascade: merging the LoRA checkpoint {final} into its base: {merged}")
            merge_to(final, merged)
        return str(merged)

    def stage_config(self, stage: DictConfig, model: str, stage_dir: Path) -> DictConfig:
        """The stage's launch config: run preset, stage preset, the cascade's and the stage's overrides."""
        e = self.cfg.eval
        overrides = [f"model.path={model}", f"run_dir={stage_dir}",
                     *([f"stage={stage.stage}"] if stage.stage else []), *self.cfg.overrides, *stage.overrides]
        if checkpoint_dirs.latest(stage_dir / "checkpoints") is not None:  # cut off earlier: continue it
            overrides.append("resume=true")
        launch = compose(stage.run or self.cfg.run or None, overrides, check=False)
        launch.data.eval_files, launch.data.eval_per_domain = list(e.files), e.per_domain
        if stage.teachers is not None:  # every evaluated domain gets one; the stage's data decides which teach
            launch.teacher.checkpoints = self.teachers(stage.teachers, sorted(self.record["initial"]["domains"]))
        # one W&B group, one MLflow store with the cascade's run as the stages' parent
        launch.logger = list(self.cfg.logger)
        launch.wandb = OmegaConf.merge(self.cfg.wandb, {"group": self.cfg.wandb.group or self.record["group"]})
        launch.mlflow = OmegaConf.merge(self.cfg.mlflow, {
            "tracking_uri": mlflow_uri(self.cfg.mlflow, self.run_dir),
            "parent_run_id": self.trackers.run_ids().get("mlflow", "") if self.trackers else ""})
        validate(launch)
        return launch

    def track(self, index: int, evaluated: dict) -> None:
        """The cascade's dashboards: held-out accuracy per domain after stage ``index`` (0: the starting model)."""
        if self.trackers:
            self.trackers.log({"step": index, "heldout_accuracy": evaluated["accuracy"],
                               **{f"heldout_accuracy/{d}": a for d, a in evaluated["domains"].items()}})

    def teachers(self, spec: Any, wanted: list[str]) -> dict[str, str]:
        """Per domain, the checkpoint that teaches it: pinned, or the best recorded one ("best")."""
        if spec != "best":
            return {d: str(Path(p).resolve()) for d, p in dict(spec).items()}
        candidates = [self.record["initial"]] + [c for name in self.record["order"]
                                                  for c in self.record["stages"].get(name, {}).get("checkpoints", [])]
        out = {}
        for d in wanted:
            scored = [c for c in candidates if d in c["domains"]]
            if not scored:
                raise ValueError(f"no recorded checkpoint has an accuracy for {d!r}; evaluate it (eval.task)")
            best = max(scored, key=lambda c: c["domains"][d])  # the first of equals: the earliest checkpoint
            out[d] = best["path"]
        return out

    @contextlib.contextmanager
    def judge(self) -> Iterator[None]:
        """The judge model served for the evaluations of this block (the whole cascade), when the held-out set has judged domains
        (RLHF's genrm, long-context's llm_judge) and the stages' ``verifier.judge.serve`` serves one (a judge at
        ``verifier.judge.base_url`` is used as it is): the verifiers called here find it in ``SETTINGS``."""
        judge = self.common.verifier.judge
        if not {r.domain for r in self.heldout} & JUDGED_DOMAINS:
            yield
            return
        if self.cfg.eval.judge_args:
            judge = OmegaConf.merge(judge, {"args": [*judge.args, *self.cfg.eval.judge_args]})
        with serving_judge(judge, self.run_dir / "logs" / "judge-eval.log") as base_url:
            SETTINGS["judge"] = {**OmegaConf.to_container(judge, enum_to_str=True), "base_url": base_url,
                                 "model": served_name(judge)}
            try:
                yield
            finally:
                SETTINGS.pop("judge", None)

    def evaluate(self, path: str, step: int) -> dict:
        from cascade_rl.orchestrator.evaluate import evaluate_checkpoint

        e = self.cfg.eval
        c = self.common
        with self.servable(path) as model:
            result = evaluate_checkpoint(model, self.heldout, e.n, e.temperature, e.max_tokens, e.seed, self.thinking,
                                         e.engine, e.device, dict(c.environment.defaults),
                                         c.orchestrator.max_turns, OmegaConf.to_container(c.environment))
        print(f"cascade: {path}: " + ", ".join(f"{d} {a:.3f}" for d, a in result["domains"].items()))
        return {"path": str(Path(path).resolve()), "step": step, **result}

    @contextlib.contextmanager
    def servable(self, path: str) -> Iterator[str]:
        """A model directory the samplers load for checkpoint ``path``: itself, or, a LoRA checkpoint, its merge
        into a directory under run_dir deleted after the block."""
        from cascade_rl.weights.adapters import is_adapter

        from .export import merge_to

        if not is_adapter(Path(path)):
            yield path
            return
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=".merged-", dir=self.run_dir))
        try:
            yield str(merge_to(path, tmp / "model"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def save(self) -> None:
        tmp = self.record_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=2))
        os.replace(tmp, self.record_path)
        if self.cfg.report:
            from .report import write_report

            write_report(self.run_dir, self.record)

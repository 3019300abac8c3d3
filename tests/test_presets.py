"""Every preset on disk launches (``cascade-rl launch PRESET --dry-run``: composed with validation on, its data
prepared as the supervisor prepares it) with prompts of the domains it is for. The presets are globbed, so a new
one is covered as soon as it exists; a new stage preset must say here which prompts it is for.

Run presets and cascades launch as written, from a directory laid out as ``make run`` lays it out
(``models/tiny-sft``, ``runs/data/cascade`` from ``cascade-rl make-data cascade``), with the built-in files where
they name none. Stage presets launch at the paper's scale with prompts of their domains: the built-in files, or
a few rows written here for the domains the built-in tasks lack (genrm, llm_judge, code, tool_call).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cascade_rl.supervisor.cascade import Cascade, load_config
from cascade_rl.supervisor.config import CONFIG_DIR, compose
from cascade_rl.supervisor.config_errors import ConfigError
from cascade_rl.supervisor.run_data import prepare_run_data
from cascade_rl.verifiers.registry import JUDGED_DOMAINS

RUN_PRESETS = sorted(p.stem for p in (CONFIG_DIR / "run").glob("*.yaml"))
STAGE_PRESETS = sorted(p.stem for p in (CONFIG_DIR / "stage").glob("*.yaml"))
CASCADES = sorted(p.stem for p in (CONFIG_DIR / "cascade").glob("*.yaml"))

# Rows of the domains no built-in task has, as a user would write them (docs/ARCHITECTURE.md §8).
WRITTEN = {
    "genrm": [{"prompt": f"Write a short poem about {topic}.", "domain": "genrm", "answer": ""}
              for topic in ("autumn", "the sea", "a train", "coffee")],
    "llm_judge": [{"prompt": f"{'The archive lists every city of the survey. ' * 40}Question: which city is #{i}?",
                   "domain": "llm_judge", "answer": city} for i, city in enumerate(("Paris", "Lima", "Oslo", "Kyiv"))],
    "code": [{"prompt": f"Read two integers from stdin and print their {op}.", "domain": "code", "answer": "",
              "metadata": {"tests": [{"input": "6 3\n", "output": f"{out}\n"}], "timeout_s": 2}}
             for op, out in (("sum", 9), ("difference", 3), ("product", 18), ("quotient", 2))],
    "tool_call": [{"prompt": [{"role": "system", "content": "Tools: get_weather(city: str)."},
                              {"role": "user", "content": f"What is the weather in {city}?"}],
                   "domain": "tool_call", "answer": json.dumps({"name": "get_weather", "arguments": {"city": city}})}
                  for city in ("Paris", "Lima", "Oslo", "Kyiv")],
}

# Stage preset -> the prompts it is for: built-in tasks (make-data cascade) and WRITTEN domains. Each domain they
# hold is named in the preset's own comment (the preset says what it accepts), the built-in tasks by their domain.
STAGE_PROMPTS = {
    "if_rl": ["arithmetic_if"],
    "multi_domain": ["arithmetic", "arithmetic_mcqa", "arithmetic_json", "tool_call"],
    "mopd": ["arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if"],
    "rlhf": ["genrm"],
    "long_context": ["llm_judge"],
    "code_rl": ["code"],
    "swe_agentless": ["swe_patch"],
    "swe_agentic": ["swe_agent"],
}
BUILTIN_DOMAINS = {"arithmetic": "math", "arithmetic_mcqa": "mcqa", "arithmetic_json": "structured_output",
                   "arithmetic_if": "instruction_following", "swe_patch": "swe", "swe_agent": "swe_agent"}


@pytest.fixture(scope="module")
def layout(tmp_path_factory, tiny_model, tiny_data, tools_data, full_data) -> Path:
    """A directory as ``make run``, ``make full`` and ``make tools`` leave it: models/tiny-sft, full-sft, judge-sft
    and tools-sft (any tiny model: a dry run only renders prompts), runs/data/{cascade,demo,full,full-gold,tools} (make-data),
    WRITTEN files."""
    from cascade_rl.data.builtin import write_task_files

    root = tmp_path_factory.mktemp("presets")
    (root / "models").mkdir()
    for name in ("tiny-sft", "tools-sft", "full-sft", "judge-sft"):
        (root / "models" / name).symlink_to(tiny_model)
    (root / "runs" / "data").mkdir(parents=True)
    demo = write_task_files("demo", root / "demo-data", {"heldout": 8, "rl": 64, "sft": 8})
    for name, files, task in (("cascade", tiny_data, "arithmetic"), ("tools", tools_data, "tool_arithmetic"),
                              ("full", full_data, "arithmetic"), ("demo", demo, "arithmetic")):
        (root / "runs" / "data" / name).symlink_to(Path(files["rl"][task]).parent.parent)
    write_task_files("long_context_gold", root / "runs" / "data" / "full-gold", {"heldout": 8})  # make full writes it
    (root / "written").mkdir()
    for domain, rows in WRITTEN.items():
        (root / "written" / f"{domain}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def prompt_file(layout: Path, tiny_data, name: str, full_data=None) -> str:
    """A built-in task's RL file (make-data cascade, else make-data full), else the WRITTEN rows of a domain."""
    for data in (tiny_data, full_data or {"rl": {}}):
        if name in data["rl"]:
            return data["rl"][name]
    return str(layout / "written" / f"{name}.jsonl")


def dry_run(preset: str | None, overrides: list[str]):
    """What ``cascade-rl launch PRESET OVERRIDES --dry-run`` checks: the composed config and its data."""
    cfg = compose(preset, [*overrides, "supervisor.progress=none"], check=True)
    return prepare_run_data(cfg), cfg


def test_every_stage_preset_says_which_prompts_it_is_for():
    assert set(STAGE_PROMPTS) == set(STAGE_PRESETS), (
        "each stage preset (configs/stage/*.yaml) needs an entry in STAGE_PROMPTS: the prompts it launches with")
    for stage, names in STAGE_PROMPTS.items():
        text = " ".join((CONFIG_DIR / "stage" / f"{stage}.yaml").read_text().replace("#", " ").split())
        if "every domain" in text:
            continue
        named = {BUILTIN_DOMAINS.get(n, n) for n in names} - {"math"}  # math: the miniature's stand-in
        assert all(d in text for d in named), f"configs/stage/{stage}.yaml does not name {sorted(named)}"


@pytest.mark.parametrize("stage", STAGE_PRESETS)
def test_a_stage_preset_launches_with_prompts_of_its_domains(stage, layout, tiny_model, tiny_data, full_data, tmp_path,
                                                             monkeypatch):
    monkeypatch.chdir(layout)
    files = [prompt_file(layout, tiny_data, n, full_data) for n in STAGE_PROMPTS.get(stage, [])]
    assert files, f"configs/stage/{stage}.yaml: add the prompts it is for to STAGE_PROMPTS"
    domains = sorted({json.loads(Path(f).read_text().splitlines()[0])["domain"] for f in files})
    overrides = [f"stage={stage}", f"model.path={tiny_model}", f"data.files=[{','.join(files)}]",
                 f"run_dir={tmp_path / 'run'}"]
    if JUDGED_DOMAINS & set(domains):
        overrides.append("verifier.judge.model=judge")
    if compose(None, overrides, check=False).run.algorithm == "mopd":
        overrides += [f"+teacher.checkpoints.{d}={tiny_model}" for d in domains]
    report, cfg = dry_run(None, overrides)
    assert sorted(report.domains["train"]) == domains
    assert sorted(cfg.verifier.domains) == domains
    assert (tmp_path / "run" / "data" / "train.arrow").is_file()


@pytest.mark.parametrize("preset", RUN_PRESETS)
def test_a_run_preset_launches_as_written(preset, layout, tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(layout)
    overrides = [f"run_dir={tmp_path / 'run'}"]
    if not compose(preset, overrides, check=False).data.files:  # a preset of scale only: the built-in prompts
        overrides += [f"data.files=[{','.join(tiny_data['rl'].values())}]",
                      f"data.eval_files=[{','.join(tiny_data['heldout'].values())}]"]
    report, _ = dry_run(preset, overrides)
    assert report.to_json()["rows"]["train"] > 0


@pytest.mark.parametrize("name", CASCADES)
def test_every_stage_of_a_cascade_launches(name, layout, tmp_path, monkeypatch):
    monkeypatch.chdir(layout)
    cfg = load_config(name, [f"run_dir={tmp_path}"])
    cfg.overrides.append("supervisor.progress=none")  # after the cascade's own (its judge, ...)
    cascade = Cascade(cfg)
    evaluated = {json.loads(Path(f).read_text().splitlines()[0])["domain"] for f in cfg.eval.files}
    # as if the starting model had been evaluated: it is every domain's best checkpoint (``teachers: best``)
    cascade.record["initial"] = {"path": cascade.record["model"], "step": 0, "domains": dict.fromkeys(evaluated, 0.0)}
    for stage in cfg.stages:
        launch = cascade.stage_config(stage, cfg.model, tmp_path / stage.name)  # validates, as a stage's launch
        report = prepare_run_data(launch)
        assert report.to_json()["rows"]["train"] > 0 and report.to_json()["rows"]["eval"] > 0, stage.name


@pytest.mark.parametrize("domain", sorted(JUDGED_DOMAINS))
def test_judged_prompts_need_a_judge_model(domain, layout, tiny_model, tmp_path):
    overrides = [f"model.path={tiny_model}", f"data.files=[{layout / 'written' / f'{domain}.jsonl'}]",
                 f"run_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=rf"\['{domain}'\] are scored by a judge model: set verifier.judge.model"):
        dry_run("tiny", overrides)
    dry_run("tiny", [*overrides, "verifier.judge.model=judge"])

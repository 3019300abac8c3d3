"""Every stage preset (configs/stage/*.yaml) launches on the tiny model for 2 steps with its real verifier (the judge
server, the sandbox, the environment) and its books close: ``cascade-rl launch tiny stage=STAGE`` with the stage's
miniature prompts (``make-data full``: the ``full_data`` fixture), every role its own process over ZeroMQ.

The presets are globbed, so a new one is covered as soon as it exists; it must say in ``CASES`` which prompts it
launches with. Per launch: exit 0; the books close (summary.json ``books``, ledger.jsonl and trained_ids.jsonl,
read with test_launch ``read_ledger``); the stage's settings reached the run (run_dir/config.yaml, what every worker
reads: each key of the stage preset holds the preset's value unless the ``tiny`` run preset or the case sets it, and
the stage's headline settings are checked by name) and acted (the step's lr, MOPD's reverse KL, RLHF's KL to the
reference, dynamic filtering, loss masking, turns); the real verifier scored every rollout (the judge served requests,
the environment workers ran steps, no score failed for want of a verifier).

The policy is random, so rewards are mostly 0: these check the system, not learning. Two consequences:

- Stages scored by a service (a judge, the sandbox, the swe environment) sample with ``data.thinking=false``: a random
  model almost never closes its ``<think>``, and a response whose ``<think>`` never closed scores 0 without any judge
  call or program run (verifiers/text.py ``final_answer_text``); in non-thinking mode the whole response is the answer,
  so the judge is asked and the code runs.
- IF-RL filters uniform groups (dynamic filtering): a random model's IF rewards are all 0, so every group would be
  filtered and the stage stop, by design, after ``orchestrator.max_refill_rounds``. It launches from the tiny model
  SFT'd briefly on the IF rows' worked solutions (``if_model``), whose groups are mixed often enough.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_launch import CLI, read_ledger

from cascade_rl.supervisor.config import CONFIG_DIR
from cascade_rl.verifiers.sandbox import isolation_available

STAGES = sorted(p.stem for p in (CONFIG_DIR / "stage").glob("*.yaml"))
RUN_PRESET = "tiny"
STEPS, PROMPTS, GROUP = 2, 4, 4

# What keeps every launch fast: 2 steps of 4 prompts x 4 rollouts, 4 held-out questions per domain sampled once,
# 48-token responses (the tiny model's context is 512 tokens).
FAST = {"run.steps": STEPS, "run.prompts_per_step": PROMPTS, "run.group_size": GROUP,
        "orchestrator.eval_n": 1, "data.eval_per_domain": 4, "sampling.max_tokens": 48}

# The judge of RLHF (pairwise GenRM, the miniature's compact template) and long-context RL, served by the supervisor
# on the torch engine from a tiny model: a one-thread server, and verdicts of a few tokens (the default 4096 would
# not fit its 512-token context: every call would be refused).
JUDGE = {"data.thinking": False, "verifier.judge.serve": "torch", "verifier.judge.genrm.template": "compact",
         "verifier.judge.max_tokens": 8, "verifier.judge.args": "[--threads,1]"}


@dataclasses.dataclass(frozen=True)
class Case:
    tasks: tuple[str, ...]
    """The stage's prompts: tasks of ``make-data full`` (full_data["rl"]; held out: full_data["heldout"])."""
    overrides: dict = dataclasses.field(default_factory=dict)
    """More settings of the launch (beside FAST): what the case needs to run, never the stage's own settings."""
    expect: dict = dataclasses.field(default_factory=dict)
    """The stage's headline settings, as config.yaml must hold them."""
    model: str = "policy_model"
    """The fixture of the policy model."""
    judged: bool = False
    """Scored by the judge model the supervisor serves."""
    sandbox: bool = False
    """Its verifier (or environment) runs programs in the sandbox (needs root on Linux)."""
    teachers: bool = False
    """MOPD: one teacher per domain (+teacher.checkpoints.DOMAIN=the policy model)."""


CASES = {
    "if_rl": Case(("arithmetic_if",), model="if_model",
                  # the SFT'd model's groups are mixed (kept) about 1 in 7: room to find 4 of them per step
                  overrides={"orchestrator.max_refill_rounds": 100},
                  expect={"orchestrator.dynamic_filtering": True, "orchestrator.overlong_penalty": True}),
    "multi_domain": Case(("arithmetic", "arithmetic_mcqa", "arithmetic_json"),
                         expect={"orchestrator.overlong_penalty": True, "run.algorithm": "grpo"}),
    "mopd": Case(("arithmetic", "arithmetic_mcqa", "arithmetic_json", "arithmetic_if"), teachers=True,
                 expect={"run.algorithm": "mopd", "trainer.warmup_steps": 30, "trainer.warmup_start_lr": 2e-7,
                         "trainer.eps_low": 0.5, "trainer.eps_high": 2.0}),
    "rlhf": Case(("chat",), judged=True, overrides=JUDGE,
                 expect={"trainer.kl_coef": 0.03, "orchestrator.overlong_penalty": False}),
    "long_context": Case(("long_context",), judged=True, overrides=JUDGE,
                         expect={"data.max_prompt_tokens": 32768, "orchestrator.overlong_penalty": True}),
    "code_rl": Case(("code_fn",), sandbox=True, overrides={"data.thinking": False},
                    expect={"sampling.top_p": 0.95, "orchestrator.overlong_penalty": True}),
    "swe_agentless": Case(("swe_patch",), sandbox=True, overrides={"data.thinking": False},
                          expect={"orchestrator.mask_threshold": 0.5, "orchestrator.overlong_penalty": True}),
    # A trajectory reaches the environment only after a turn that ends (EOS) rather than being cut at max_tokens; a
    # random model ends a turn rarely, so turns get 160 tokens (prompts are ~150 tokens: 150 + 352 fits 512).
    "swe_agentic": Case(("swe_agent",), sandbox=True,
                        overrides={"data.thinking": False, "sampling.max_tokens": 160, "orchestrator.max_turns": 3,
                                   "orchestrator.max_total_tokens": 352},
                        expect={"sampling.temperature": 0.8, "trainer.lr_decay": "cosine", "trainer.warmup_steps": 10,
                                "trainer.warmup_start_lr": 0.0}),
}


# --------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def policy_model(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE (random, 512-token context) with its tokenizer trained on the text of every domain of
    ``make-data full``, as ``make full`` builds models/full: the long-context documents fit its context (with the
    arithmetic-only tokenizer of ``tiny_model`` the longest are 800+ tokens). Also the judge model."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("stage-models") / "full", arch="qwen3_moe", task="full"))


@pytest.fixture(scope="module")
def if_model(tmp_path_factory, policy_model, full_data) -> str:
    """``policy_model`` SFT'd on the IF rows' worked solutions (100 steps, ~30 s): IF-RL's dynamic filtering needs
    groups whose rewards differ, which a random model never gives."""
    from cascade_rl.learner.sft import SFTConfig, run_sft

    out = tmp_path_factory.mktemp("stage-models") / "if-sft"
    run_sft(SFTConfig(model=policy_model, out=str(out), files=[str(full_data["sft"]["arithmetic_if"])], steps=100,
                      batch_size=16))
    return str(out)


# --------------------------------------------------------------------------- helpers


def domain_of(path: str) -> str:
    return json.loads(Path(path).read_text().splitlines()[0])["domain"]


def flat(cfg) -> dict:
    """A YAML file's (or config's) leaves by dotted key."""
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                out[key] = v

    walk(OmegaConf.to_container(OmegaConf.load(cfg) if isinstance(cfg, Path) else cfg), "")
    return out


def same(actual, expected) -> bool:
    if isinstance(expected, float) and not isinstance(expected, bool):
        return actual == pytest.approx(expected)
    return actual == expected


def judge_served(run_dir: Path) -> dict:
    """The served judge's counters, from the last line it wrote when it stopped (samplers/chat_server.py)."""
    log = (run_dir / "logs" / "judge.log").read_text()
    assert "stopped: " in log, f"the judge never stopped cleanly; logs/judge.log ends:\n{log[-2000:]}"
    return json.loads(log.split("stopped: ")[-1].splitlines()[0])


# --------------------------------------------------------------------------- tests


def test_every_stage_preset_has_a_case():
    missing, stale = sorted(set(STAGES) - set(CASES)), sorted(set(CASES) - set(STAGES))
    assert not missing, f"configs/stage/{missing[0]}.yaml: add its prompts to CASES in {Path(__file__).name}"
    assert not stale, f"CASES names stage presets that no longer exist: {stale}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_stage_launches_with_its_real_verifier_and_its_books_close(stage, full_data, request, tmp_path):
    case = CASES.get(stage)
    assert case is not None, (f"configs/stage/{stage}.yaml has no entry in CASES ({Path(__file__).name}): add one "
                              f"with the prompts it launches with (tasks of make-data full)")
    if case.sandbox and not isolation_available():
        pytest.skip("the code sandbox needs root on Linux")
    model = request.getfixturevalue(case.model)
    files = [full_data["rl"][t] for t in case.tasks]
    heldout = [full_data["heldout"][t] for t in case.tasks]
    domains = sorted({domain_of(f) for f in files})
    settings = {**FAST, **case.overrides}
    if case.judged:
        settings["verifier.judge.path"] = model
    if case.teachers:
        settings.update({f"teacher.checkpoints.{d}": model for d in domains})
    run_dir = tmp_path / "run"
    cmd = [*CLI, "launch", RUN_PRESET, f"stage={stage}", f"model.path={model}", f"data.files=[{','.join(files)}]",
           f"data.eval_files=[{','.join(heldout)}]", f"run_dir={run_dir}", "supervisor.progress=none",
           *(f"{'+' if k.startswith('teacher.checkpoints.') else ''}{k}={str(v).lower() if isinstance(v, bool) else v}"
             for k, v in settings.items())]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420,
                       env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state")))
    wall = time.monotonic() - t0
    print(f"{stage}: launch {wall:.1f} s")
    assert r.returncode == 0, f"{stage}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    # ---- the books close
    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert summary["steps"] == STEPS and summary["policy_version"] == STEPS
    assert books["lost"] == 0 and books["in_flight"] == 0, books
    assert books["trainer_ids"]["match"], books["trainer_ids"]
    assert books["trained"] + books["filtered"] + books["stale"] == books["dispatched"], books
    assert books["trained"] == STEPS * PROMPTS * GROUP
    ledger = read_ledger(run_dir)  # one fate per rollout; the trainer's ids are the ledger's trained ones
    assert len(ledger) == books["dispatched"]
    assert not any(reason.startswith("verifier_unavailable") for reason in books["filtered_reasons"]), books
    assert sorted(summary["data"]["domains"]["train"]) == domains  # the stage's prompts, and only those

    # ---- the stage's settings reached the run: config.yaml is what every worker reads
    config = OmegaConf.load(run_dir / "config.yaml")
    for key, value in case.expect.items():
        assert same(OmegaConf.select(config, key), value), f"{stage}: {key} = {OmegaConf.select(config, key)}"
    run_preset = flat(CONFIG_DIR / "run" / f"{RUN_PRESET}.yaml")
    for key, value in flat(CONFIG_DIR / "stage" / f"{stage}.yaml").items():
        # the case's settings win, then the run preset's (it sets scale), then the stage preset's
        wanted = OmegaConf.create({"v": settings[key]}).v if key in settings else run_preset.get(key, value)
        assert same(OmegaConf.select(config, key), wanted), f"{stage}: {key} = {OmegaConf.select(config, key)}"

    # ... and acted: the trainer's lr, warm-up included
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "version" in m]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    t = config.trainer
    first_lr = t.warmup_start_lr if t.warmup_steps else t.lr
    assert steps[0]["trainer/lr"] == pytest.approx(first_lr), (stage, steps[0]["trainer/lr"])

    # ---- the real verifier scored every rollout
    workers = {w["id"]: w for w in summary["workers"]}
    verifiers = [w["counters"] for w in workers.values() if w["role"] == "verifier"]
    scored, failed = sum(c["scored"] for c in verifiers), sum(c["failed"] for c in verifiers)
    assert scored >= books["dispatched"], (scored, books)  # every training rollout, and the held-out ones
    if case.judged:
        assert workers["judge"]["role"] == "judge"
        served = judge_served(run_dir)
        assert served["requests"] > 0 and served["errors"] == 0, served
        # a score fails only with the random judge's unparseable verdict (one call each), never without a call
        assert failed <= served["requests"], (failed, served)
    else:
        assert failed == 0, verifiers  # no "no verifier", no sandbox that cannot start, no crash

    fates = {(r["fate"], r["reason"]) for r in ledger.values()}
    if stage == "if_rl":  # dynamic filtering: uniform groups filtered and replaced
        assert books["filtered_reasons"].get("uniform_rewards", 0) > 0, books
    if stage == "swe_agentless":  # mask_threshold 0.5: a random model's groups never score above it, no loss
        assert fates == {("trained", "masked")}, fates
    if stage == "rlhf":  # kl_coef 0.03: the KL to the pre-RLHF weights is a term of the loss
        assert all("trainer/kl_ref" in m for m in steps)
    if case.teachers:  # MOPD: the teacher served every group, the loss is the reverse KL to it
        teachers = [w["counters"] for w in workers.values() if w["role"] == "teacher"]
        assert teachers and sum(c["requests"] for c in teachers) > 0 and not sum(c["errors"] for c in teachers)
        assert all("trainer/mopd/reverse_kl" in m for m in steps)
    if stage == "swe_agentic":  # the environment workers acted on the trajectories' turns
        envs = [w["counters"] for w in workers.values() if w["role"] == "environment"]
        assert envs and sum(c["steps"] for c in envs) > 0 and not sum(c["failed"] for c in envs), envs
        assert summary["multi_turn"]["turns_mean"] >= 1.0, summary["multi_turn"]

"""Stage presets (configs/stage/*.yaml) carry the paper's numbers (docs/ARCHITECTURE.md §4) over the schema's defaults."""

from __future__ import annotations

import pytest

from cascade_rl.supervisor.config import compose

PAPER_DEFAULTS = {"run.prompts_per_step": 128, "run.group_size": 16, "trainer.lr": 3e-6,
                  "sampling.temperature": 1.0, "sampling.top_p": 1.0, "trainer.kl_coef": 0.0,
                  "trainer.entropy_coef": 0.0, "orchestrator.max_staleness": 0}

STAGES = {
    "if_rl": {"run.steps": 180, "sampling.max_tokens": 49152, "orchestrator.dynamic_filtering": True},
    "multi_domain": {"run.steps": 70, "sampling.max_tokens": 49152},
    "mopd": {"run.algorithm": "mopd", "run.group_size": 4, "trainer.lr": 2e-6, "trainer.warmup_steps": 30,
             "trainer.warmup_start_lr": 2e-7, "trainer.eps_low": 0.5, "trainer.eps_high": 2.0},
    "rlhf": {"trainer.kl_coef": 0.03, "sampling.max_tokens": 16384, "orchestrator.overlong_penalty": False,
             "run.steps": 30},
    "long_context": {"run.steps": 30, "data.max_prompt_tokens": 32768},
    "code_rl": {"sampling.top_p": 0.95, "sampling.max_tokens": 118000, "run.steps": 22},
    "swe_agentless": {"sampling.max_tokens": 98304, "orchestrator.mask_threshold": 0.5, "run.steps": 45},
    "swe_agentic": {"run.prompts_per_step": 16, "run.group_size": 64, "sampling.temperature": 0.8,
                    "orchestrator.max_turns": 200, "orchestrator.max_total_tokens": 262144,
                    "trainer.warmup_steps": 10, "trainer.lr_decay": "cosine"},
}


def get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_preset_has_the_papers_numbers(stage, tiny_model):
    cfg = compose(None, [f"stage={stage}", f"model.path={tiny_model}"], check=False)
    expected = {**PAPER_DEFAULTS, **STAGES[stage]}
    for key, value in expected.items():
        assert get(cfg, key) == pytest.approx(value) if isinstance(value, float) else get(cfg, key) == value, key


def test_a_run_preset_overrides_the_stage_where_it_sets_scale(tiny_model):
    cfg = compose("tiny", ["stage=rlhf", f"model.path={tiny_model}"], check=False)
    assert cfg.trainer.kl_coef == 0.03  # from the stage
    assert cfg.run.prompts_per_step == 8 and cfg.sampling.max_tokens == 24  # from the run preset


def test_validation_names_missing_verifiers_and_teachers(tiny_model, math_data, prepared, tmp_path):
    from cascade_rl.supervisor.config_errors import ConfigError

    with pytest.raises(ConfigError, match=r"no verifier for \['weather'\]"):
        compose("tiny", ["stage=mopd", f"model.path={tiny_model}", *math_data, "verifier.domains=[math,weather]"])
    with pytest.raises(ConfigError, match="teacher.checkpoints are used by run.algorithm=mopd only"):
        compose("tiny", [f"model.path={tiny_model}", *math_data, f"+teacher.checkpoints.math={tiny_model}"])
    # the rules that need the data's domains: checked when the data is prepared, before any process starts
    mopd = compose("tiny", ["stage=mopd", f"model.path={tiny_model}", *math_data, f"run_dir={tmp_path / 'a'}"])
    with pytest.raises(ConfigError, match=r"no teacher for \['math'\]"):
        prepared(mopd)
    narrow = compose("tiny", [f"model.path={tiny_model}", *math_data, "verifier.domains=[mcqa]",
                              f"run_dir={tmp_path / 'b'}"])
    with pytest.raises(ConfigError, match=r"does not serve \['math'\]"):
        prepared(narrow)
    served = prepared(compose("tiny", ["stage=rlhf", f"model.path={tiny_model}", *math_data,
                                       f"run_dir={tmp_path / 'c'}"]))
    assert list(served.verifier.domains) == ["math"]  # empty: every domain of the data

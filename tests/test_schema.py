"""The launch schema says what it accepts: every field documented where it is declared, fixed choices typed,
implementation names checked against their registries, keys of earlier versions refused with their new name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cascade_rl.supervisor import schema
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.config_errors import ConfigError

SCHEMA = Path(schema.__file__)


def test_every_field_of_every_section_has_a_docstring_under_it():
    tree = ast.parse(SCHEMA.read_text())
    undocumented = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for i, node in enumerate(cls.body):
            if isinstance(node, ast.AnnAssign):
                after = cls.body[i + 1] if i + 1 < len(cls.body) else None
                if not (isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant)
                        and isinstance(after.value.value, str)):
                    undocumented.append(f"{cls.name}.{node.target.id}")
    assert not undocumented


def test_one_section_per_process_role():
    sections = {f.name for f in dataclasses.fields(schema.LaunchConfig)}
    assert {"orchestrator", "trainer", "sampler", "verifier", "teacher", "supervisor", "endpoints"} <= sections
    assert "workers" not in sections


@pytest.mark.parametrize("override, message", [
    ("model.dtype=fp8", r"model.dtype: Invalid value 'fp8', expected one of \[bf16, bfloat16, fp32, float32\]"),
    ("model.attn_impl=flash", "model.attn_impl: Invalid value 'flash'"),
    ("model.moe_impl=cuda", r"model.moe_impl: Invalid value 'cuda', expected one of \[hf, grouped, torch, triton\]"),
    ("supervisor.progress=loud", "supervisor.progress: Invalid value 'loud'"),
    ("data.on_bad_row=ignore", r"data.on_bad_row: Invalid value 'ignore', expected one of \[error, skip\]"),
])
def test_typed_choices_are_refused_with_the_allowed_ones(override, message):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override], check=False)


@pytest.mark.parametrize("key, value, allowed", [
    ("trainer.algorithm", "ppo", "grpo, mopd"),
    ("trainer.logprob_impl", "cuda", "torch, triton"),
    ("weights_transport", "nfs", "cuda_ipc, shm, stream"),
    ("sampler.engine", "trt", "sglang, torch, vllm"),
])
def test_implementation_names_are_checked_against_their_registries(key, value, allowed, tiny_model):
    with pytest.raises(ConfigError, match=f"{key}='{value}': choose one of {allowed}"):
        compose("tiny", [f"{key}={value}", f"model.path={tiny_model}", "data.files=[x.jsonl]"])


@pytest.mark.parametrize("override, message", [
    ("workers.sampler_engine=vllm", "workers.sampler_engine: renamed to sampler.engine"),
    ("workers.samplers=2", "workers.samplers: renamed to sampler.count"),
    ("+teachers.math=/ckpt", "teachers.math: renamed to teacher.checkpoints.math"),
    ("workers.judge.model=j", "workers.judge.model: renamed to verifier.judge.model"),
])
def test_keys_of_an_earlier_version_name_their_new_place(override, message):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override], check=False)

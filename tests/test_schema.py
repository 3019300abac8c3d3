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

SCHEMAS = sorted(Path(schema.__file__).parent.glob("schema*.py"))  # the schema and its sections' modules


def test_every_field_of_every_section_has_a_docstring_under_it():
    undocumented = []
    for cls in (n for path in SCHEMAS for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
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
    ("sampler.inflight_kv=drop", r"sampler.inflight_kv: Invalid value 'drop', expected one of \[recompute, keep\]"),
])
def test_typed_choices_are_refused_with_the_allowed_ones(override, message):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override], check=False)


@pytest.mark.parametrize("key, value, allowed", [
    ("run.algorithm", "ppo", "grpo, mopd"),
    ("trainer.logprob_impl", "cuda", "torch, triton"),
    ("weights_transport", "nfs", "cuda_ipc, delta, nccl, shm, stream"),
    ("sampler.engine", "trt", "sglang, torch, vllm"),
])
def test_implementation_names_are_checked_against_their_registries(key, value, allowed, tiny_model):
    with pytest.raises(ConfigError, match=f"{key}='{value}': choose one of {allowed}"):
        compose("tiny", [f"{key}={value}", f"model.path={tiny_model}", "data.files=[x.jsonl]"])


@pytest.mark.parametrize("override, message", [
    ("workers.sampler_engine=vllm", "workers.sampler_engine moved to sampler.engine"),
    ("workers.samplers=2", "workers.samplers moved to sampler.count"),
    ("+teachers.math=/ckpt", "teachers.math moved to teacher.checkpoints.math"),
    ("workers.judge.model=j", "workers.judge.model moved to verifier.judge.model"),
    ("trainer.steps=20", "trainer.steps moved to run.steps"),
    ("+trainer.seed=3", "trainer.seed moved to run.seed"),
    ("trainer.resume_from=latest", "trainer.resume_from moved to run.resume_from"),
    ("+weights_options.chunk_mb=8", "weights_options.chunk_mb moved to weights_options.stream.chunk_mb"),
])
def test_keys_of_an_earlier_version_name_their_new_place(override, message):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override], check=False)


def test_a_moved_key_in_a_yaml_file_names_its_new_place(tmp_path):
    preset = tmp_path / "old.yaml"
    preset.write_text("trainer:\n  group_size: 8\n")
    with pytest.raises(ConfigError, match=r"trainer.group_size: no such setting \(moved to run.group_size\)"):
        compose(str(preset), [], check=False)


def test_routing_replay_turns_on_the_samplers_routes():
    assert not compose("tiny", [], check=False).sampler.return_routes
    assert compose("tiny", ["trainer.routing_replay=true"], check=False).sampler.return_routes


@pytest.mark.parametrize("override, message", [
    ("weights_options.shm.keep=0", "weights_options.shm.keep must be >= 1, got 0"),
    ("weights_options.stream.chunk_mb=0", "weights_options.stream.chunk_mb must be >= 1, got 0"),
    ("weights_options.stream.chunk_mb=big", "weights_options.stream.chunk_mb: Value 'big'"),
    ("weights_options.delta.keep=1", "weights_options.delta.keep must be >= 2"),
    ("weights_options.delta.zlib_level=10", "weights_options.delta.zlib_level must be in 0..9, got 10"),
    ("weights_options.nccl.backend=mpi", "weights_options.nccl.backend must be auto, nccl or gloo, got 'mpi'"),
])
def test_transport_options_are_typed_and_checked_where_declared(override, message, tiny_model):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override, f"model.path={tiny_model}", "data.files=[x.jsonl]"])

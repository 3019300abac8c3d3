"""Shared fixtures: a real tiny model built offline once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# No GPU: Triton kernels (kernels/) run in Triton's interpreter. Triton reads this when a kernel is decorated,
# i.e. when its module is imported, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A randomly initialised Qwen3-MoE tiny model directory (tokenizer trained here)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", arch="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory) -> str:
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-dense", arch="qwen3"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The built-in miniature tasks as data files (``cascade-rl make-data cascade``): {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return write_task_files("cascade", tmp_path_factory.mktemp("data"), {"heldout": 16, "rl": 300, "sft": 32})


@pytest.fixture(scope="session")
def full_data(tmp_path_factory):
    """Every policy task of the paper's cascade in miniature (``cascade-rl make-data full``: the arithmetic
    domains, chat, long_context, code_fn, swe_patch, swe_agent) as data files: {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return write_task_files("full", tmp_path_factory.mktemp("full-data"), {"heldout": 8, "rl": 64, "sft": 16})


@pytest.fixture(scope="session")
def math_data(tiny_data) -> list[str]:
    """Launch overrides for the arithmetic (math) prompts and their 16 held-out questions."""
    return [f"data.files=[{tiny_data['rl']['arithmetic']}]", f"data.eval_files=[{tiny_data['heldout']['arithmetic']}]"]


@pytest.fixture(scope="session")
def prepared():
    """prepared(cfg): a composed launch config with its data prepared in run_dir/data, as the supervisor does
    before any process starts (an Orchestrator built in a test reads it there)."""
    from cascade_rl.supervisor.run_data import prepare_run_data

    def prepare(cfg):
        prepare_run_data(cfg)
        return cfg

    return prepare


@pytest.fixture(scope="session")
def tools_data(tmp_path_factory):
    """The tool miniature as data files (``cascade-rl make-data tools``): {split: {task: path}}."""
    from cascade_rl.data.builtin import write_task_files

    return write_task_files("tools", tmp_path_factory.mktemp("tools-data"), {"heldout": 16, "rl": 300, "sft": 400})


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory, tools_data) -> str:
    """A tiny model SFT'd briefly on the tool traces (it calls the python tool, mostly in the right form):
    what multi-turn tests sample from. About a minute on 2 cores."""
    from cascade_rl.learner.sft import SFTConfig, run_sft
    from cascade_rl.learner.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tools-models")
    base = make_tiny_model(root / "tools", task="tools")
    files = [str(tools_data["sft"]["tool_arithmetic"]), str(tools_data["sft"]["tool_arithmetic_direct"])]
    run_sft(SFTConfig(model=str(base), out=str(root / "tools-sft"), files=files, steps=120))
    return str(root / "tools-sft")

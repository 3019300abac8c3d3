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

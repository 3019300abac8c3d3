"""Context parallelism (modeling/context_parallel.py): 2 CPU ranks (gloo, FSDP2) that split each packed sequence
between them take the 1-rank steps on the same batch: Ulysses attention for the Qwen3-MoE model, the Mamba-2 states
passed from rank to rank for Nemotron-H. The helper's batch is one pack of ~200 tokens, so the split falls inside a
row and the second rank's first row continues the first rank's (conv halo, carried state)."""

from __future__ import annotations

import pytest
import torch
from test_nemotron_h_engine import nh_model  # noqa: F401 (a fixture)
from test_parallel import TOL, run

from cascade_rl.modeling.context_parallel import ContextParallel
from cascade_rl.modeling.policy import Policy
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.config_errors import ConfigError


@pytest.mark.parametrize("model_fixture, checkpointing", [("tiny_model", False), ("nh_model", True)])
def test_context_parallel_step_equals_one_rank(model_fixture, checkpointing, request, tmp_path):
    """Nemotron-H's two ranks also recompute each layer in the backward: its collectives run again, in order."""
    model = request.getfixturevalue(model_fixture)
    one, m1 = run(1, model, tmp_path / "one.safetensors")
    two, m2 = run(2, model, tmp_path / "two.safetensors", checkpointing=checkpointing, context_parallel=2)
    assert one.keys() == two.keys()
    for k in one:  # two AdamW steps: equal weights mean equal gradients (Adam's step is ~lr wherever a grad differs)
        torch.testing.assert_close(two[k], one[k], atol=TOL, rtol=0, msg=k)
    for a, b in zip(m1["metrics"], m2["metrics"]):  # the loss, the log-probs' statistics and the counts of the batch
        for k in ("loss", "grad_norm", "response_tokens", "zero_adv_groups", "entropy", "mismatch/abs_diff_max"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("overrides, message", [
    (["trainer.world_size=2", "trainer.context_parallel=4"], "trainer.context_parallel=4 must divide"),
    (["trainer.world_size=4", "trainer.context_parallel=2", "run.prompts_per_step=3"], "world_size / trainer.context"),
    (["trainer.world_size=2", "trainer.context_parallel=2", "trainer.pack=false"], "set trainer.pack=true"),
])
def test_launch_refuses_a_context_parallel_layout_that_cannot_run(overrides, message, tiny_model):
    with pytest.raises(ConfigError, match=message):
        compose("tiny", [f"model.path={tiny_model}", *overrides])


def test_a_head_count_the_group_does_not_divide_is_refused_before_any_forward(tiny_model):
    """The tiny model has 4 query heads: Ulysses over 3 ranks cannot split them."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="context_parallel=3 must divide the 4 attention heads"):
        Policy(AutoModelForCausalLM.from_pretrained(tiny_model), context_parallel=ContextParallel(None, 0, 3))

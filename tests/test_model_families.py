"""The MoE families users bring, built by ``make-tiny-model --arch`` (learner/tiny_model.py) with transformers' own
classes: DeepSeek-V3 (latent attention, sigmoid group routing, a shared expert) and gpt-oss (sliding windows,
sinks, biased clamped-SwiGLU experts: transformers' own experts, kernels/moe_families.py says why). The trainer's
Policy, with the grouped experts where the family has a description, gives transformers' log-probs of
each row and a gradient through the router. (Nemotron-H, every role: tests/test_nemotron_h_*.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import built_once
from test_policy import naive
from transformers import AutoModelForCausalLM

from cascade_rl.modeling.experts import use_moe_impl
from cascade_rl.modeling.policy import Policy

# qwen3_5_moe is built by make-tiny-model too, but not trained here: its gated delta net on transformers' torch path
# costs ~20 s for two 40-token rows on this CPU; tests/test_nemotron_h_trainer.py trains Qwen3-Next's (the same
# layer) padded against transformers.
ARCHS = ("deepseek_v3", "gpt_oss")


@pytest.fixture(scope="module", params=ARCHS)
def family_model(request, tmp_path_factory) -> tuple[str, str]:
    from cascade_rl.learner.tiny_model import make_tiny_model

    arch = request.param
    return arch, built_once(tmp_path_factory, f"tiny-{arch}", lambda d: str(make_tiny_model(d / arch, arch=arch)))


def test_each_family_trains_with_transformers_logprobs_and_a_router_gradient(family_model):
    arch, path = family_model
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 23])
    ids = torch.randint(3, 300, (2, 40), generator=g)
    target = torch.arange(40)[None] < lengths[:, None]
    target[:, :10] = False  # the prompt
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want, _ = naive(reference, ids, lengths, target, 1.0)
    model = use_moe_impl(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "grouped")
    logprobs, _ = Policy(model, temperature=1.0)(ids, lengths, target)
    torch.testing.assert_close(logprobs * target, want, atol=1e-5, rtol=0)
    (logprobs * target).sum().backward()
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))]
    assert routers and all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers), arch

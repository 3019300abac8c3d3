"""kernels/moe_families.py: each MoE family's description (our router, our experts, the shared expert and latent
projections around them) against transformers' own MoE block of that family, values and gradients, for every
experts impl (Triton in its interpreter on CPU: tiny shapes); the sigmoid router against HF's, bit for bit; and R3
(modeling/routing.py) on the tiny Nemotron-H: replayed routes give the forward with those routes forced.

Adding a family: its entry in ``FAMILIES`` and its case in ``CASES`` below.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. at import

from cascade_rl.kernels import moe  # noqa: E402
from cascade_rl.kernels.moe_families import FAMILIES, block_weights, moe_block, moe_family  # noqa: E402

H, I, E, K, S, N = 24, 12, 8, 2, 10, 13  # noqa: E741  hidden, expert width, experts, top-k, shared width, tokens
TOL = dict(rtol=1e-4, atol=1e-5)


def _qwen3_moe():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=True), Qwen3MoeSparseMoeBlock


def _qwen3_next():
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    return Qwen3NextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                           norm_topk_prob=False, shared_expert_intermediate_size=S), Qwen3NextSparseMoeBlock


def _qwen3_5_moe():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeConfig(text_config=dict(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                            num_experts_per_tok=K, shared_expert_intermediate_size=S))
    return cfg, lambda c: Qwen3_5MoeSparseMoeBlock(c.get_text_config())  # the composite config: its text model's


def _deepseek_v3():
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    return DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                            n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True), DeepseekV3MoE


def _nemotron_h(**extra):
    def build():
        from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

        cfg = NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                              moe_shared_expert_intermediate_size=S, n_group=2, topk_group=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True, layers_block_type=["moe"], **extra)
        return cfg, NemotronHMoE

    return build


# family case -> () -> (HF config, its MoE block class); one per FAMILIES entry at least
CASES = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe": _qwen3_5_moe,
    "deepseek_v3": _deepseek_v3,
    "nemotron_h": _nemotron_h(),
    "nemotron_h_latent": _nemotron_h(moe_latent_size=16),
}
IMPLS = ["grouped", "dense", "torch", "triton"]


def build_block(case: str, seed: int = 0):
    """(family, HF block with random weights and a random nonzero correction bias, eager HF experts, x, dy)."""
    cfg, block_cls = CASES[case]()
    cfg.get_text_config()._experts_implementation = "eager"  # HF's per-expert loop: the reference
    family = moe_family(cfg)
    torch.manual_seed(seed)
    block = block_cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if family.correction_bias:
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    x = torch.randn(N, H, generator=g).requires_grad_()
    return family, block, x, torch.randn(N, H, generator=g)


def grads(y, x, block, dy):
    params = [x, *(p for p in block.parameters())]
    return y.detach(), torch.autograd.grad(y, params, dy)


def test_every_family_has_a_case():
    assert {case.removesuffix("_latent") for case in CASES} >= {t.removesuffix("_text") for t in FAMILIES}


def test_families_read_from_configs():
    family = moe_family(_nemotron_h()()[0])
    assert family.routing == moe.Routing(K, True, "sigmoid_group_topk", 2, 1, 2.5)
    assert (family.activation, family.gated, family.correction_bias, family.latent) == ("relu2", False, True, False)
    assert moe_family(_nemotron_h(moe_latent_size=16)()[0]).latent
    assert moe_family(_qwen3_5_moe()[0]).shared_gate  # the composite config: its text model's family
    assert moe_family(_qwen3_next()[0]).routing == moe.Routing(K, False)
    from transformers import GptOssConfig, NemotronHConfig, Qwen3Config

    assert moe_family(Qwen3Config()) is None  # dense
    assert moe_family(GptOssConfig()) is None  # experts these kernels do not serve (see the module docstring)
    assert moe_family(NemotronHConfig(layers_block_type=["linear_attention", "full_attention"])) is None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_family_block_matches_transformers_block(case, impl):
    """Our router + our experts + the family's shared expert / latent projections against HF's own block: the
    output and the gradients of the input and of every parameter (router, experts, shared expert, latent)."""
    family, block, x, dy = build_block(case)
    want = grads(block(x[None]).squeeze(0), x, block, dy)
    got = grads(moe_block(x, family, block_weights(block, family), impl), x, block, dy)
    names = ["y", "dx", *(n for n, _ in block.named_parameters())]
    for name, a, b in zip(names, (got[0], *got[1]), (want[0], *want[1]), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{case} {impl} {name}: {m}", **TOL)
        if name != "y":
            assert b.abs().sum() > 0, name  # every gradient compared is a real one


@pytest.mark.parametrize("case", ["nemotron_h", "deepseek_v3"])
def test_sigmoid_router_is_hfs_bit_for_bit_and_the_bias_and_group_limit_choose(case):
    """``route`` with the family's routing is HF's router exactly (logits, weights, ids); the correction bias and
    the group limit each change some token's experts (so the block test above can fail on either); ``weigh`` gives
    the chosen experts' weights without the bias (what R3 replays)."""
    family, block, x, _ = build_block(case)
    bias = block.gate.e_score_correction_bias
    logits, weights, ids = moe.route(x, block.gate.weight, family.routing, bias)
    want = block.gate(x)
    for a, b in zip((logits, weights, ids), want, strict=True):
        assert torch.equal(a, b)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(moe.weigh_experts(logits, ids, family.routing), weights)

    def chosen(routing, b):
        return moe.select_experts(logits, routing, b)[1].sort(-1).values

    unlimited = replace(family.routing, n_group=1, topk_group=1)
    assert (chosen(family.routing, bias) != chosen(unlimited, bias)).any(-1).sum() > 0  # the group limit
    assert (chosen(family.routing, bias) != chosen(family.routing, None)).any(-1).sum() > 0  # the bias


def test_softmax_router_refuses_a_correction_bias():
    with pytest.raises(ValueError, match="bias"):
        moe.select_experts(torch.zeros(2, E), moe.Routing(K), torch.zeros(E))


# --- R3 on the tiny Nemotron-H --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_nemotron_h(tmp_path_factory) -> str:
    from conftest import built_once

    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-nemotron-h",
                      lambda d: str(make_tiny_model(d / "tiny-nemotron-h", arch="nemotron_h")))


def own_routes(model, ids, lengths) -> torch.Tensor:
    """[N, L, MoE layers, k] int16: the experts the model's own routers pick for each token (-1 past a row)."""
    from cascade_rl.modeling.policy import Policy
    from cascade_rl.modeling.routing import moe_routers

    picked, hooks = [], [r.register_forward_hook(lambda m, a, out: picked.append(out[2])) for r in moe_routers(model)]
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids, attention_mask=Policy._padding_mask(lengths, ids.shape[1]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    routes = torch.stack(picked, 1).view(*ids.shape, len(picked), -1)
    past = torch.arange(ids.shape[1])[None] >= lengths[:, None]
    return routes.masked_fill(past[..., None, None], -1).to(torch.int16)


def test_r3_replays_nemotron_h_routes_with_unbiased_weights(tiny_nemotron_h):
    """Routes taken from a forward whose correction biases were perturbed (so they differ from the model's own)
    are replayed by the unperturbed model (grouped experts) through ``Policy(routing_replay=True)``: its log-probs
    equal the perturbed model's own forward (HF's router and experts), because the bias picks experts but never
    weighs them; the routers still get a gradient, and ``disagree`` counts the routes that differ."""
    from transformers import AutoModelForCausalLM

    from cascade_rl.modeling.experts import use_moe_impl
    from cascade_rl.modeling.policy import Policy
    from cascade_rl.modeling.routing import moe_routers

    perturbed = AutoModelForCausalLM.from_pretrained(tiny_nemotron_h)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, perturbed.config.vocab_size, (2, 12), generator=g)
    lengths = torch.tensor([12, 9])
    pos = torch.arange(12)[None]
    mask = (pos >= 4) & (pos < lengths[:, None])
    with torch.no_grad():
        for r in moe_routers(perturbed):
            r.e_score_correction_bias.add_(torch.randn(r.e_score_correction_bias.shape, generator=g) * 0.3)
    routes = own_routes(perturbed, ids, lengths)
    with torch.no_grad():
        forced, _ = Policy(perturbed, pack=False)(ids, lengths, mask)

    model = use_moe_impl(AutoModelForCausalLM.from_pretrained(tiny_nemotron_h), "grouped")
    differ = (routes.sort(-1).values != own_routes(model, ids, lengths).sort(-1).values).any(-1)
    assert differ.sum() > 0
    policy = Policy(model, pack=False, routing_replay=True)
    lp, _ = policy(ids, lengths, mask, routes=routes)
    torch.testing.assert_close(lp[mask], forced[mask], atol=1e-5, rtol=1e-5)
    lp[mask].sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    stats = policy.replay.take_stats()  # (a later layer's own choice is made on the replayed hidden states)
    assert int(stats["routes"]) == int((routes[..., 0] >= 0).sum()) >= int(stats["disagree"]) > 0
    with torch.no_grad():
        own, _ = Policy(model, pack=False)(ids, lengths, mask)
    assert (own[mask] - forced[mask]).abs().max() > 1e-3  # the routes mattered: the test can fail

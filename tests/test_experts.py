"""model.moe_impl: the trainer's Qwen3-MoE with hf, grouped, torch and triton experts (Triton in its interpreter on
CPU) gives the same logits, gradients and training losses. Models and batches live on ``DEVICE``: the GPU when there
is one (``impl="triton"`` needs CUDA tensors there), else the CPU; attention is sdpa on both, so that only the
experts differ between the runs compared."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_batch
from transformers import AutoModelForCausalLM

from cascade_rl.learner import parallel
from cascade_rl.learner.trainer import build, train_step
from cascade_rl.modeling.experts import use_moe_impl
from cascade_rl.supervisor.config import compose

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load(path: str, impl: str):
    return use_moe_impl(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"), impl).to(DEVICE)


def trainer_cfg(path, run_dir, impl: str):
    return compose("tiny", [f"model.path={path}", f"run_dir={run_dir}", f"model.moe_impl={impl}", "trainer.lr=1e-3",
                            "model.attn_impl=sdpa"], check=False)


@pytest.fixture(scope="module")
def micro_moe(tiny_model, tmp_path_factory) -> str:
    """The tiny MoE's tokenizer with a smaller Qwen3-MoE (2 layers, d=32, 4 experts): Triton's interpreter
    pays per tile, and this keeps the triton cases to seconds."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path_factory.mktemp("micro_moe")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("impl", ["grouped", "torch", "triton"])
def test_swapped_experts_match_hf_forward_and_gradients(micro_moe, impl, monkeypatch):
    from cascade_rl.kernels import moe

    calls = []
    inner = moe.EXPERTS[impl]
    monkeypatch.setitem(moe.EXPERTS, impl, lambda *a: calls.append(1) or inner(*a))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grads = {}
    for name in ("hf", impl):
        model = load(micro_moe, name)
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        grads[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert len(calls) == 2  # kernels/moe.py ran the experts of both layers (and HF's code did not)
    torch.testing.assert_close(grads[impl][0], grads["hf"][0], atol=1e-5, rtol=1e-5)
    assert grads[impl][1].keys() == grads["hf"][1].keys()
    for n, g in grads["hf"][1].items():  # experts, router, attention and embeddings
        torch.testing.assert_close(grads[impl][1][n], g, atol=1e-6, rtol=1e-4, msg=n)
    assert any("experts.gate_up_proj" in n for n in grads["hf"][1]) and any("mlp.gate.weight" in n for n in grads["hf"][1])


@pytest.mark.parametrize("impl", ["grouped", "torch", "triton"])
def test_routing_replay_takes_the_given_experts_with_every_impl(micro_moe, impl):
    """R3 lives in the router, so hf, torch and triton experts replay the same routes: the same log-probs and the
    same router gradients, and not those of the model's own routes."""
    from cascade_rl.modeling.policy import Policy
    from cascade_rl.modeling.routing import moe_routers

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (2, 9), generator=g)
    lengths = torch.tensor([9, 7])
    pos = torch.arange(9)[None]
    mask = (pos >= 4) & (pos < lengths[:, None])
    routes = torch.rand(2, 9, 2, 4, generator=g).argsort(-1)[..., :2].to(torch.int16)  # 2 of 4 experts, 2 layers
    ids, lengths, mask, routes = (t.to(DEVICE) for t in (ids, lengths, mask, routes))
    out = {}
    for name in ("hf", impl):
        model = load(micro_moe, name)
        lp, _ = Policy(model, routing_replay=True)(ids, lengths, mask, routes=routes)
        lp[mask].sum().backward()
        out[name] = (lp.detach(), [r.weight.grad.clone() for r in moe_routers(model)])
        with torch.no_grad():
            own, _ = Policy(model)(ids, lengths, mask)
        assert (own[mask] - lp[mask]).abs().max() > 1e-3
    torch.testing.assert_close(out[impl][0], out["hf"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out[impl][1], out["hf"][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_trainer_trains_the_moe_to_the_same_losses_with_each_impl(micro_moe, tmp_path, monkeypatch):
    from cascade_rl.kernels import moe

    losses, calls = {}, []
    triton_experts = moe.EXPERTS["triton"]
    monkeypatch.setitem(moe.EXPERTS, "triton", lambda *a: calls.append(1) or triton_experts(*a))
    for impl in ("hf", "grouped", "torch", "triton"):
        cfg = trainer_cfg(micro_moe, tmp_path / impl, impl)
        policy, _, opt, _, _ = build(cfg, parallel.Ranks(), DEVICE)
        assert next(policy.parameters()).device.type == DEVICE
        losses[impl] = [train_step(policy, opt, make_batch(groups=1, resp=4, seed=s).to(DEVICE), cfg.trainer, s,
                                   run=cfg.run)["loss"]
                        for s in range(3)]
    assert len(calls) == 3 * 2  # 3 steps x 2 MoE layers through the Triton kernels
    assert losses["hf"][0] != losses["hf"][2]  # the weights moved between steps
    for impl in ("grouped", "torch", "triton"):
        assert losses[impl] == pytest.approx(losses["hf"], rel=1e-4, abs=1e-6), impl


@pytest.mark.slow
def test_the_tiny_demo_moe_trains_the_same_with_triton_experts(tiny_model, tmp_path, monkeypatch):
    """The demo's own layer shapes (d=128, 8 experts; its first layer of 4, its weights): one step, torch vs
    triton experts, the same loss and gradient norm. One layer, one step: Triton's interpreter pays per tile
    (the four layers took a minute on 2 cores; several steps are covered on a smaller model above)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.num_hidden_layers = 1
    sliced = tmp_path / "one-layer"
    AutoModelForCausalLM.from_pretrained(tiny_model, config=cfg).save_pretrained(sliced)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(sliced)
    results = {}
    for impl in ("torch", "triton"):
        cfg = trainer_cfg(sliced, tmp_path / impl, impl)
        policy, _, opt, _, _ = build(cfg, parallel.Ranks(), DEVICE)
        batch = make_batch(groups=1, g=2, prompt=3, resp=3, seed=0).to(DEVICE)
        metrics = train_step(policy, opt, batch, cfg.trainer, 0, run=cfg.run)
        results[impl] = [metrics["loss"], metrics["grad_norm"]]
    assert results["torch"][1] > 0  # rewards [1, 0]: a real gradient to compare
    assert results["triton"] == pytest.approx(results["torch"], rel=1e-4, abs=1e-6)


# --- Nemotron-H: squared-ReLU experts without a gate (HF ``up_proj``), the sigmoid router, a shared expert ----------


def micro_nemotron_h(seed: int = 0):
    """A 4-layer Nemotron-H (Mamba-2, MoE, attention, MoE; d=32, 4 experts top-2 in 2 groups, a random correction
    bias): small enough for Triton's interpreter."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    layers = ["linear_attention", "moe", "full_attention", "moe"]
    cfg = NemotronHConfig(vocab_size=300, hidden_size=32, layers_block_type=layers,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_num_heads=2,
                          mamba_head_dim=16, n_groups=1, ssm_state_size=8, chunk_size=8, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                          n_group=2, topk_group=1, routed_scaling_factor=2.5, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.3, 0.3)
    return model


@pytest.mark.parametrize("impl", ["grouped", "torch", "triton"])
def test_nemotron_h_swapped_experts_match_hf(impl, monkeypatch):
    """``use_moe_impl`` on Nemotron-H (``n_routed_experts``, no ``num_experts``): our experts run with the family's
    squared ReLU on HF's ``up_proj``, and the model's logits and every gradient are HF's."""
    from cascade_rl.kernels import moe

    calls = []
    inner = moe.EXPERTS[impl]
    monkeypatch.setitem(moe.EXPERTS, impl, lambda *a: calls.append(a[-1]) or inner(*a))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for name in ("hf", impl):
        model = use_moe_impl(micro_nemotron_h(), name).to(DEVICE)
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls == ["relu2", "relu2"]  # kernels/moe.py ran the experts of both MoE layers, squared ReLU
    torch.testing.assert_close(out[impl][0], out["hf"][0], atol=1e-5, rtol=1e-5)
    assert out[impl][1].keys() == out["hf"][1].keys()
    for n, g in out["hf"][1].items():
        torch.testing.assert_close(out[impl][1][n], g, atol=1e-6, rtol=1e-4, msg=n)
    assert any("experts.up_proj" in n for n in out["hf"][1]) and any("gate.weight" in n for n in out["hf"][1])


def _tiny_causal_lm(model_type: str):
    """A 2-layer causal LM of a kernels/moe_families.py family, d=32, 4 experts top-2 (random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=32, moe_intermediate_size=16, num_experts_per_tok=2)
    extra = {
        "deepseek_v3": dict(n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
        "qwen3_next": dict(num_experts=4, shared_expert_intermediate_size=16, head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                           layer_types=["linear_attention", "full_attention"]),
    }[model_type]
    cfg = AutoConfig.for_model(model_type, **common, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.3, 0.3)
    return model


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next"])
def test_other_families_swapped_experts_match_hf(model_type):
    """``use_moe_impl`` on the other families of kernels/moe_families.py: grouped experts, HF's logits and gradients."""
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for name in ("hf", "grouped"):
        model = use_moe_impl(_tiny_causal_lm(model_type), name).to(DEVICE)
        assert (model.config._experts_implementation == "cascade_grouped_swiglu") == (name == "grouped")
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(out["grouped"][0], out["hf"][0], atol=1e-5, rtol=1e-5)
    for n, g in out["hf"][1].items():
        torch.testing.assert_close(out["grouped"][1][n], g, atol=1e-6, rtol=1e-4, msg=n)
    assert any("experts.gate_up_proj" in n for n in out["hf"][1])

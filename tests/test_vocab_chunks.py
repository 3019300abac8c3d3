"""No path materialises the logits of a whole sequence: every op's output is watched (a TorchDispatchMode sees each
aten op of the forward and the backward) while the trainer's policy steps, the reference and a MOPD teacher score,
and the torch engine prefills a long prompt. The model's vocabulary (8,192) times the sequence (1,024 tokens) is 8.4M
logits; the cap is 4 chunks' worth (chunk 128 tokens: 4.2M elements), so a [T, vocab] tensor anywhere fails the test
and names the op."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.messages import TeacherRequest, WorkKey
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.torch_engine import TorchEngine
from cascade_rl.teachers.server import Teacher

VOCAB, TOKENS, CHUNK = 8192, 1024, 128
CAP = 4 * CHUNK * VOCAB  # elements: a chunk's logits, log-softmax and gradient, with room; [T, vocab] is twice it


class Sentinel(TorchDispatchMode):
    """Fails on the first op whose output has more than ``cap`` elements."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap, self.largest = cap, (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                if t.numel() > self.cap:
                    raise AssertionError(f"{func} made a tensor of shape {tuple(t.shape)} ({t.numel()} elements > "
                                         f"the cap {self.cap})")
                self.largest = max(self.largest, (t.numel(), str(func)))
        return out


@pytest.fixture(scope="module")
def big_vocab(tiny_model, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE with an 8,192-token vocabulary and a 2,048-token context (random weights; the tokenizer's
    1,024 ids are a subset)."""
    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.update({"vocab_size": VOCAB, "max_position_embeddings": 2048})
    out = tmp_path_factory.mktemp("big-vocab") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(tiny_model) / name).is_file():
            shutil.copy(Path(tiny_model) / name, out / name)
    return str(out)


def rows(n: int = 2, prompt: int = 24):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (n, TOKENS), generator=g)
    lengths = torch.tensor([TOKENS, TOKENS - 100])
    mask = torch.zeros(n, TOKENS, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, prompt:length] = True
    return ids, lengths, mask


@pytest.mark.parametrize("pack", [True, False])
def test_the_trainers_step_and_the_reference_never_hold_a_sequences_logits(big_vocab, pack):
    model = AutoModelForCausalLM.from_pretrained(big_vocab, dtype=torch.float32)
    policy = Policy(model, chunk_tokens=CHUNK, pack=pack).train()
    ids, lengths, mask = rows()
    with Sentinel(CAP) as watch:
        logprobs, entropy = policy(ids, lengths, mask, with_entropy=True)
        (logprobs[mask].sum() + 0.01 * entropy[mask].sum()).backward()
        with torch.no_grad():  # the reference: the same Policy path without a graph
            policy(ids, lengths, mask)
    assert watch.largest[0] > CHUNK * VOCAB / 2, watch.largest  # the chunks' logits were seen: the watch works
    assert model.lm_head.weight.grad is not None


def test_a_teachers_logprobs_never_hold_a_sequences_logits(big_vocab):
    trainer = SimpleNamespace(logprob_chunk_tokens=CHUNK, pack=True, pack_tokens=8192, logprob_impl="torch")
    teacher = Teacher(AutoModelForCausalLM.from_pretrained(big_vocab, dtype=torch.float32), ["math"], trainer)
    g = np.random.default_rng(0)
    req = TeacherRequest(WorkKey.sample("g", 0), "math", g.integers(5, VOCAB, 24).astype(np.int32),
                         g.integers(5, VOCAB, 2 * 500).astype(np.int32), np.array([500, 500], np.int32))
    assert teacher.check(req) == ""
    with Sentinel(CAP):
        (out,) = teacher.logprobs([req])
    assert out.shape == (1000,) and np.isfinite(out).all() and (out < 0).all()


def test_the_engines_prefill_of_a_long_prompt_never_holds_its_logits(big_vocab):
    engine = TorchEngine(big_vocab, cpu_kernels=False)
    prompt = np.random.default_rng(1).integers(5, 1000, TOKENS).astype(np.int32)
    with Sentinel(CAP):
        (samples,) = engine.generate([GenerationRequest("g", prompt, 2, 1.0, 1.0, 4, [], seed=0)])
    assert len(samples) == 2 and all(len(s.response_ids) >= 1 for s in samples)
    json.dumps([s.logprobs.tolist() for s in samples])  # finite floats

"""Held-out accuracy of one checkpoint, per domain: what the cascade runner records for every checkpoint.

    from cascade_rl.learner.evaluate import evaluate_checkpoint
    acc = evaluate_checkpoint("runs/c/if_rl/checkpoints/step_000030", heldout_rows, n=4, max_tokens=96)
    acc["domains"]["math"], acc["accuracy"]

The same measurement the orchestrator makes during a stage (avg@n at the
sampling temperature, the paper's metric), made offline: a sampler engine
(the built-in torch engine, or vLLM for other architectures) samples every
held-out prompt ``n`` times (the model's chat template, as the orchestrator
renders it), and each domain's verifier from verifiers/registry.py scores the
whole assistant turn with the row's reference and metadata. A verifier that
raises scores 0 and is counted under ``errors``. Group-scored domains (GenRM)
need a judge endpoint and are refused here.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch
from transformers import AutoTokenizer

from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import Row
from cascade_rl.samplers.engine import ENGINES, GenerationRequest
from cascade_rl.verifiers.registry import VERIFIERS


def evaluate_checkpoint(path: str, heldout: list[Row], n: int = 4, temperature: float = 1.0,
                        max_tokens: int = 64, seed: int = 0, thinking: bool = True, engine: str = "torch",
                        device: str = "cpu") -> dict:
    """``{"accuracy": mean over questions, "domains": {domain: accuracy}, "questions": {domain: count},
    "errors": {reason: count}, "seconds": wall time}``; accuracy of a question = mean reward of its n samples."""
    unknown = sorted({row.domain for row in heldout} - set(VERIFIERS))
    if unknown:
        raise ValueError(f"no per-response verifier for {unknown}: evaluate those with a judge-backed run")
    from cascade_rl.samplers import torch_engine, vllm_engine  # noqa: F401  (each registers its engine)

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    render = PromptRenderer(tokenizer, thinking)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = ENGINES[engine](path, device=device)
    requests = [GenerationRequest(f"q{i}", np.array(render.ids(row.messages), np.int32), n, temperature, 1.0,
                                  max_tokens, [], seed + i) for i, row in enumerate(heldout)]
    with torch.inference_mode():
        groups = sampler.generate(requests)
    errors: Counter = Counter()
    per_question = np.zeros(len(heldout))
    for i, (row, samples) in enumerate(zip(heldout, groups)):
        rewards = []
        for s in samples:
            text = render.prefix + tokenizer.decode(s.response_ids, skip_special_tokens=True)
            try:
                rewards.append(float(VERIFIERS[row.domain](text, row.answer, {"question": row.question, **row.metadata})))
            except Exception as e:  # a verifier bug or bad data: scored 0, counted
                errors[f"{row.domain}: {type(e).__name__}"] += 1
                rewards.append(0.0)
        per_question[i] = np.mean(rewards)
    domains = np.array([row.domain for row in heldout])
    names = sorted({str(d) for d in domains})  # str, not numpy.str_: they become config keys
    return {
        "accuracy": float(per_question.mean()) if len(heldout) else float("nan"),
        "domains": {d: float(per_question[domains == d].mean()) for d in names},
        "questions": {d: int((domains == d).sum()) for d in names},
        "n": n,
        "temperature": temperature,
        "errors": dict(errors),
        "seconds": time.perf_counter() - t0,
    }

"""Held-out accuracy of one checkpoint, per domain: what the cascade runner records for every checkpoint.

    from cascade_rl.learner.evaluate import evaluate_checkpoint
    acc = evaluate_checkpoint("runs/c/if_rl/checkpoints/step_000030", heldout, n=4, max_tokens=96)
    acc["domains"]["math"], acc["accuracy"]

The same measurement the orchestrator makes during a stage (avg@n at the
sampling temperature, the paper's metric), made offline: the built-in torch
engine samples every held-out prompt ``n`` times (chat template, thinking
mode, as the orchestrator asks), and each domain's verifier from
verifiers/registry.py scores the turn ``"<think>\\n" + response``, with the
example's reference and metadata. A verifier that raises scores 0 and is
counted under ``errors``. Group-scored domains (GenRM) need a judge endpoint
and are refused here.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch
from transformers import AutoTokenizer

from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.torch_engine import TorchEngine
from cascade_rl.verifiers.registry import VERIFIERS

from .tasks import Example, prompt_ids


def evaluate_checkpoint(path: str, heldout: list[Example], n: int = 4, temperature: float = 1.0,
                        max_tokens: int = 64, seed: int = 0) -> dict:
    """``{"accuracy": mean over questions, "domains": {domain: accuracy}, "questions": {domain: count},
    "errors": {reason: count}, "seconds": wall time}``; accuracy of a question = mean reward of its n samples."""
    unknown = sorted({ex.domain for ex in heldout} - set(VERIFIERS))
    if unknown:
        raise ValueError(f"no per-response verifier for {unknown}: evaluate those with a judge-backed run")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = TorchEngine(path)
    requests = [GenerationRequest(f"q{i}", np.array(prompt_ids(tokenizer, ex), np.int32), n, temperature, 1.0, max_tokens, [], seed + i)
                for i, ex in enumerate(heldout)]
    with torch.inference_mode():
        groups = engine.generate(requests)
    errors: Counter = Counter()
    per_question = np.zeros(len(heldout))
    for i, (ex, samples) in enumerate(zip(heldout, groups)):
        rewards = []
        for s in samples:
            text = "<think>\n" + tokenizer.decode(s.response_ids, skip_special_tokens=True)
            try:
                rewards.append(float(VERIFIERS[ex.domain](text, ex.answer, {"question": ex.question, **ex.metadata})))
            except Exception as e:  # a verifier bug or bad data: scored 0, counted
                errors[f"{ex.domain}: {type(e).__name__}"] += 1
                rewards.append(0.0)
        per_question[i] = np.mean(rewards)
    domains = np.array([ex.domain for ex in heldout])
    names = sorted(set(domains))
    return {
        "accuracy": float(per_question.mean()) if len(heldout) else float("nan"),
        "domains": {d: float(per_question[domains == d].mean()) for d in names},
        "questions": {d: int((domains == d).sum()) for d in names},
        "n": n,
        "temperature": temperature,
        "errors": dict(errors),
        "seconds": time.perf_counter() - t0,
    }

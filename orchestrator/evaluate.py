"""Held-out accuracy, one definition for both places it is measured.

    from cascade_rl.orchestrator.evaluate import evaluate_checkpoint
    acc = evaluate_checkpoint("runs/c/if_rl/checkpoints/step_000030", heldout_rows, n=4, max_tokens=96)
    acc["domains"]["math"], acc["accuracy"]

The measurement is the paper's avg@n: every held-out prompt, rendered in the model's chat template
(data/render.py), is sampled ``n`` times at the sampling temperature (plus, optionally, once greedily);
each response, as the whole assistant turn, is scored by its domain's verifier with the row's reference
and metadata (``verifiers.worker.score_one``: a verifier that raises scores 0 with the reason); a
question's accuracy is the mean reward of its samples, a domain's the mean over its questions
(``accuracy``), and a change between two evaluations of the same questions comes with a 95 % interval
from the per-question paired differences (``paired_gain``).

It is made in two places: during a stage by the orchestrator, through the run's samplers and verifiers
(orchestrator/main.py ``evaluate``), and offline for any checkpoint by ``evaluate_checkpoint`` (a sampler
engine in this process, the verifiers called here): what the cascade runner records for every checkpoint.
Group-scored domains (GenRM) need a judge endpoint and are evaluated in a stage only.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch
from transformers import AutoTokenizer

from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import Row
from cascade_rl.protocol.messages import SamplingParams, ScoreRequest
from cascade_rl.samplers.engine import ENGINES, GenerationRequest, register_builtin_engines
from cascade_rl.verifiers.registry import VERIFIERS
from cascade_rl.verifiers.worker import score_one


def modes(eval_n: int, temperature: float, greedy: bool, max_tokens: int) -> dict[str, tuple[SamplingParams, int]]:
    """The evaluations a stage makes: metric name -> (sampling, samples per question)."""
    out = {"heldout_accuracy": (SamplingParams(temperature=temperature, max_tokens=max_tokens), eval_n)} if eval_n else {}
    if greedy:
        out["heldout_greedy_accuracy"] = (SamplingParams(temperature=0.0, max_tokens=max_tokens), 1)
    return out


def accuracy(domains: list[str], rewards: list[list[float]]) -> tuple[np.ndarray, dict[str, float]]:
    """Per-question accuracy (mean reward of its samples) and the mean per domain."""
    per_question = np.array([np.mean(r) if len(r) else 0.0 for r in rewards])
    by = np.array(domains)
    names = sorted({str(d) for d in domains})  # str, not numpy.str_: they become config keys
    return per_question, {d: float(per_question[by == d].mean()) for d in names}


def paired_gain(after: np.ndarray, before: np.ndarray) -> dict[str, float]:
    """After − before over the same questions, with a 95 % interval from the per-question differences."""
    d = after - before
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return {"delta": float(d.mean()), "ci95_low": float(d.mean() - half), "ci95_high": float(d.mean() + half)}


def evaluate_checkpoint(path: str, heldout: list[Row], n: int = 4, temperature: float = 1.0,
                        max_tokens: int = 64, seed: int = 0, thinking: bool = True, engine: str = "torch",
                        device: str = "cpu") -> dict:
    """``{"accuracy": mean over questions, "domains": {domain: accuracy}, "questions": {domain: count},
    "errors": {reason: count}, "seconds": wall time}``."""
    unknown = sorted({row.domain for row in heldout} - set(VERIFIERS))
    if unknown:
        raise ValueError(f"no per-response verifier for {unknown}: evaluate those with a judge-backed run")
    register_builtin_engines()
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
    rewards = []
    for row, samples in zip(heldout, groups):
        scores = [score_one(ScoreRequest("", row.domain, render.prefix + tokenizer.decode(s.response_ids,
                                                                                       skip_special_tokens=True),
                                         row.answer, {"question": row.question, **row.metadata}))
                  for s in samples]
        errors.update(f"{row.domain}: {s.reason.split(':')[0]}" for s in scores if not s.ok)
        rewards.append([s.reward for s in scores])
    per_question, domains = accuracy([row.domain for row in heldout], rewards)
    return {
        "accuracy": float(per_question.mean()) if len(heldout) else float("nan"),
        "domains": domains,
        "questions": dict(sorted(Counter(row.domain for row in heldout).items())),
        "n": n,
        "temperature": temperature,
        "errors": dict(errors),
        "seconds": time.perf_counter() - t0,
    }

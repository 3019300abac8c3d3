"""Held-out accuracy, one definition for both places it is measured.

    from cascade_rl.orchestrator.evaluate import evaluate_checkpoint
    acc = evaluate_checkpoint("runs/c/if_rl/checkpoints/step_000030", heldout_rows, n=4, max_tokens=96)
    acc["domains"]["math"], acc["accuracy"]

The measurement is the paper's avg@n: every held-out prompt, rendered in the model's chat template
(data/render.py), is sampled ``n`` times at the sampling temperature (plus, optionally, once greedily);
each response, as the whole assistant turn, is scored by its domain's verifier with the row's reference
and metadata (``verifiers.scoring.score_one``: a verifier that raises scores 0 with the reason); a
question's accuracy is the mean reward of its samples, a domain's the mean over its questions
(``accuracy``), and a change between two evaluations of the same questions comes with a 95 % interval
from the per-question paired differences (``paired_gain``).

It is made in two places: during a stage by the orchestrator, through the run's samplers and verifiers
(orchestrator/main.py ``evaluate``), and offline for any checkpoint by ``evaluate_checkpoint`` (a sampler
engine in this process, the verifiers called here): what the cascade runner records for every checkpoint.
A group-scored domain (GenRM) is evaluated one response at a time by its held-out verifier
(``EVAL_VERIFIERS``: the judge's preference for the response over the row's baseline answer, ArenaHard-style);
judged domains need the judge endpoint in ``verifiers.registry.SETTINGS`` (the cascade runner serves it).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import Row
from cascade_rl.data.tokenizer import load_tokenizer
from cascade_rl.protocol.messages import SamplingParams
from cascade_rl.samplers.engine import ENGINES, register_builtin_engines
from cascade_rl.verifiers.registry import EVAL_VERIFIERS, SETTINGS, VERIFIERS


def model_context(path: str) -> int:
    """The model's context length (``max_position_embeddings`` of its HF config; 0 when it has none): prompts and
    multi-turn trajectories are sampled within it (``Rules.context``). Read from config.json when it is written
    there (the orchestrator then starts without torch, which AutoConfig imports), else the config class's default."""
    config = Path(path) / "config.json"
    if config.is_file() and "max_position_embeddings" in (written := json.loads(config.read_text())):
        return int(written["max_position_embeddings"] or 0)
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 0)


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


def interval(per_question: np.ndarray) -> list[float]:
    """A 95 % interval of a mean accuracy over questions (normal approximation over the per-question means)."""
    m = float(per_question.mean())
    half = 1.96 * float(per_question.std(ddof=1)) / np.sqrt(len(per_question)) if len(per_question) > 1 else float("nan")
    return [m - half, m + half]


def domain_intervals(per_question: dict[str, np.ndarray], rows: list[Row]) -> dict[str, list[float]]:
    """``{"MODE/DOMAIN": [low, high]}``: the 95 % interval of each domain's held-out accuracy in each mode."""
    by = np.array([r.domain for r in rows])
    return {f"{mode}/{d}": interval(pq[by == d]) for mode, pq in per_question.items() for d in sorted(set(by.tolist()))}


def domain_gains(after: dict[str, np.ndarray], before: dict[str, np.ndarray], rows: list[Row]) -> dict[str, dict]:
    """``{"MODE/DOMAIN": paired_gain}``: each domain's change over the stage, with its paired 95 % interval."""
    by = np.array([r.domain for r in rows])
    return {f"{mode}/{d}": paired_gain(after[mode][by == d], b[by == d])
            for mode, b in before.items() if mode in after for d in sorted(set(by.tolist()))}


def evaluate_checkpoint(path: str, heldout: list[Row], n: int = 4, temperature: float = 1.0,
                        max_tokens: int = 64, seed: int = 0, thinking: bool = True, engine: str = "torch",
                        device: str = "cpu", env_defaults: dict[str, str] | None = None, max_turns: int = 4,
                        environment: dict | None = None) -> dict:
    """``{"accuracy": mean over questions, "domains": {domain: accuracy}, "questions": {domain: count},
    "errors": {reason: count}, "seconds": wall time}``. Multi-turn rows (their ``env``, else ``env_defaults``
    of their domain) are sampled with their environment's tools (settings: the ``environment`` section), up to
    ``max_turns`` turns, through the same rules as a stage (orchestrator/offline.py)."""
    import torch  # here, not at the top: the orchestrator imports this module for its statistics, without torch

    from cascade_rl.environments.base import EnvSettings
    from cascade_rl.environments.registry import build_environment

    from .offline import Scorer, offline_core, run_in_process
    from .rules import Rules

    unknown = sorted({row.domain for row in heldout} - set(VERIFIERS) - set(EVAL_VERIFIERS))
    if unknown:
        raise ValueError(f"no per-response verifier for {unknown} (verifiers/registry.py VERIFIERS, EVAL_VERIFIERS)")
    register_builtin_engines()
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = ENGINES[engine](path, device=device)
    envs = [row.env or (env_defaults or {}).get(row.domain, "") for row in heldout]
    settings = EnvSettings.from_config(environment or {})
    environments = {name: build_environment(name, settings) for name in sorted(set(envs) - {""})}
    render = PromptRenderer(tokenizer, thinking)
    core = offline_core(render, Rules(max_turns=max_turns, context=model_context(path)),
                        sorted({r.domain for r in heldout}), sorted(environments))
    groups = [core.add_group(row, np.array(render.ids(row.messages), np.int32), n,
                             SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i),
                             train=False, env=env)
              for i, (row, env) in enumerate(zip(heldout, envs))]
    # judged rows as many at a time as the judge takes (verifier.judge.concurrency): its server batches them
    scorer = Scorer(judge_workers=int((SETTINGS.get("judge") or {}).get("concurrency", 4)))
    try:
        with torch.inference_mode():
            run_in_process(core, sampler, environments, scorer)
    finally:
        scorer.close()
    errors: Counter = Counter()
    rewards = []
    for g in groups:
        scores = [g.scores[i] for i in sorted(g.scores)]
        errors.update(f"{g.row.domain}: {s.reason.split(':')[0]}" for s in scores if not s.ok)
        if g.error:
            errors[f"{g.row.domain}: {g.error.split(':')[0]}"] += 1
        rewards.append([g.scores[i].reward if i in g.scores else 0.0 for i in range(g.n)])
    per_question, domains = accuracy([row.domain for row in heldout], rewards)
    return {
        "accuracy": float(per_question.mean()) if len(heldout) else float("nan"),
        "domains": domains,
        # each question's accuracy, in the order of ``heldout``: two checkpoints evaluated on the same rows give
        # each domain's change with a paired interval (``paired_gain``; the cascade's report)
        "per_question": [round(float(x), 4) for x in per_question],
        "questions": dict(sorted(Counter(row.domain for row in heldout).items())),
        "n": n,
        "temperature": temperature,
        "errors": dict(errors),
        "seconds": time.perf_counter() - t0,
    }

"""The built-in miniature tasks: a registry of procedurally generated prompt sets for RL stages and SFT,
written as data files by ``cascade-rl make-data`` (data/builtin.py): the demo trains from those files as a
user's run does.

A task turns a generator of items (an arithmetic expression, a function spec, a buggy module, ...) into
``Example``s: the user question, the instruction that follows it in the prompt, the reference answer and
metadata the domain's verifier checks, and a worked solution for SFT. Splits (held-out, RL prompts, SFT data)
are question-disjoint.

    from cascade_rl.data.tasks import domains, load_task
    splits = load_task("arithmetic", {"heldout": 200, "rl": 2000, "sft": 2000})
    splits = load_task("cascade", {"heldout": 64, "rl": 2000, "sft": 4000})  # a mixture: four domains
    domains("cascade")  # ['math', 'mcqa', 'structured_output', 'instruction_following']

Each family of tasks lives in a module of its own that registers its tasks and mixtures in data/task_base.py's
registries: data/arithmetic.py (the four arithmetic domains of the cascade, the tool tasks), data/chat.py (RLHF's
prompts), data/long_context.py, data/coding.py (code RL, agentless and agentic SWE) and data/judge.py (the judge
model's SFT data); each module's docstring has its table of tasks. This module is the catalog: it imports every
family, makes the question-disjoint splits and the mixtures (``full``: every policy domain of the cascade).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

# every task family registers its tasks and mixtures in task_base's registries when imported
from . import arithmetic, chat, coding, judge, long_context  # noqa: F401
from .task_base import (  # noqa: F401  (the catalog's public names: users and tests import them from here)
    BOXED_INSTRUCTION,
    MIXES,
    SPLITS,
    TASKS,
    TURN_PREFIX,
    Example,
    Item,
    Task,
    register_mix,
    register_task,
    think,
    tool_call,
)


def mixture(name: str) -> dict[str, float] | None:
    """The weights of a mixture: a name of ``MIXES``, or inline ``"task:weight+task:weight"`` (a weight
    defaults to 1: ``"arithmetic:3+arithmetic_if"``); None for a single task's name."""
    if name in MIXES:
        return MIXES[name]
    if "+" not in name and ":" not in name:
        return None
    weights = {}
    for part in name.split("+"):
        task, _, weight = part.strip().partition(":")
        try:
            weights[task] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"mixture {name!r}: weight {weight!r} of {task!r} is not a number") from None
    return weights


def domains(name: str) -> list[str]:
    """The reward domains of a task or mixture, in member order."""
    if (weights := mixture(name)) is not None:
        if unknown := sorted(set(weights) - set(TASKS)):
            raise KeyError(f"mixture members {unknown} are not tasks; known: {sorted(TASKS)}")
        return list(dict.fromkeys(TASKS[t].domain for t in weights))
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}, mixtures: {sorted(MIXES)}")
    return [TASKS[name].domain]


def _wanted(sizes: Mapping[str, int]) -> dict[str, int]:
    unknown = set(sizes) - set(SPLITS)
    if unknown:
        raise KeyError(f"unknown splits {sorted(unknown)}; known: {SPLITS}")
    return {split: sizes.get(split, 0) for split in SPLITS}


def load_task(name: str, sizes: Mapping[str, int], seed: int = 0, **params) -> dict[str, list[Example]]:
    """Question-disjoint splits of one task or mixture: ``{"heldout": [...], "rl": [...], "sft": [...]}``.

    The SFT warm start, the RL prompts and the held-out evaluation never share a
    question, so held-out accuracy measures generalisation and RL gains are not
    memorised SFT answers resurfacing. reasoning-gym seeds item i with
    ``seed + i`` (two seeds overlap), so one stream is drawn and each new
    distinct question fills the first split (in SPLITS order) that is not full.
    A mixture (a name of ``MIXES``, or inline weights ``"arithmetic:3+arithmetic_if:1"``) goes to
    ``load_mixture``; ``params`` (reasoning-gym's
    basic_arithmetic settings) go to every member.
    """
    if (weights := mixture(name)) is not None:
        return load_mixture(weights, sizes, seed, **params)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}, mixtures: {sorted(MIXES)}")
    task, wanted = TASKS[name], _wanted(sizes)
    out: dict[str, list[Example]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    stream_seed = seed * 1_000_003 + task.stream
    for p in task.problems(sum(wanted.values()) * 2, stream_seed, **params):
        if p.question in seen:
            continue
        seen.add(p.question)
        split = next((sp for sp in SPLITS if len(out[sp]) < wanted[sp]), None)
        if split is None:
            break
        out[split].append(task.render(p, stream_seed))
    short = {sp: len(out[sp]) for sp in SPLITS if len(out[sp]) < wanted[sp]}
    if short:
        raise ValueError(f"task {name!r} yields too few distinct questions for {short} (wanted {wanted})")
    return {sp: out[sp] for sp in SPLITS if wanted[sp]}


def shares(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """``total`` split by weight, largest remainder first (ties in member order); the counts sum to ``total``."""
    norm = sum(weights.values())
    exact = {t: total * w / norm for t, w in weights.items()}
    counts = {t: int(x) for t, x in exact.items()}
    by_remainder = sorted(weights, key=lambda t: counts[t] - exact[t])  # stable: member order breaks ties
    for t in by_remainder[: total - sum(counts.values())]:
        counts[t] += 1
    return counts


def held_out_questions(heldout: int, seed: int = 0, **params) -> set[str]:
    """The questions any task holds out at this held-out size: no mixture trains on them.

    Tasks draw their own streams, but the question space is small (~5,000 three-term
    expressions), so a question held out by one task is often an RL or SFT question of
    another: without this, ~15 % of each domain's 64 held-out questions were SFT data of the
    cascade mixture, in another format. (The tool tasks' questions all multiply: never
    questions of the others.)
    """
    return {ex.question for t in TASKS for ex in load_task(t, {"heldout": heldout}, seed, **params)["heldout"]}


def load_mixture(weights: Mapping[str, float], sizes: Mapping[str, int], seed: int = 0,
                 **params) -> dict[str, list[Example]]:
    """Splits of a weighted mixture of tasks; ``sizes`` are per task.

    Every member is split on its own with the same ``sizes`` (``load_task``), so a
    task's held-out questions never depend on the mixture that asks for them, and a
    member's RL and SFT examples are drawn in order from its own RL and SFT splits:
    every guarantee of single tasks carries over (no held-out question is trained on,
    SFT never sees an RL prompt of a stage with at most ``sizes["rl"]``), whichever
    tasks and mixtures the stages use. Across tasks, RL and SFT also skip every
    question of ``held_out_questions`` (held out by any task, in any format).

    - ``heldout``: every member's held-out split, concatenated in member order
      (``sizes["heldout"]`` per task; each Example carries its domain).
    - ``rl`` / ``sft``: ``sizes[split]`` examples in all; member t contributes the
      first ``shares(weights, sizes[split])[t]`` questions of its own split that no
      task holds out, shuffled together by ``seed``. A member weighted above ~90 %
      runs short of them (ValueError): load that task on its own instead.
    """
    if not weights:
        raise ValueError("a mixture needs at least one task")
    unknown = sorted(set(weights) - set(TASKS))
    if unknown:
        raise KeyError(f"mixture members {unknown} are not tasks; known: {sorted(TASKS)}")
    if not all(w > 0 for w in weights.values()):
        raise ValueError(f"mixture weights must be positive, got {dict(weights)}")
    wanted = _wanted(sizes)
    members = {t: load_task(t, wanted, seed, **params) for t in weights}
    reserved = held_out_questions(wanted["heldout"], seed, **params) if wanted["heldout"] else set()
    out: dict[str, list[Example]] = {}
    if wanted["heldout"]:
        out["heldout"] = [ex for t in weights for ex in members[t]["heldout"]]
    for split in ("rl", "sft"):
        if not wanted[split]:
            continue
        mixed = []
        for t, n in shares(weights, wanted[split]).items():
            pool = [ex for ex in members[t][split] if ex.question not in reserved]
            if len(pool) < n:
                raise ValueError(f"mixture member {t!r} has {len(pool)} {split} questions no task holds out, "
                                 f"{n} wanted: lower its weight or load it on its own")
            mixed += pool[:n]
        random.Random(f"{seed}/{split}").shuffle(mixed)
        out[split] = mixed
    return out

# every policy domain of the paper's cascade in miniature (`cascade-rl cascade full`): the SFT warm start and the
# held-out set of every stage (long_context_short: the SFT's long-context rows, data/long_context.py); the judge model's data is the mixture ``judge`` (data/judge.py)
register_mix("full", {"arithmetic": 1, "arithmetic_mcqa": 1, "arithmetic_json": 1, "arithmetic_if": 1, "chat": 1,
                      "chat_gold": 1, "long_context": 1, "long_context_short": 1, "code_fn": 1, "swe_patch": 1,
                      "swe_agent": 1})
# the cut of it that `make run` runs (configs/cascade/demo.yaml): the four arithmetic domains and RLHF's chat, held out
# both as the judge scores it and by its gold (chat_gold)
register_mix("demo", {"arithmetic": 1, "arithmetic_mcqa": 1, "arithmetic_json": 1, "arithmetic_if": 1, "chat": 1,
                      "chat_gold": 1})

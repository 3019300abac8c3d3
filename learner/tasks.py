"""Prompt sets for RL stages and SFT, generated procedurally by reasoning-gym.

A task turns a reasoning-gym dataset into ``Example``s: the user question, the
reference answer the verifier checks, the reward domain, and a worked solution
for SFT. Splits (held-out, RL prompts, SFT data) are question-disjoint.

    from cascade_rl.learner.tasks import load_task
    splits = load_task("arithmetic", {"heldout": 200, "rl": 2000, "sft": 2000})
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import reasoning_gym

# The paper's math prompts ask for the final answer in \boxed{}; the strict
# binary reward (verifiers/math.py) reads only that.
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    answer: str
    domain: str
    solution: str  # worked solution (reasoning, then the final boxed answer) for SFT

    @property
    def prompt(self) -> str:
        return f"{self.question} {BOXED_INSTRUCTION}"


def _arithmetic_steps(expression: str) -> list[str]:
    """Left-to-right worked steps for a +/- expression: '7 + 5 - 3' -> ['7 + 5 = 12', '12 - 3 = 9']."""
    tokens = expression.split()
    acc = int(tokens[0])
    steps = []
    for op, term in zip(tokens[1::2], tokens[2::2]):
        value = acc + int(term) if op == "+" else acc - int(term)
        steps.append(f"{acc} {op} {term} = {value}")
        acc = value
    return steps


def worked_solution(reasoning: list[str], answer: str) -> str:
    """The assistant turn after the thinking-mode generation prompt ('<think>\\n')."""
    body = "\n".join(reasoning)
    return f"{body}\n</think>\n\n\\boxed{{{answer}}}"


def _arithmetic(size: int, seed: int, **params) -> list[Example]:
    cfg = dict(min_terms=3, max_terms=4, min_digits=1, max_digits=1, operators=("+", "-"))
    cfg.update(params)
    cfg.update(allow_parentheses=False, allow_negation=False, format_style="simple", whitespace="single")
    if set(cfg["operators"]) - {"+", "-"}:
        raise ValueError("the arithmetic task's worked solutions cover + and - only")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, **cfg)
    out = []
    for item in ds:
        expression = item["metadata"]["expression"]
        if not re.fullmatch(r"\d+( [+-] \d+)+", expression):
            raise ValueError(f"unexpected expression form {expression!r}")
        steps = _arithmetic_steps(expression)
        answer = str(item["answer"])
        if steps[-1].split(" = ")[1] != answer:
            raise ValueError(f"worked steps disagree with reasoning-gym on {expression!r}")
        out.append(Example(item["question"], answer, "math", worked_solution(steps, answer)))
    return out


TASKS: dict[str, Callable[..., list[Example]]] = {"arithmetic": _arithmetic}


SPLITS = ("heldout", "rl", "sft")


def load_task(name: str, sizes: dict[str, int], seed: int = 0, **params) -> dict[str, list[Example]]:
    """Question-disjoint splits of one task: ``{"heldout": [...], "rl": [...], "sft": [...]}``.

    The SFT warm start, the RL prompts and the held-out evaluation never share a
    question, so held-out accuracy measures generalisation and RL gains are not
    memorised SFT answers resurfacing. reasoning-gym seeds item i with
    ``seed + i`` (two seeds overlap), so one stream is drawn and each new
    distinct question fills the first split (in SPLITS order) that is not full.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    unknown = set(sizes) - set(SPLITS)
    if unknown:
        raise KeyError(f"unknown splits {sorted(unknown)}; known: {SPLITS}")
    wanted = {split: sizes.get(split, 0) for split in SPLITS}
    out: dict[str, list[Example]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    stream = TASKS[name](sum(wanted.values()) * 2, seed * 1_000_003, **params)
    for ex in stream:
        if ex.question in seen:
            continue
        seen.add(ex.question)
        split = next((sp for sp in SPLITS if len(out[sp]) < wanted[sp]), None)
        if split is None:
            break
        out[split].append(ex)
    short = {sp: len(out[sp]) for sp in SPLITS if len(out[sp]) < wanted[sp]}
    if short:
        raise ValueError(f"task {name!r} yields too few distinct questions for {short} (wanted {wanted})")
    return {sp: out[sp] for sp in SPLITS if wanted[sp]}

"""Prompt sets for RL stages and SFT, generated procedurally by reasoning-gym.

A task turns a reasoning-gym dataset into ``Example``s: the user question, the
reference answer the verifier checks, the reward domain, and a worked solution
for SFT. Held-out sets use another seed and drop every question that also
occurs in the training pool, so held-out accuracy measures generalisation.

    from cascade_rl.learner.tasks import load_task
    train, heldout = load_task("arithmetic", train_size=4000, heldout_size=200)
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
    cfg = dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1, operators=("+", "-"))
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


def load_task(
    name: str, train_size: int, heldout_size: int, seed: int = 0, **params
) -> tuple[list[Example], list[Example]]:
    """Training pool and held-out set, disjoint by question text.

    reasoning-gym seeds item i with ``seed + i``, so two seeds overlap; instead
    one stream is drawn, its first ``heldout_size`` distinct questions are held
    out, and the training pool is the rest of the stream minus those questions.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    stream = TASKS[name](train_size + heldout_size * 4, seed * 1_000_003, **params)
    heldout: dict[str, Example] = {}
    for ex in stream:
        if len(heldout) == heldout_size:
            break
        heldout.setdefault(ex.question, ex)
    if len(heldout) < heldout_size:
        raise ValueError(f"task {name!r} yields only {len(heldout)} distinct questions for the held-out set")
    train = [ex for ex in stream if ex.question not in heldout][:train_size]
    return train, list(heldout.values())

"""What every built-in task shares: ``Example`` (one prompt with its reference, metadata and worked solution),
``Task`` (a generator of items and how each becomes an Example), and the registries the task families add to.

A family of tasks is a module that imports this one and calls ``register_task`` / ``register_mix``
(data/arithmetic.py, data/chat.py, ...); data/tasks.py imports every family and makes the splits. This module
imports nothing of ours, so a family may import another family (data/judge.py reads data/chat.py) in any order.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, Protocol

# The paper's math prompts ask for the final answer in \boxed{}; the strict
# binary reward (verifiers/math.py) reads only that.
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."

# What the thinking-mode generation prompt opens the assistant turn with (data/render.py ``prefix``): an assistant
# message of a trace holds it, as the chat template renders the model's earlier turns in the conversation.
TURN_PREFIX = "<think>\n"


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    """The problem ("Calculate 7 + 5 - 3."): splits are disjoint in it."""
    answer: str
    """The reference the domain's verifier gets."""
    domain: str
    """Reward domain: the verifier of verifiers/registry.py that scores it."""
    solution: str
    """Worked solution for SFT: the reasoning, ``</think>``, then the final answer (the text after the generation
    prompt: the model's turn, which the verifier scores)."""
    instruction: str = BOXED_INSTRUCTION
    """What follows the question in the prompt: options, answer format, verifiable instructions."""
    metadata: dict = dataclasses.field(default_factory=dict, hash=False)
    """What the domain's verifier gets as metadata (a dict: left out of the hash, so Examples stay hashable)."""
    turns: tuple[dict, ...] = dataclasses.field(default=(), hash=False)
    """A multi-turn task's SFT trace: the messages after the prompt, ``{"role": "assistant" | "tool", "content"}``,
    each assistant content the whole turn as the template renders it in the conversation (``TURN_PREFIX`` and
    what the model generated after it); ``solution`` is then the last turn's generated text. Empty for single-turn
    tasks (left out of the hash, as ``metadata``)."""
    env: str = ""
    """The environment whose tools the model calls mid-rollout (the rows' ``env``); "" for single-turn tasks."""

    @property
    def prompt(self) -> str:
        return f"{self.question} {self.instruction}"


def think(reasoning: list[str] | tuple[str, ...], final: str) -> str:
    """The assistant turn after the thinking-mode generation prompt ('<think>\\n'): reasoning, then the answer."""
    body = "\n".join(reasoning)
    return f"{body}\n</think>\n\n{final}"


def tool_call(name: str, arguments: dict) -> str:
    """One Hermes/Qwen3-style call in the assistant's text (environments/tool_calls.py reads it)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Item(Protocol):
    """What a task's generator yields: anything with the question that splits are disjoint in."""

    question: str


@dataclasses.dataclass(frozen=True)
class Task:
    render: Callable[[Any, int], Example]
    """(item, stream seed) -> Example."""
    domain: str
    """The reward domain of its Examples."""
    stream: int
    """Offset of its generator's seed: tasks draw different streams (reasoning-gym seeds item i with
    ``seed + i``, so the offsets lie far apart); tasks of one stream ask the same questions."""
    problems: Callable[..., list[Item]]
    """(size, stream seed, **params) -> the stream's first ``size`` items."""


TASKS: dict[str, Task] = {}
MIXES: dict[str, dict[str, float]] = {}
SPLITS = ("heldout", "rl", "sft")


def register_task(name: str, task: Task) -> None:
    """Add a task to ``TASKS``; a second task of the same name raises ValueError."""
    if name in TASKS:
        raise ValueError(f"task {name!r} registered twice")
    TASKS[name] = task


def register_mix(name: str, weights: dict[str, float]) -> None:
    """Add a mixture (task -> weight) to ``MIXES``; a second one of the same name raises ValueError."""
    if name in MIXES or name in TASKS:
        raise ValueError(f"mixture {name!r} registered twice (or a task of that name exists)")
    MIXES[name] = weights

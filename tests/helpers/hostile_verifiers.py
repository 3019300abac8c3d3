"""Verifiers that misbehave, registered for tests/test_verifier_worker.py (a ``verifier.plugins`` module)."""

from __future__ import annotations

import os
import time

from cascade_rl.verifiers.registry import register_group_verifier, register_verifier


@register_verifier("test_hang")
def hang(response: str, reference: str, metadata: dict) -> float:
    while True:
        time.sleep(1)


@register_verifier("test_die")
def die(response: str, reference: str, metadata: dict) -> float:
    os._exit(3)


@register_verifier("test_raise")
def boom(response: str, reference: str, metadata: dict) -> float:
    raise RuntimeError("verifier bug")


@register_verifier("test_slow_ok")
def slow_ok(response: str, reference: str, metadata: dict) -> float:
    time.sleep(float(metadata.get("sleep", 0.3)))
    return 1.0


@register_group_verifier("test_group_len")
def by_length(prompt: str, responses: list[str], reference: str, metadata: dict) -> list[float]:
    """A stand-in group judge: the longest response wins (rank / (n − 1))."""
    order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
    rank = {i: r for r, i in enumerate(order)}
    return [rank[i] / max(1, len(responses) - 1) for i in range(len(responses))]


@register_group_verifier("test_group_short")
def too_few(prompt: str, responses: list[str], reference: str, metadata: dict) -> list[float]:
    return [1.0]

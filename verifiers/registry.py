"""Reward functions by domain, registered by name.

A verifier is ``fn(response, reference, metadata) -> float``; it may raise,
and the worker turns that into ``Score(ok=False, reason=...)``. A group
verifier scores a prompt's responses together (see ``GROUP_VERIFIERS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cascade_rl.protocol.registry import Registry

Verifier = Callable[[str, str, dict[str, Any]], float]
VERIFIERS = Registry("verifier domain")  # domain -> Verifier
register_verifier = VERIFIERS.register

# Group verifiers score all responses of one prompt together (pairwise GenRM judging):
# ``fn(prompt, responses, reference, metadata) -> list[float]``, one reward per response.
GroupVerifier = Callable[[str, list[str], str, dict[str, Any]], list[float]]
GROUP_VERIFIERS = Registry("group verifier")
register_group_verifier = GROUP_VERIFIERS.register

# Settings the worker hands its scoring processes (``workers.judge``: endpoint, model, key variable ...).
SETTINGS: dict[str, Any] = {}


def is_group_domain(name: str) -> bool:
    return name in GROUP_VERIFIERS


@register_verifier("math")
def _math(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .math import score_math  # math-verify imports sympy: pay for it only where math is scored

    return score_math(response, reference)

"""Reward functions by domain, registered by name.

A verifier is ``fn(response, reference, metadata) -> float``; it may raise,
and the worker turns that into ``Score(ok=False, reason=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cascade_rl.protocol.registry import Registry

Verifier = Callable[[str, str, dict[str, Any]], float]
VERIFIERS = Registry("verifier domain")  # domain -> Verifier
register_verifier = VERIFIERS.register


@register_verifier("math")
def _math(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .math import score_math  # math-verify imports sympy: pay for it only where math is scored

    return score_math(response, reference)

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


# Each domain's module is imported when that domain is first scored (nltk, jsonschema ... only where used).


@register_verifier("mcqa")
def _mcqa(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .mcqa import score_mcqa

    return score_mcqa(response, reference, metadata)


@register_verifier("instruction_following")
def _instruction_following(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .instruction_following import score_instruction_following

    return score_instruction_following(response, reference, metadata)


@register_verifier("structured_output")
def _structured_output(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .structured_output import score_structured_output

    return score_structured_output(response, reference, metadata)


@register_verifier("code")
def _code(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Strict binary: the program passes every test, run in verifiers/sandbox.py (needs root for namespaces)."""
    from .code import score_code

    return score_code(response, reference, metadata)


@register_verifier("tool_call")
def _tool_call(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .tool_call import score_tool_call

    return score_tool_call(response, reference, metadata)


def judge_endpoint():
    """The judge endpoint of ``workers.judge`` (handed to scoring processes in ``SETTINGS``)."""
    from .llm_judge import JudgeEndpoint

    cfg = SETTINGS.get("judge") or {}
    if not cfg.get("model"):
        raise ValueError("workers.judge.model is not set: model-judged domains need a judge endpoint")
    return JudgeEndpoint(base_url=cfg["base_url"], model=cfg["model"], api_key_env=cfg.get("api_key_env", ""),
                         concurrency=cfg.get("concurrency", 8), timeout_s=cfg.get("timeout_s", 60.0),
                         max_tokens=cfg.get("max_tokens", 4096))


@register_group_verifier("genrm")
def _genrm(prompt: str, responses: list[str], reference: str, metadata: dict[str, Any]) -> list[float]:
    """RLHF: pairwise GenRM judging of the whole group (verifiers/genrm.py: win rate, length terms)."""
    import asyncio

    from .genrm import GenRMConfig, score_group
    from .llm_judge import ChatClient

    async def run() -> list[float]:
        async with ChatClient(judge_endpoint()) as client:
            return list((await score_group(client, prompt, responses, GenRMConfig())).rewards)

    return asyncio.run(run())


@register_verifier("llm_judge")
def _llm_judge(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Long-context QA: a judge model decides whether the answer matches the reference (verifiers/llm_judge.py)."""
    import asyncio

    from .llm_judge import ChatClient, judge_answer

    async def run() -> float:
        async with ChatClient(judge_endpoint()) as client:
            reward, reason = await judge_answer(client, metadata.get("question", ""), response, reference)
            if reason.startswith("unparseable"):
                raise ValueError(reason)  # ok=false with the reason: a judge failure, not a wrong answer
            return reward

    return asyncio.run(run())

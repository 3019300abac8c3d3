"""The gateway's OpenAI wire format: a ``POST /v1/chat/completions`` body read and checked, a reply written.

    call = parse_call(body, run=RunSampling(temperature=1.0, top_p=1.0, max_tokens=1024))   # ApiError(400)
    call.overridden          # ["temperature", ...]: the client's values the run's sampling replaced
    completion(served_name, message, finish_reason, prompt_tokens, completion_tokens)

Errors have OpenAI's (and vLLM's) shape (samplers/chat_api.py ``ApiError``, ``error_body``). Read:

- ``messages``: each an object with a string ``role``; content a string, a list of text parts, or null (an
  assistant message with ``tool_calls``); ``tool_calls``, ``tool_call_id`` and ``name`` are kept for the template.
- ``tools``: OpenAI function schemas, handed to the chat template. ``tool_choice``: ``auto``, ``none`` or absent
  are what the model does anyway; anything else (``required``, a named function) is accepted and NOT enforced: the
  model samples what it samples (forcing a call would change the on-policy distribution).
- ``stop`` (a string or a list), ``max_tokens`` / ``max_completion_tokens`` (at most the run's
  ``sampling.max_tokens``; 0 or absent: the run's).
- ``temperature``, ``top_p``: the run's sampling governs (the trainer's log-prob ratios assume it); a client's
  different value is overridden and listed in ``overridden`` (the server reports it).
- ``n`` other than 1 and ``stream=true`` are refused (400, with the reason). ``model`` may name anything: the
  run's policy answers. Other fields (``seed``, ``logprobs``, ``user`` ...) are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from cascade_rl.samplers.chat_api import ApiError, messages_of, number

TOLERANCE = 1e-6  # a client's temperature/top_p this close to the run's is the run's (no override reported)


@dataclasses.dataclass(frozen=True)
class RunSampling:
    """The run's sampling (config ``sampling``) that every agent call is sampled with."""

    temperature: float
    top_p: float
    max_tokens: int


@dataclasses.dataclass
class ChatCall:
    """One checked chat request."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None
    stop: list[str]
    max_tokens: int  # 0: the run's sampling.max_tokens
    overridden: list[str]  # the sampling fields the client set to another value than the run's


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, "`tools` must be a list of {type: function, function: {...}} objects", param="tools")
    return tools or None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"`stop` must be a string or a list of strings, got {body.get('stop')!r}", param="stop")
    return list(stop)


def _overridden(body: dict, run: RunSampling) -> list[str]:
    out = []
    for name, own in (("temperature", run.temperature), ("top_p", run.top_p)):
        value = number(body, name, own, float, 0.0)
        if not math.isclose(value, own, abs_tol=TOLERANCE):
            out.append(name)
    return out


def parse_call(body: Any, run: RunSampling) -> ChatCall:
    """The call of a ``POST /v1/chat/completions`` body (rules in the module docstring); ``ApiError`` otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object with `messages`")
    if body.get("stream"):
        raise ApiError(400, "`stream` is not supported by the gateway (each call's tokens are sampled and booked "
                            "as one turn): send stream=false", param="stream")
    if number(body, "n", 1, int) != 1:
        raise ApiError(400, f"only n=1 is supported (one call is one turn of one trajectory), got n={body['n']}",
                       param="n")
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = number({"max_tokens": asked}, "max_tokens", 0, int, 0)
    return ChatCall(messages=messages_of(body, whole=True), tools=_tools(body), stop=_stop(body),
                    max_tokens=min(max_tokens, run.max_tokens) if max_tokens else 0,
                    overridden=_overridden(body, run))


def completion(served_name: str, message: dict, finish_reason: str, prompt_tokens: int,
               completion_tokens: int) -> dict:
    """An OpenAI ``chat.completion`` with one choice holding ``message`` (content, and tool_calls if any)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def reward_of(body: Any) -> float:
    """The reward of a ``POST /rl/reward`` body ``{"reward": number}``; ``ApiError(400)`` otherwise."""
    value = body.get("reward") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f'the body must be {{"reward": <a finite number>}}, got {body!r:.80}', param="reward")
    return float(value)

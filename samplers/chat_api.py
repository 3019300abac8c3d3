"""The OpenAI chat-completions wire format of samplers/chat_server.py: a request read and checked, a reply written.

    req = parse_chat(body, served_name="judge", max_tokens_default=256)   # raises ApiError(400 | 404, message)
    gen = req.generation(prompt_ids)                                       # the engine's GenerationRequest
    body = completion("judge", text, "stop", prompt_tokens, completion_tokens)

Errors have vLLM's shape and messages (``{"error": {"message", "type", "param", "code"}}``; another model
name is a 404 "The model `x` does not exist."), so a judge client cannot tell this server from vLLM's.
Fields OpenAI clients send that do not change a greedy or sampled completion here (``frequency_penalty``,
``logprobs``, ``user`` ...) are ignored, as vLLM ignores what it does not implement; ``n`` other than 1 and
``stream`` are refused.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import numpy as np

from .engine import GenerationRequest


class ApiError(Exception):
    """A request the server answers with ``status`` and ``message`` (never a traceback)."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


@dataclasses.dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    chat_template_kwargs: dict[str, Any]

    def generation(self, prompt_ids: list[int]) -> GenerationRequest:
        return GenerationRequest(key=uuid.uuid4().hex, prompt_ids=np.asarray(prompt_ids, np.int32), n=1,
                                 temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                                 stop=self.stop, seed=self.seed)


def number(body: dict, key: str, default: float, kind: type = float, low: float | None = None) -> Any:
    """``body[key]`` as ``kind`` (default when absent or null), at least ``low``; 400 otherwise."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"`{key}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    if low is not None and value < low:
        raise ApiError(400, f"`{key}` must be >= {low:g}, got {value!r}", param=key)
    return kind(value)


def content_text(message: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts, got {content!r:.80}",
                   param="messages")


def messages_of(body: dict, whole: bool = False) -> list[dict[str, Any]]:
    """The request's messages, each with its content as text: {role, content} only, or (``whole``: the gateway,
    which renders tool calls and tool-call ids) every field, ``tool_calls`` checked to be a list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ApiError(400, f"messages[{i}] must be an object with a string `role`, got {m!r:.80}",
                           param="messages")
        if not whole:
            out.append({"role": m["role"], "content": content_text(m, i)})
            continue
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list of objects", param="messages")
        out.append({**m, "content": content_text(m, i)})
    return out


def parse_chat(body: Any, served_name: str, max_tokens_default: int) -> ChatRequest:
    """The request of a ``POST /v1/chat/completions`` body; ``ApiError`` with what is wrong otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object with `messages`")
    model = body.get("model")
    if model is not None and model != served_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if body.get("stream"):
        raise ApiError(400, "`stream` is not supported by this server: send stream=false", param="stream")
    if number(body, "n", 1, int) != 1:
        raise ApiError(400, f"only n=1 is supported, got n={body['n']}", param="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"`stop` must be a string or a list of strings, got {body.get('stop')!r}", param="stop")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, f"`chat_template_kwargs` must be an object, got {kwargs!r}", param="chat_template_kwargs")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    top_p = number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"`top_p` must be in (0, 1], got {top_p}", param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"`seed` must be an integer, got {seed!r}", param="seed")
    return ChatRequest(
        messages=messages_of(body),
        max_tokens=number({"max_tokens": max_tokens}, "max_tokens", max_tokens_default, int, 1),
        temperature=number(body, "temperature", 1.0, float, 0.0),
        top_p=top_p, seed=seed, stop=list(stop), chat_template_kwargs=dict(kwargs))


def completion(served_name: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """An OpenAI ``chat.completion`` with one choice."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def model_list(served_name: str) -> dict:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "cascade-rl"}]}

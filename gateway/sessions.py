"""The gateway's rules for one agent trajectory (a session): a chat request in, token ids out, token-exact. No
sockets, no HTTP: gateway/server.py calls these; tests drive them with a tokenizer alone.

    rules = SessionRules(TurnRenderer(PromptRenderer(tokenizer, thinking=True)))
    session = Session(agent_key)
    prompt_ids, segment = rules.prompt(session, messages, tools)      # what GatewayGenerate carries
    message, finish_reason = rules.record(session, prompt_ids, segment, rollout)   # the OpenAI reply

Why the care: the trainer learns from the tokens the model sampled, so a trajectory's next prompt must continue
its earlier tokens exactly (docs/ARCHITECTURE.md §12, "token-in, token-out").

- **Returned messages are replaced by what was sampled.** A client sends the assistant messages the gateway
  returned back as OpenAI JSON (``tool_calls`` with their arguments as a JSON string), which the chat template
  would render differently from the text the model sampled. Each one the gateway returned (matched by the
  tool-call ids it minted, or, for a reply without tool calls, by its content) is rendered as
  ``{"role": "assistant", "content": <the sampled text>}``: the decoded response without its end-of-turn token,
  after the generation prompt's ``<think>`` (``TurnRenderer.assistant_text``), so the history renders as sampled.
- **Continue, or open a segment.** The conversation is rendered with the model's template (tools included). If the
  rendering starts with the text the session's ids decode to, the prompt is those ids and the rest tokenised
  (``TurnRenderer.observation_ids``); otherwise the agent rewrote its history (edited or dropped a message) and a
  new segment starts: the whole rendering tokenised, ``segment`` + 1. The first call is segment 0.
- **The reply.** The sampled text's ``<tool_call>`` blocks (environments/tool_calls.py, Hermes/Qwen3) become
  OpenAI ``tool_calls`` (ids ``call_<call>_<k>``); the content is the text without them, stripped (None when empty
  and there are calls); finish_reason ``tool_calls`` | ``length`` | ``stop``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from cascade_rl.data.render import TurnRenderer
from cascade_rl.environments.tool_calls import CLOSE, OPEN, CallError, ToolCall, parse_tool_calls
from cascade_rl.protocol.messages import Rollout, WorkKey

_BLOCK = re.compile(re.escape(OPEN) + r".*?(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)  # a block, or one left open


@dataclass
class Session:
    """One agent trajectory as the gateway knows it (``key``: its agent key, protocol/agents.py ``session_of``)."""

    key: WorkKey
    segment: int = 0  # the current segment (a rewritten history opens the next)
    ids: list[int] = field(default_factory=list)  # the segment's tokens so far: the last prompt and its response
    calls: int = 0  # model calls answered: the next one's key is WorkKey.step(..., "gen", calls, ...)
    returned: dict[str, str] = field(default_factory=dict)  # "tool:<call id>" | "text:<content>" -> sampled text
    busy: bool = False  # a call is in flight (a second one is refused with 409)
    warned: bool = False  # the override of the client's sampling was logged once
    last_used: float = field(default_factory=time.monotonic)

    def model_call(self) -> WorkKey:
        """The key of the session's next model call."""
        return WorkKey.step(self.key.group, self.key.index, "gen", self.calls, self.key.attempt)


def _text(content: Any) -> str:
    """A message's content as text: a string, OpenAI's list of text parts joined, or "" (None)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


class SessionRules:
    """The rules of the module docstring over one renderer (the model's chat template and tokenizer)."""

    def __init__(self, turns: TurnRenderer) -> None:
        self.turns, self.render, self.tokenizer = turns, turns.render, turns.tokenizer

    # ------------------------------------------------------------------ request -> prompt

    def sampled_history(self, session: Session, messages: list[dict]) -> list[dict]:
        """The messages to render: each assistant message the gateway returned, as the model sampled it; every
        other message with its content as text (tool calls, tool_call_id and name kept for the template)."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and (sampled := self._sampled(session, m)) is not None:
                out.append({"role": "assistant", "content": sampled})
                continue
            msg = {"role": m["role"], "content": _text(m.get("content"))}
            msg.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None})
            out.append(msg)
        return out

    def _sampled(self, session: Session, message: dict) -> str | None:
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and (text := session.returned.get(f"tool:{call.get('id')}")) is not None:
                return text
        if message.get("tool_calls"):
            return None
        return session.returned.get(f"text:{_text(message.get('content'))}")

    def prompt(self, session: Session, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], int]:
        """The prompt ids of this request and its segment (the session's, or the next: see the module docstring).
        The template's own errors (a role it refuses) propagate; the session is not changed."""
        history = self.sampled_history(session, messages)
        if session.ids:
            try:
                return session.ids + self.turns.observation_ids(session.ids, history, tools), session.segment
            except ValueError:  # the rendering does not extend the segment's tokens: the history was rewritten
                return self.render.ids(history, tools), session.segment + 1
        return self.render.ids(history, tools), session.segment

    # ------------------------------------------------------------------ rollout -> reply

    def record(self, session: Session, prompt_ids: list[int], segment: int, rollout: Rollout) -> tuple[dict, str]:
        """Take a sampled turn into the session (its tokens, the call count, what was returned) and build the reply:
        (the OpenAI assistant message, its finish_reason)."""
        response = [int(t) for t in rollout.response_ids]
        session.ids, session.segment = list(prompt_ids) + response, segment
        session.calls += 1
        text = self.turns.assistant_text(response)
        message, reason = reply_message(text, session.calls, rollout.finish_reason)
        for call in message.get("tool_calls") or ():
            session.returned[f"tool:{call['id']}"] = text
        if not message.get("tool_calls"):
            session.returned[f"text:{message['content'] or ''}"] = text
        return message, reason


def reply_message(text: str, call: int, finish_reason: str) -> tuple[dict, str]:
    """The OpenAI assistant message of sampled ``text`` (model call number ``call``, from 1) and its finish_reason:
    tool calls parsed (an unreadable block is left in the content: no call is made of it)."""
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    unreadable = any(isinstance(c, CallError) for c in parsed)
    content = (text if unreadable and not calls else _BLOCK.sub("", text)).strip()
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [{"id": f"call_{call}_{k}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for k, c in enumerate(calls)]
    reason = "tool_calls" if calls else "length" if finish_reason == "length" else "stop"
    return message, reason

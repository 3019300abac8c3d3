"""The tool calls of one assistant turn, parsed from its text: a pure function, no tool is run here.

    from cascade_rl.environments.tool_calls import parse_tool_calls
    parse_tool_calls('<think>...</think>\\n<tool_call>\\n{"name": "python", "arguments": {"code": "1+1"}}\\n'
                     '</tool_call>')
    # -> [ToolCall(name="python", arguments={"code": "1+1"})]

The format is Hermes/Qwen3's (what Qwen3's chat template renders and its models emit): each call is a
``<tool_call>...</tool_call>`` block holding a JSON object ``{"name": ..., "arguments": {...}}``. Also read:

- raw newlines and tabs inside JSON strings (models write multi-line code that way);
- the arguments as a JSON string of an object (OpenAI style), or under ``"parameters"``; none at all is ``{}``;
- a JSON list of such objects in one block (several calls);
- the XML form of Qwen3-Coder/Nemotron templates, ``<function=NAME><parameter=KEY>VALUE</parameter></function>``,
  whose values are text (one surrounding newline dropped).

Only the answer is read: the text after the last ``</think>``, so a call the model merely thought about is not
run. A ``<think>`` never closed (the turn was cut off while thinking) makes no call. Prose between blocks is
ignored. A block that cannot be read becomes a ``CallError`` in its place, with the reason, so that the model
gets an error observation for that call and the calls around it still run; a block left open at the end (a
turn cut off at max_tokens) is one ``CallError``. No block at all is ``[]``: the turn calls no tool and the
episode ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cascade_rl.verifiers.text import final_answer_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_SHOWN_CHARS = 80  # how much of an unreadable block a CallError quotes


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A ``<tool_call>`` block that could not be read, and why (shown to the model)."""

    reason: str


class _Unreadable(ValueError):
    pass


def _loads(text: str) -> Any:
    """JSON, with raw control characters (newlines, tabs) allowed inside strings: models write code that way."""
    return json.loads(text, strict=False)


def _call_from_json(obj: Any) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"type": "function", "function": {...}}
    if not isinstance(obj, dict):
        raise _Unreadable(f"a tool call is a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _Unreadable('a tool call needs a "name" (a string)')
    if "arguments" in obj and "parameters" in obj:
        raise _Unreadable('a tool call has both "arguments" and "parameters"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError as e:
            raise _Unreadable(f'"arguments" is a string that is not JSON: {e}') from None
    if not isinstance(args, dict):
        raise _Unreadable(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(obj["name"], args)


def _calls_from_block(body: str) -> list[ToolCall | CallError]:
    xml = _XML_FUNCTION.fullmatch(body)
    if xml:
        args: dict[str, Any] = {}
        for key, value in _XML_PARAMETER.findall(xml.group(2)):
            args[key.strip()] = value.removeprefix("\n").removesuffix("\n")
        return [ToolCall(xml.group(1).strip(), args)]
    try:
        value = _loads(body)
    except (ValueError, RecursionError) as e:
        shown = body.strip()[:_SHOWN_CHARS]
        return [CallError(f"the <tool_call> block is not valid JSON ({e}): {shown!r}")]
    calls: list[ToolCall | CallError] = []
    for obj in value if isinstance(value, list) and value else [value]:
        try:
            calls.append(_call_from_json(obj))
        except _Unreadable as e:
            calls.append(CallError(str(e)))
    return calls


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
    """The calls of one assistant turn's text, in order (rules in the module docstring); never raises."""
    answer = final_answer_text(text if isinstance(text, str) else "")
    if answer is None:
        return []
    calls: list[ToolCall | CallError] = []
    pos = answer.find(OPEN)
    while pos >= 0:
        start = pos + len(OPEN)
        end = answer.find(CLOSE, start)
        if end < 0:
            calls.append(CallError("a <tool_call> block is not closed with </tool_call> (was the turn cut off?)"))
            break
        calls.extend(_calls_from_block(answer[start:end]))
        pos = answer.find(OPEN, end + len(CLOSE))
    return calls

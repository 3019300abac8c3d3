"""Tool-calling reward: 1.0 iff the response makes exactly the expected call(s), name and arguments.

Only the answer is read: the text after the last ``</think>``; an unclosed ``<think>``
scores 0. The calls are parsed from, in this order:

1. ``<tool_call>...</tool_call>`` blocks (Qwen3/Hermes), each holding a JSON call
   ``{"name": ..., "arguments": {...}}`` (or a JSON list of them), or the XML form of
   Qwen3-Coder/Nemotron templates: ``<function=NAME><parameter=KEY>VALUE</parameter></function>``.
   Prose between blocks is ignored; a block left open (truncated) or holding anything
   else makes the response wrong.
2. else a plain JSON call or list of calls in the text, found as structured_output finds
   JSON (fenced block, else the longest object/array).

A JSON call may nest under ``"function"`` (OpenAI style), may give its arguments as a
JSON string, and may name them ``"parameters"``; other keys ("id", "type") are ignored.

Matching is strict: the same number of calls in the same order (parallel calls are
compared as a list), each with exactly the expected name and exactly the expected
argument keys — an extra argument or a missing one fails, optional or not. Values are
compared as parsed JSON: ``1 == 1.0``, but ``true != 1``, ``"1" != 1``; strings exactly;
lists in order; objects by keys. XML parameter values are text, so they are typed by the
reference: compared as text where a string is expected (one surrounding newline
dropped), else parsed as JSON first.

``reference`` is the JSON of the expected call or list of calls (same JSON forms);
a malformed reference raises ValueError. No metadata is read. ``check_tool_calls``
gives the reason for a mismatch.

    from cascade_rl.verifiers.tool_call import score_tool_call
    score_tool_call('<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>',
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}', {})  # -> 1.0

Run the checks with ``pytest tests/test_tool_call.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .structured_output import JSONExtractionError, extract_json, final_answer_text, loads_strict

_BLOCK_OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class ToolCallParseError(ValueError):
    """The text's tool call is malformed."""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw_text_values: bool = False  # from the XML form: values are text, typed by the reference


def _call_from_json(obj: Any) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"type": "function", "function": {...}}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallParseError(f"a tool call is an object with a string 'name', got {obj!r:.200}")
    if "arguments" in obj and "parameters" in obj:
        raise ToolCallParseError("a tool call has both 'arguments' and 'parameters'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_strict(args)
        except ValueError as e:
            raise ToolCallParseError(f"arguments string is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolCallParseError(f"arguments must be an object, got {type(args).__name__}")
    return ToolCall(obj["name"], args)


def _calls_from_json(value: Any) -> list[ToolCall]:
    return [_call_from_json(v) for v in value] if isinstance(value, list) else [_call_from_json(value)]


def _calls_from_block(body: str) -> list[ToolCall]:
    xml = _XML_FUNCTION.fullmatch(body)
    if xml:
        if "<function=" in xml.group(2):
            raise ToolCallParseError("one <tool_call> block holds several <function=...>")
        args: dict[str, Any] = {}
        for key, value in _XML_PARAMETER.findall(xml.group(2)):
            key = key.strip()
            if key in args:
                raise ToolCallParseError(f"parameter {key!r} given twice")
            args[key] = value
        return [ToolCall(xml.group(1).strip(), args, raw_text_values=True)]
    try:
        return _calls_from_json(loads_strict(body))
    except ValueError as e:
        raise ToolCallParseError(f"<tool_call> block is neither JSON nor <function=...>: {e}") from None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls an answer text makes, in order (rules in the module docstring); raises ToolCallParseError."""
    if _BLOCK_OPEN in text:
        bodies = _BLOCK.findall(text)
        if text.count(_BLOCK_OPEN) != len(bodies):
            raise ToolCallParseError("a <tool_call> block is not closed")
        return [call for body in bodies for call in _calls_from_block(body)]
    try:
        return _calls_from_json(extract_json(text))
    except JSONExtractionError as e:
        raise ToolCallParseError(f"no tool call: {e}") from None


def parse_reference(reference: str) -> list[ToolCall]:
    try:
        calls = _calls_from_json(loads_strict(reference))
    except ValueError as e:  # ToolCallParseError is one too
        raise ValueError(f"tool_call reference is not a JSON call or list of calls: {e}") from None
    if not calls:
        raise ValueError("tool_call reference is an empty list")
    return calls


def values_equal(expected: Any, got: Any) -> bool:
    """JSON equality with types: numbers by value (1 == 1.0), booleans only to booleans."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is type(got) and expected == got
    if isinstance(expected, int | float):
        return isinstance(got, int | float) and expected == got
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(values_equal, expected, got))
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(values_equal(v, got[k]) for k, v in expected.items())
        )
    return type(expected) is type(got) and expected == got  # str, None


def _text_value_equal(expected: Any, text: str) -> bool:
    value = text.removeprefix("\n").removesuffix("\n")
    if isinstance(expected, str):
        return value == expected
    try:
        return values_equal(expected, loads_strict(value))
    except ValueError:
        return False


def _call_mismatch(expected: ToolCall, got: ToolCall) -> str:
    """Why ``got`` is not ``expected``; empty if it is."""
    if got.name != expected.name:
        return f"called {got.name!r}, expected {expected.name!r}"
    missing = expected.arguments.keys() - got.arguments.keys()
    extra = got.arguments.keys() - expected.arguments.keys()
    if missing or extra:
        return f"{got.name}: missing arguments {sorted(missing)}, unexpected {sorted(extra)}"
    equal = _text_value_equal if got.raw_text_values else values_equal
    wrong = [k for k, v in expected.arguments.items() if not equal(v, got.arguments[k])]
    return f"{got.name}: wrong values for {sorted(wrong)}" if wrong else ""


@dataclass
class ToolCallCheck:
    match: bool
    reason: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # what the answer called, when it parsed


def check_tool_calls(text: str, expected: list[ToolCall]) -> ToolCallCheck:
    try:
        calls = parse_tool_calls(text)
    except ToolCallParseError as e:
        return ToolCallCheck(False, str(e))
    if len(calls) != len(expected):
        return ToolCallCheck(False, f"{len(calls)} calls, expected {len(expected)}", calls)
    for i, (want, got) in enumerate(zip(expected, calls)):
        try:
            reason = _call_mismatch(want, got)
        except RecursionError:
            reason = "arguments nested too deeply to compare"
        if reason:
            return ToolCallCheck(False, f"call {i}: {reason}", calls)
    return ToolCallCheck(True, "", calls)


def score_tool_call(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 if the answer makes exactly the reference call(s), else 0.0. Raises ValueError on a bad reference."""
    expected = parse_reference(reference)
    text = final_answer_text(response)
    if text is None:
        return 0.0
    return 1.0 if check_tool_calls(text, expected).match else 0.0

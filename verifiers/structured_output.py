"""Structured-output reward: 1.0 iff the response's JSON validates against the task's JSON Schema.

Only the answer is read: the text after the last ``</think>``; an unclosed ``<think>``
scores 0. The JSON is taken from, in this order:

1. the last fenced block labelled json (```` ```json ... ``` ````); a model that shows
   a draft and then the answer is judged on the answer;
2. else the last fenced block of any label whose content is a JSON object or array;
3. else the longest JSON object or array in the text (the last of equally long ones).
   Values are decoded left to right from each ``{`` or ``[`` and never from inside a
   value already decoded, so the candidates are outermost values, and prose before and
   after is allowed ("Here is the JSON: {...} Let me know"). Longest, not first or last,
   so that a citation "[1]" in the prose is not taken for the answer. The scan tries at
   most ``MAX_DECODE_ATTEMPTS`` brackets and stops at nesting deeper than Python's stack.

A bare scalar counts only in a fenced json block.

Strict JSON: ``NaN``/``Infinity`` (which Python's json accepts) are invalid, and a
fenced block that does not parse is invalid (no fallback to other text).

The schema is ``metadata["schema"]`` (a dict or a JSON string); without it, ``reference``
holds the schema as a JSON string. The draft is the schema's ``$schema`` (default
2020-12, via ``jsonschema.validators.validator_for``). An invalid schema raises
``jsonschema.SchemaError`` (a data bug: the worker reports the rollout as not scored).
``format`` is asserted for ``CHECKED_FORMATS`` (checks in the standard library, so
the reward does not depend on which optional packages are installed); other formats
(uri, hostname, time, ...) are annotations only, as the JSON Schema spec's default.

``check_structured_output`` returns the verdict with the reason for a failure
(no JSON found, invalid JSON, or the first schema violation with its path).

    from cascade_rl.verifiers.structured_output import score_structured_output
    score_structured_output('```json\\n{"a": 1}\\n```', "", {"schema": {"type": "object"}})  # -> 1.0

Run the checks with ``pytest tests/test_structured_output.py``.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from .text import final_answer_text

CHECKED_FORMATS = ("date", "date-time", "email", "ipv4", "ipv6", "uuid", "regex")
# Brackets tried as the start of the answer's JSON: bounds the scan (each try may read to the end of the text).
MAX_DECODE_ATTEMPTS = 1000

_OPEN = re.compile(r"[{\[]")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})")




class JSONExtractionError(ValueError):
    """The text holds no JSON value, or its fenced JSON block does not parse."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


class _TooDeep(ValueError):
    """JSON nested deeper than the interpreter's stack ("[[[[..."): not an answer."""


def _raw_decode(text: str, start: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, start)
    except RecursionError:
        raise _TooDeep("JSON nested too deeply") from None


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (and raises ValueError for any bad input)."""
    text = text.strip()
    value, end = _raw_decode(text, 0)
    if end != len(text):
        raise ValueError(f"extra data after the JSON value at char {end}")
    return value


def extract_json(text: str) -> Any:
    """The JSON value the text answers with (rules in the module docstring); raises JSONExtractionError."""
    fences = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    labelled = [body for lang, body in fences if lang == "json"]
    if labelled:
        try:
            return loads_strict(labelled[-1])
        except ValueError as e:
            raise JSONExtractionError(f"the ```json block is not valid JSON: {e}") from None
    for _, body in reversed(fences):
        try:
            value = loads_strict(body)
        except ValueError:
            continue
        if isinstance(value, dict | list):
            return value
    found = None  # (length, value) of the longest top-level JSON value so far
    i = 0
    for _ in range(MAX_DECODE_ATTEMPTS):
        if (m := _OPEN.search(text, i)) is None:
            break
        try:
            value, end = _raw_decode(text, m.start())
        except _TooDeep:
            break  # each later bracket of the same nest would recurse as deep again
        except ValueError:
            i = m.start() + 1
            continue
        if found is None or end - m.start() >= found[0]:
            found = (end - m.start(), value)
        i = end  # never look inside a value already decoded
    if found is None:
        raise JSONExtractionError("no JSON object or array in the response")
    return found[1]


def _is_date_time(instance: object) -> bool:
    if not isinstance(instance, str):
        return True  # format applies to strings only
    if not _RFC3339.fullmatch(instance):
        return False
    try:
        datetime.datetime.fromisoformat(instance.upper().replace("Z", "+00:00").replace(" ", "T"))
    except ValueError:
        return False  # e.g. month 13 or 25:00
    return True


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker([f for f in CHECKED_FORMATS if f != "date-time"])
    checker.checks("date-time")(_is_date_time)
    return checker


_FORMAT_CHECKER = _format_checker()


def load_schema(reference: str, metadata: dict[str, Any]) -> dict[str, Any] | bool:
    schema = metadata["schema"] if "schema" in metadata else reference
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_output needs metadata['schema'] or a JSON Schema as reference: {e}") from None
    if not isinstance(schema, dict | bool):
        raise jsonschema.SchemaError(f"a JSON Schema is an object or a boolean, got {type(schema).__name__}")
    return schema


def valid_schema(reference: str, metadata: dict[str, Any]) -> dict[str, Any] | bool:
    """``load_schema``, then the schema checked against its draft's meta-schema: raises ValueError (no schema,
    not JSON) or ``jsonschema.SchemaError`` with a one-line reason. The verifier and the row check of domain
    structured_output (verifiers/registry.py) both call this."""
    try:
        schema = load_schema(reference, metadata)
        validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        source = "metadata.schema" if "schema" in metadata else "the reference (no metadata.schema)"
        where = "/".join(str(p) for p in e.absolute_path)
        raise jsonschema.SchemaError(f"{source} is not a valid JSON Schema: "
                                     f"{f'at {where}: ' if where else ''}{e.message}") from None
    return schema


@dataclass
class SchemaCheck:
    """Whether the answer is valid, and why not."""

    valid: bool
    reason: str = ""
    instance: Any = None  # the extracted JSON value, when one was found


def check_structured_output(text: str, schema: dict[str, Any] | bool, *, schema_checked: bool = False) -> SchemaCheck:
    """Extract the JSON from an answer text and validate it. Raises SchemaError for an invalid schema (unless
    ``schema_checked``: it came from ``valid_schema``)."""
    cls = validator_for(schema)
    if not schema_checked:
        cls.check_schema(schema)
    try:
        instance = extract_json(text)
    except JSONExtractionError as e:
        return SchemaCheck(False, str(e))
    try:
        error = best_match(cls(schema, format_checker=_FORMAT_CHECKER).iter_errors(instance))
    except RecursionError:
        return SchemaCheck(False, "JSON nested too deeply to validate", instance)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return SchemaCheck(False, f"at {where}: {error.message}", instance)
    return SchemaCheck(True, "", instance)


def score_structured_output(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 if the answer's JSON is valid under the schema, else 0.0. Raises on a missing or invalid schema."""
    schema = valid_schema(reference, metadata)  # a bad schema is reported even for unfinished responses
    text = final_answer_text(response)
    if text is None:
        return 0.0
    return 1.0 if check_structured_output(text, schema, schema_checked=True).valid else 0.0

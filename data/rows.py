"""The row schema, and the rules that turn one raw record into a ``Row`` or say why not (no IO).

    row = parse_row({"prompt": "What is 2+2?", "domain": "math", "answer": "4"}, Fields())
    parse_row({"prompt": ""}, Fields())   # raises BadRow("empty prompt", ...)

A row (one line of JSONL, one row of Parquet or of an HF dataset):

| field | type | meaning |
| --- | --- | --- |
| ``prompt`` | string, or a list of ``{role, content}`` | one user message, or a conversation (system / user / earlier assistant turns) ending in a user or tool turn |
| ``domain`` | string | the registered verifier that scores it (``data.default_domain`` fills it when absent) |
| ``answer`` | string (numbers and JSON values become text) | the reference handed to the verifier; may be empty (judge domains) |
| ``metadata`` | object (or a JSON string of one) | handed to the verifier: MCQA options, a JSON Schema, IFEval ids and kwargs, code tests, ... |
| ``id`` | string or integer, optional | stable id; derived from the content when absent |
| ``response`` | string | SFT only: the assistant turn to learn (RL ignores it) |

Every name can be remapped (``data.fields.prompt=question``), to a dotted path too
(``data.fields.answer=reward_model.ground_truth``, ``conversations.0.content``),
and a domain field's values mapped to domains (``data.domain_map``). A ``BadRow``
carries a short ``kind`` (counted per run: ``summary.json`` ``data.bad_rows``)
and the ``detail`` a user reads next to ``FILE:LINE``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import xxhash

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class Fields:
    """Where each field of the schema lives in the user's rows (``data.fields``: verl's ``prompt_key``)."""

    prompt: str = "prompt"
    """A string (one user message) or a list of {role, content} chat messages."""
    domain: str = "domain"
    """The registered verifier domain that scores the row."""
    answer: str = "answer"
    """The reference handed to the verifier (may be empty)."""
    metadata: str = "metadata"
    """An object (or a JSON string of one) handed to the verifier."""
    id: str = "id"
    """Optional stable id (derived from the content when absent)."""
    response: str = "response"
    """SFT only: the assistant turn to learn."""
    env: str = "env"
    """Optional: the registered environment whose tools the model may call mid-rollout (multi-turn; absent or
    empty: the domain's default of ``environment.defaults``, else single-turn)."""


class BadRow(ValueError):
    """A row that cannot be trained on: ``kind`` names the rule it broke, ``detail`` says what to change."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(detail or kind)
        self.kind, self.detail = kind, detail or kind


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
    """One prompt of a prompt set, as the orchestrator and the verifiers see it."""

    id: str
    messages: tuple[dict[str, str], ...]
    """The conversation up to the model's turn: ``({"role": "user", "content": ...}, ...)``."""
    domain: str
    answer: str
    metadata: dict[str, Any]
    env: str = ""
    """The environment of a multi-turn row ("" : the domain's default, or single-turn)."""

    @property
    def question(self) -> str:
        """The last user message: what judges and ``metadata["question"]`` get."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")

    def key(self) -> str:
        """The prompt's identity for question-disjoint splits: the same conversation, the same key."""
        return prompt_key(self.messages)


def prompt_key(messages: tuple[dict[str, str], ...] | list[dict[str, str]]) -> str:
    return xxhash.xxh64_hexdigest(json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False).encode())


def heldout_by_hash(key: str, fraction: float) -> bool:
    """Deterministic, question-disjoint held-out split: the prompt's hash read as a number in [0, 1)."""
    return fraction > 0 and int(key, 16) / 2.0**64 < fraction


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


MISSING = object()  # what ``lookup`` finds where nothing is (None is a value: a columnar file's null)


def lookup(raw: dict, path: str) -> Any:
    """The value at ``path`` in a record, or ``MISSING``: the exact key first (a key may hold a dot), then a
    dotted path through objects and lists (a number picks a list's item: ``conversations.0.content``)."""
    if path in raw:
        return raw[path]
    return _walk(raw, path.split(".")) if "." in path else MISSING


def _walk(value: Any, parts: list[str]) -> Any:
    if not parts:
        return value
    if isinstance(value, list):
        head = parts[0]
        return _walk(value[int(head)], parts[1:]) if head.isdigit() and int(head) < len(value) else MISSING
    if not isinstance(value, dict):
        return MISSING
    for n in range(len(parts), 0, -1):  # the longest key first: a nested key may hold a dot too
        key = ".".join(parts[:n])
        if key in value and (found := _walk(value[key], parts[n:])) is not MISSING:
            return found
    return MISSING


def _field(raw: dict, fields: Fields, name: str) -> tuple[str, Any]:
    """(the user's field name, its value or None); the name says where to look if it is wrong. A dotted path
    that leads nowhere is a bad row naming it (the user said the field is there), unlike an absent plain key of
    an optional field."""
    key = getattr(fields, name)
    value = lookup(raw, key)
    if value is MISSING:
        if "." in key and name not in ("prompt", "domain"):  # those two say "missing" themselves
            raise BadRow("missing field", f"missing field {_where(fields, name)}")
        return key, None
    return key, value


def _where(fields: Fields, name: str) -> str:
    key = getattr(fields, name)
    return f"'{key}'" if key == name else f"'{key}' (data.fields.{name})"


def message(m: Any, where: str, roles: tuple[str, ...], why: str = "") -> dict[str, str]:
    """One {role, content} chat message, checked: an object with string role and content, the role one of
    ``roles`` (``why`` says why those); raises BadRow naming ``where``."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise BadRow("bad message", f"{where}: must be an object with string 'role' and 'content', got "
                                    f"{json.dumps(m, ensure_ascii=False)[:80]}")
    if m["role"] not in roles:
        raise BadRow("bad message", f"{where}: role {m['role']!r} is not one of {', '.join(roles)}{why}")
    return {"role": m["role"], "content": m["content"]}


def parse_messages(prompt: Any, where: str) -> tuple[dict[str, str], ...]:
    """A prompt as a conversation: a string is one user message; a list must hold {role, content} objects."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty prompt", f"field {where} is empty")
        return ({"role": "user", "content": prompt},)
    if not isinstance(prompt, list):
        raise BadRow("ill-typed field", f"field {where} must be a string or a list of {{role, content}} messages, "
                                        f"got {_type(prompt)}")
    if not prompt:
        raise BadRow("empty prompt", f"field {where} is an empty list of messages")
    out = [message(m, f"field {where}, message {i}", ROLES) for i, m in enumerate(prompt)]
    if out[-1]["role"] == "assistant":
        raise BadRow("bad message", f"field {where}: the last message is the assistant's; a prompt ends with the turn "
                                    f"the model answers (user or tool)")
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise BadRow("empty prompt", f"field {where} has no user message with content")
    return tuple(out)


def _text(value: Any, where: str) -> str:
    """A reference as text: numbers as written, JSON values (a tool call, a schema) as JSON text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise BadRow("ill-typed field", f"field {where} must be a string, got a boolean")
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    raise BadRow("ill-typed field", f"field {where} must be a string, got {_type(value)}")


def _metadata(value: Any, where: str, drop_nulls: bool) -> dict[str, Any]:
    """An object, or a JSON string of one (Parquet files often store it so). Columnar formats fill the keys
    other rows have with null (``drop_nulls``): those are dropped, not handed to the verifier."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise BadRow("ill-typed field", f"field {where} is a string but not JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadRow("ill-typed field", f"field {where} must be an object, got {_type(value)}")
    return {k: v for k, v in value.items() if v is not None} if drop_nulls else value


def row_id(messages: tuple[dict[str, str], ...], domain: str, answer: str) -> str:
    """A stable id derived from the content (the same row gets the same id in every run)."""
    return xxhash.xxh64_hexdigest(json.dumps([prompt_key(messages), domain, answer], ensure_ascii=False).encode())


def parse_row(raw: Any, fields: Fields = Fields(), default_domain: str = "", drop_nulls: bool = False,
              domain_map: dict[str, str] | None = None) -> Row:
    """One raw record as a ``Row``; raises ``BadRow`` for the first rule it breaks. ``domain_map``: the domain
    of each value of the domain field (``data.domain_map``; a value not in it takes ``default_domain``).

    Which domains exist and whether the verifier accepts the metadata are checked by the caller
    (``data.prepare``): they depend on the registry, not on the row alone."""
    if not isinstance(raw, dict):
        raise BadRow("not an object", f"a row must be a JSON object, got {_type(raw)}")
    prompt = lookup(raw, fields.prompt)
    if prompt is MISSING:
        raise BadRow("missing field", f"missing field {_where(fields, 'prompt')}")
    messages = parse_messages(prompt, _where(fields, "prompt"))
    _, domain = _field(raw, fields, "domain")
    if domain is not None and not isinstance(domain, str):
        raise BadRow("ill-typed field", f"field {_where(fields, 'domain')} must be a string, got {_type(domain)}")
    if domain_map and domain is not None:
        if domain not in domain_map and not default_domain:
            raise BadRow("unmapped domain", f"field {_where(fields, 'domain')} is {domain!r}, which data.domain_map "
                                            f"does not map: add it (data.domain_map={{{domain}: DOMAIN, ...}}) or "
                                            f"set data.default_domain")
        domain = domain_map.get(domain, default_domain)
    domain = default_domain if domain is None else domain
    if not domain:
        raise BadRow("missing field", f"missing field {_where(fields, 'domain')} (or set data.default_domain)")
    answer = _text(_field(raw, fields, "answer")[1], _where(fields, "answer"))
    metadata = _metadata(_field(raw, fields, "metadata")[1], _where(fields, "metadata"), drop_nulls)
    _, rid = _field(raw, fields, "id")
    if rid is None or rid == "":
        rid = row_id(messages, domain, answer)
    elif isinstance(rid, bool) or not isinstance(rid, str | int):
        raise BadRow("ill-typed field", f"field {_where(fields, 'id')} must be a string or an integer, got {_type(rid)}")
    _, env = _field(raw, fields, "env")
    if env is not None and not isinstance(env, str):
        raise BadRow("ill-typed field", f"field {_where(fields, 'env')} must be an environment's name, got {_type(env)}")
    return Row(str(rid), messages, domain, answer, metadata, env or "")


def parse_response(raw: dict, fields: Fields = Fields()) -> str:
    """SFT: the assistant turn a row teaches."""
    response = lookup(raw, fields.response)
    if not isinstance(response, str) or not response.strip():
        absent = response is MISSING
        got = "missing" if absent else f"{_type(response)}" if not isinstance(response, str) else "empty"
        raise BadRow("missing field" if absent else "ill-typed field",
                     f"SFT needs field {_where(fields, 'response')} (the assistant turn to learn): {got}")
    return response

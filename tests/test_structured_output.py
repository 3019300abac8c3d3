"""The JSON Schema reward in verifiers/structured_output.py: extraction, validation, reasons."""

import json

import jsonschema
import pytest

from cascade_rl.verifiers.structured_output import (
    JSONExtractionError,
    check_structured_output,
    extract_json,
    score_structured_output,
)

ORDER_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
        },
        "placed_on": {"type": "string", "format": "date"},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}

GOOD_ORDER = {
    "order_id": "ORD-0042",
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org"},
    "items": [{"sku": "HMK-2", "qty": 1}, {"sku": "STRAP", "qty": 2}],
    "placed_on": "2024-02-29",
}


def order(**changes) -> dict:
    value = json.loads(json.dumps(GOOD_ORDER))
    value.update(changes)
    return value


def fenced(value) -> str:
    return f"Here is the order:\n\n```json\n{json.dumps(value, indent=2)}\n```\n"


def score(text: str, schema=ORDER_SCHEMA) -> float:
    return score_structured_output(text, "", {"schema": schema})


# --- valid and invalid instances -------------------------------------------------------------


def test_valid_order_scores_one():
    assert score(fenced(GOOD_ORDER)) == 1.0
    assert score(json.dumps(GOOD_ORDER)) == 1.0  # bare JSON
    assert score(f"Sure! {json.dumps(GOOD_ORDER)}\nLet me know if you need changes.") == 1.0  # prose around it


@pytest.mark.parametrize(
    "instance, where",
    [
        ({k: v for k, v in GOOD_ORDER.items() if k != "status"}, "(root)"),  # required field missing
        (order(status="lost"), "status"),  # not in the enum
        (order(order_id="42"), "order_id"),  # pattern
        (order(extra="x"), "(root)"),  # additionalProperties false
        (order(customer={"name": "Ada", "email": "ada@example.org", "vip": True}), "customer"),  # nested extra
        (order(customer={"name": "Ada"}), "customer"),  # nested required
        (order(items=[]), "items"),  # minItems
        (order(items=[{"sku": "HMK-2", "qty": "1"}]), "items/0/qty"),  # wrong type inside an item
        (order(items=[{"sku": "HMK-2", "qty": 1.5}]), "items/0/qty"),  # a float is not an integer
        (order(items=[{"sku": "HMK-2"}]), "items/0"),  # item's required field
        (order(placed_on="2023-02-29"), "placed_on"),  # format: date (not a leap year)
        (order(customer={"name": "Ada", "email": "ada.example.org"}), "customer/email"),  # format: email
    ],
)
def test_schema_violations_score_zero_with_the_path(instance, where):
    check = check_structured_output(fenced(instance), ORDER_SCHEMA)
    assert not check.valid
    assert check.reason.startswith(f"at {where}:"), check.reason
    assert score(fenced(instance)) == 0.0


def test_integer_valued_float_is_an_integer():
    # JSON Schema: 2.0 is an integer (a number with zero fractional part).
    assert score(fenced(order(items=[{"sku": "HMK-2", "qty": 2.0}]))) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"order_id": "ORD-0042", "status": "shipped",}\n```',  # trailing comma
        "```json\n{'order_id': 'ORD-0042'}\n```",  # single quotes
        '{"order_id": "ORD-0042", "status": "shipped"',  # truncated
        "The order has shipped.",  # no JSON at all
        "",
    ],
)
def test_invalid_or_missing_json_scores_zero(text):
    check = check_structured_output(text, ORDER_SCHEMA)
    assert not check.valid and check.reason
    assert score(text) == 0.0


def test_nan_is_not_json():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    assert score('{"x": NaN}', schema) == 0.0
    assert score('{"x": 1e400}', schema) == 1.0  # a big number is JSON (Python reads it as inf)


# --- extraction rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('draft:\n```json\n{"a": 1}\n```\nfinal:\n```json\n{"a": 2}\n```', {"a": 2}),  # the last json block
        ('```\n{"a": 1}\n```', {"a": 1}),  # an unlabelled fence with JSON
        ('```python\nprint(1)\n```\n{"a": 3}', {"a": 3}),  # a code fence that is not JSON is skipped
        ('As noted [1], the result is {"a": {"b": [1, 2]}} and done.', {"a": {"b": [1, 2]}}),  # longest value
        ('[{"a": 1}, {"a": 2}] trailing words', [{"a": 1}, {"a": 2}]),
        ('{"a": "has } and { inside"}', {"a": "has } and { inside"}),
        ('```json\n"just a string"\n```', "just a string"),  # a scalar only in a json block
    ],
)
def test_extract_json(text, expected):
    assert extract_json(text) == expected


def test_broken_json_fence_is_not_rescued_by_prose():
    with pytest.raises(JSONExtractionError):
        extract_json('{"a": 1}\n```json\n{"a": \n```')


# --- where the schema comes from, and bad schemas -----------------------------------------------


def test_schema_from_reference_or_metadata_string():
    text = fenced(GOOD_ORDER)
    assert score_structured_output(text, json.dumps(ORDER_SCHEMA), {}) == 1.0
    assert score_structured_output(text, "", {"schema": json.dumps(ORDER_SCHEMA)}) == 1.0


def test_draft7_schema_is_honoured():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "string"}],
              "additionalItems": False}  # fmt: skip
    assert score('["a"]', schema) == 1.0
    assert score('["a", "b"]', schema) == 0.0


def test_invalid_schema_raises():
    with pytest.raises(jsonschema.SchemaError):
        score('{"a": 1}', {"type": "objekt"})
    with pytest.raises(jsonschema.SchemaError):
        score_structured_output("<think>unfinished", "", {"schema": {"type": 5}})


def test_date_time_format():
    schema = {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}}
    assert score('{"at": "2024-05-01T12:30:00Z"}', schema) == 1.0
    assert score('{"at": "2024-05-01T12:30:00.5+02:00"}', schema) == 1.0
    assert score('{"at": "2024-05-01 12:30"}', schema) == 0.0  # no seconds, no offset
    assert score('{"at": "2024-13-01T12:30:00Z"}', schema) == 0.0


# --- the think block ----------------------------------------------------------------------------


def test_only_answer_after_think_counts():
    bad_draft = json.dumps(order(status="lost"))
    assert score(f"<think>\nDraft: {bad_draft}\n</think>\n\n{fenced(GOOD_ORDER)}") == 1.0
    assert score(f"<think>\n{json.dumps(GOOD_ORDER)}\n</think>\n\nDone.") == 0.0
    assert score(f"<think>\n{json.dumps(GOOD_ORDER)}") == 0.0  # unfinished


# --- hostile text ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[" * 100_000, "[1," * 40_000, '{"a": ' * 5_000 + "1" + "}" * 5_000])
def test_deep_nesting_scores_zero_without_raising(text):
    assert score(text, {"type": ["array", "object"]}) == 0.0


def test_missing_schema_raises():
    with pytest.raises(ValueError, match="needs metadata"):
        score_structured_output('{"a": 1}', "", {})

"""The tool-calling reward in verifiers/tool_call.py: parsing the call formats, strict matching."""

import json

import pytest

from cascade_rl.verifiers.tool_call import (
    ToolCall,
    check_tool_calls,
    parse_reference,
    parse_tool_calls,
    score_tool_call,
    values_equal,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
FLIGHTS = {
    "name": "search_flights",
    "arguments": {"from": "SFO", "to": "NRT", "date": "2025-03-14", "passengers": {"adults": 2, "children": 0},
                  "nonstop": True, "cabins": ["economy", "premium"]},
}  # fmt: skip


def hermes(*calls) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def score(response: str, reference) -> float:
    return score_tool_call(response, json.dumps(reference), {})


# --- formats -----------------------------------------------------------------------------------


def test_hermes_qwen3_call():
    response = "<think>\nThe user wants the forecast.\n</think>\n\n" + hermes(WEATHER)
    assert score(response, WEATHER) == 1.0


def test_xml_call_typed_by_the_reference():
    response = (
        "I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert score(response, WEATHER) == 1.0
    assert score(response.replace("\n3\n", "\n4\n"), WEATHER) == 0.0
    zip_call = {"name": "lookup", "arguments": {"zip": "02139"}}
    assert score("<tool_call><function=lookup><parameter=zip>02139</parameter></function></tool_call>", zip_call) == 1.0


def test_plain_json_and_openai_shapes():
    assert score(json.dumps(WEATHER), WEATHER) == 1.0
    assert score(f"```json\n{json.dumps(WEATHER)}\n```", WEATHER) == 1.0
    openai = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(WEATHER["arguments"])}}
    assert score(json.dumps(openai), WEATHER) == 1.0  # nested under "function", arguments as a JSON string
    llama = {"name": "get_weather", "parameters": WEATHER["arguments"]}
    assert score(json.dumps(llama), WEATHER) == 1.0


def test_prose_between_blocks_is_ignored():
    response = "First the weather:\n" + hermes(WEATHER) + "\nand then flights:\n" + hermes(FLIGHTS)
    assert score(response, [WEATHER, FLIGHTS]) == 1.0


# --- strict matching ------------------------------------------------------------------------


def with_args(call: dict, **changes) -> dict:
    return {"name": call["name"], "arguments": {**call["arguments"], **changes}}


@pytest.mark.parametrize(
    "got, reason",
    [
        ({"name": "get_forecast", "arguments": WEATHER["arguments"]}, "called 'get_forecast'"),
        ({"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, "missing arguments ['unit']"),
        (with_args(WEATHER, country="FR"), "unexpected ['country']"),  # extra optional args fail too
        (with_args(WEATHER, city="paris"), "wrong values for ['city']"),  # strings exactly
        (with_args(WEATHER, days="3"), "wrong values for ['days']"),  # "3" is not 3
        (with_args(WEATHER, days=3.5), "wrong values for ['days']"),
    ],
)
def test_mismatches_score_zero_with_reason(got, reason):
    check = check_tool_calls(hermes(got), parse_reference(json.dumps(WEATHER)))
    assert not check.match and reason in check.reason, check.reason
    assert score(hermes(got), WEATHER) == 0.0


def test_numbers_compare_by_value():
    assert score(hermes(with_args(WEATHER, days=3.0)), WEATHER) == 1.0


@pytest.mark.parametrize(
    "expected, got, equal",
    [
        (1, 1.0, True),
        (True, 1, False),
        (1, True, False),
        (False, False, True),
        (None, None, True),
        (None, "null", False),
        ([1, 2], [2, 1], False),  # lists in order
        ({"a": 1, "b": [1.0]}, {"b": [1], "a": 1.0}, True),  # objects by keys
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ("x", ["x"], False),
    ],
)
def test_values_equal(expected, got, equal):
    assert values_equal(expected, got) is equal


def test_nested_arguments():
    assert score(hermes(FLIGHTS), FLIGHTS) == 1.0
    assert score(hermes(with_args(FLIGHTS, passengers={"adults": 2})), FLIGHTS) == 0.0
    assert score(hermes(with_args(FLIGHTS, cabins=["premium", "economy"])), FLIGHTS) == 0.0
    assert score(hermes(with_args(FLIGHTS, nonstop=1)), FLIGHTS) == 0.0


# --- several calls ------------------------------------------------------------------------------


def test_parallel_calls_compare_in_order():
    expected = [WEATHER, FLIGHTS]
    assert score(hermes(WEATHER, FLIGHTS), expected) == 1.0
    assert score(hermes(FLIGHTS, WEATHER), expected) == 0.0  # order matters
    assert score(hermes(WEATHER), expected) == 0.0  # one call missing
    assert score(hermes(WEATHER, FLIGHTS, WEATHER), expected) == 0.0  # one too many
    assert score(hermes(WEATHER, WEATHER), WEATHER) == 0.0
    assert score(f"<tool_call>\n{json.dumps(expected)}\n</tool_call>", expected) == 1.0  # a list in one block
    assert score(json.dumps(expected), expected) == 1.0  # a plain JSON list


# --- malformed responses score 0, malformed references raise -------------------------------------


@pytest.mark.parametrize(
    "response",
    [
        "<tool_call>\n" + json.dumps(WEATHER),  # never closed (truncated)
        hermes(WEATHER) + '\n<tool_call>\n{"name": "get_weather"',  # the second one truncated
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # neither JSON nor XML
        "<tool_call>\n{'name': 'get_weather'}\n</tool_call>",  # Python dict, not JSON
        "The weather in Paris is probably mild.",  # no call
        '{"city": "Paris"}',  # JSON without a name
        hermes({"name": "get_weather", "arguments": "not json"}),
        "<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
        "<think>\n" + hermes(WEATHER),  # unfinished thinking
        "<tool_call><function=get_weather><parameter=city>Paris</parameter></function>"
        "<function=get_weather><parameter=unit>celsius</parameter></function></tool_call>",  # two in one block
    ],
)
def test_malformed_responses_score_zero(response):
    assert score(response, WEATHER) == 0.0


def test_call_inside_think_does_not_count():
    assert score("<think>\n" + hermes(WEATHER) + "\n</think>\n\nI cannot help.", WEATHER) == 0.0


@pytest.mark.parametrize("reference", ["not json", '{"arguments": {}}', "[]", '{"name": "f", "arguments": [1]}'])
def test_bad_reference_raises(reference):
    with pytest.raises(ValueError):
        score_tool_call(hermes(WEATHER), reference, {})


def test_parse_tool_calls():
    calls = parse_tool_calls(hermes(WEATHER) + "\n" + hermes({"name": "ping"}))
    assert calls == [ToolCall("get_weather", WEATHER["arguments"]), ToolCall("ping", {})]


def test_deeply_nested_arguments_score_zero_without_raising():
    deep = "[" * 5_000 + "]" * 5_000
    assert score(f'{{"name": "f", "arguments": {{"a": {deep}}}}}', {"name": "f", "arguments": {"a": []}}) == 0.0

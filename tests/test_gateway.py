"""The gateway's rules (gateway/sessions.py, gateway/api.py, gateway/calls.py) with the tiny model's tokenizer and
no socket: token-exact continuation across calls, a rewritten history opening a segment, the reply's tool calls, and
the call's outcomes (refused, failed, timed out, in flight)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from cascade_rl.data.render import PromptRenderer, TurnRenderer
from cascade_rl.data.tokenizer import load_tokenizer
from cascade_rl.gateway.api import RunSampling, parse_call, reward_of
from cascade_rl.gateway.calls import OVERRIDDEN_HEADER, Gateway
from cascade_rl.gateway.sessions import Session, SessionRules, reply_message
from cascade_rl.protocol.agents import GatewayGenerate, GatewayRefused, session_key
from cascade_rl.protocol.messages import Rollout, WorkKey
from cascade_rl.samplers.chat_api import ApiError

AGENT = WorkKey("g7", "agent", 3, 0, 1)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]


def call_text(a: int, b: int) -> str:
    return f'let me add</think>\n\n<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def rules(tiny_model) -> SessionRules:
    return SessionRules(TurnRenderer(PromptRenderer(load_tokenizer(tiny_model), thinking=True)))


def sampled(rules: SessionRules, text: str, eos: bool = True) -> list[int]:
    tok = rules.tokenizer
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


def rollout(key: WorkKey, prompt: list[int], response: list[int], finish_reason: str = "stop") -> Rollout:
    return Rollout(key, "agent", np.asarray(prompt, np.int32), np.asarray(response, np.int32),
                   np.zeros(len(response), np.float32), finish_reason=finish_reason)


def turn(rules, session, messages, text, tools=TOOLS, eos=True):
    """One model call: (prompt ids, segment, response ids, the reply message, finish_reason)."""
    prompt, segment = rules.prompt(session, messages, tools)
    response = sampled(rules, text, eos)
    message, reason = rules.record(session, prompt, segment, rollout(session.model_call(), prompt, response,
                                                                     "stop" if eos else "length"))
    return prompt, segment, response, message, reason


def as_openai_sends_it(message: dict) -> dict:
    """An assistant reply as the openai client sends it back: JSON tool calls, content null."""
    return {"role": "assistant", "content": message["content"],
            **({"tool_calls": json.loads(json.dumps(message["tool_calls"]))} if message.get("tool_calls") else {})}


# --------------------------------------------------------------------------- token-exact continuation

def test_three_calls_with_tool_calls_continue_token_exact(rules):
    session = Session(AGENT)
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2 + 3 + 4?"}]
    p0, s0, r0, m0, why0 = turn(rules, session, messages, call_text(2, 3))
    assert (s0, why0, session.calls) == (0, "tool_calls", 1)
    messages += [as_openai_sends_it(m0), {"role": "tool", "tool_call_id": m0["tool_calls"][0]["id"], "content": "5"}]
    p1, s1, r1, m1, _ = turn(rules, session, messages, call_text(5, 4))
    assert s1 == 0 and p1[:len(p0) + len(r0)] == p0 + r0  # the model's tokens reused exactly as sampled
    messages += [as_openai_sends_it(m1), {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "9"}]
    p2, s2, r2, m2, why2 = turn(rules, session, messages, "done</think>\n\nThe sum is 9.")
    assert s2 == 0 and p2[:len(p1) + len(r1)] == p1 + r1
    assert session.ids == p2 + r2 and session.calls == 3
    assert (m2, why2) == ({"role": "assistant", "content": "<think>\ndone</think>\n\nThe sum is 9."}, "stop")
    # the new part is only what the template writes after the model's end of turn: the tool turn, the next prompt
    new = rules.turns.decode(p1[len(p0) + len(r0):])
    assert new.startswith("\n<|im_start|>tool\n5<|im_end|>") and new.endswith("<|im_start|>assistant\n<think>\n")


def test_a_reply_without_tool_calls_is_matched_by_its_content(rules):
    session = Session(AGENT)
    messages = [{"role": "user", "content": "hi"}]
    p0, _, r0, m0, _ = turn(rules, session, messages, "greet</think>\n\n  Hello!  ")
    assert m0["content"] == "<think>\ngreet</think>\n\n  Hello!".strip()
    messages += [{"role": "assistant", "content": m0["content"]}, {"role": "user", "content": "again"}]
    p1, s1, *_ = turn(rules, session, messages, "x")
    assert s1 == 0 and p1[:len(p0) + len(r0)] == p0 + r0  # the stripped content renders as the unstripped sample


def test_a_turn_cut_at_its_limit_continues_too(rules):
    session = Session(AGENT)
    messages = [{"role": "user", "content": "count"}]
    p0, _, r0, m0, why = turn(rules, session, messages, "1 2 3 4", eos=False)
    assert why == "length"
    messages += [as_openai_sends_it(m0), {"role": "user", "content": "go on"}]
    p1, s1, *_ = turn(rules, session, messages, "5")
    assert s1 == 0 and p1[:len(p0) + len(r0)] == p0 + r0


def test_a_rewritten_history_opens_the_next_segment(rules):
    session = Session(AGENT)
    messages = [{"role": "user", "content": "2 + 3?"}]
    _, _, _, m0, _ = turn(rules, session, messages, call_text(2, 3))
    tool = {"role": "tool", "tool_call_id": m0["tool_calls"][0]["id"], "content": "5"}
    edited = [{"role": "user", "content": "2 + 30?"}, as_openai_sends_it(m0), tool]
    p1, s1, r1, m1, _ = turn(rules, session, edited, "ok")
    assert s1 == 1 and p1 == rules.render.ids(rules.sampled_history(session, edited), TOOLS)  # rendered whole
    assert session.segment == 1 and session.ids == p1 + r1
    # then it continues segment 1; dropping a message opens segment 2
    more = edited + [as_openai_sends_it(m1), {"role": "user", "content": "and?"}]
    p2, s2, *_ = turn(rules, session, more, "fine")
    assert s2 == 1 and p2[:len(p1) + len(r1)] == p1 + r1
    _, s3, *_ = turn(rules, session, more[:1] + more[3:], "sure")
    assert s3 == 2


def test_json_tool_calls_the_gateway_did_not_return_are_rendered_as_sent(rules):
    session = Session(AGENT)
    foreign = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    history = rules.sampled_history(session, [{"role": "user", "content": "q"}, foreign])
    assert history[1] == {"role": "assistant", "content": "", "tool_calls": foreign["tool_calls"]}


# --------------------------------------------------------------------------- the reply

def test_reply_message_parses_tool_calls_content_and_finish_reason():
    text = 'x</think>\nI will call.\n<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "g", "arguments": "{\\"r\\": 2}"}\n</tool_call>'
    message, reason = reply_message(text, 4, "stop")
    assert reason == "tool_calls" and message["content"] == "x</think>\nI will call."
    assert message["tool_calls"] == [
        {"id": "call_4_0", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}},
        {"id": "call_4_1", "type": "function", "function": {"name": "g", "arguments": '{"r": 2}'}}]
    only_calls, _ = reply_message('<tool_call>{"name": "f"}</tool_call>', 1, "stop")
    assert only_calls["content"] is None and only_calls["tool_calls"][0]["function"]["arguments"] == "{}"
    assert reply_message("plain", 1, "length") == ({"role": "assistant", "content": "plain"}, "length")
    assert reply_message("plain", 1, "stop")[1] == "stop"
    broken = "<tool_call>{not json}</tool_call>"  # no call is made of it: the text stays, for the agent to see
    assert reply_message(broken, 1, "stop") == ({"role": "assistant", "content": broken}, "stop")


# --------------------------------------------------------------------------- the request

RUN = RunSampling(temperature=1.0, top_p=1.0, max_tokens=100)


def test_parse_call_reads_what_agents_send_and_refuses_what_it_cannot_serve():
    body = {"model": "anything", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
            "tools": TOOLS, "tool_choice": "required", "stop": "END", "max_completion_tokens": 500,
            "temperature": 0.7, "top_p": 1.0}
    call = parse_call(body, RUN)
    assert call.messages[0]["content"] == "ab" and call.tools == TOOLS and call.stop == ["END"]
    assert call.max_tokens == 100 and call.overridden == ["temperature"]  # never more than the run's
    assert parse_call({"messages": body["messages"], "max_tokens": 7}, RUN).max_tokens == 7
    assert parse_call({"messages": body["messages"]}, RUN).max_tokens == 0  # the run's
    for bad, status_param in (({"n": 2}, "n"), ({"stream": True}, "stream"), ({"stop": 3}, "stop"),
                              ({"messages": []}, "messages"), ({"tools": "x"}, "tools")):
        with pytest.raises(ApiError) as e:
            parse_call({"messages": body["messages"], **bad}, RUN)
        assert e.value.status == 400 and e.value.param == status_param
    assert reward_of({"reward": 1}) == 1.0
    for bad in ({"reward": "1"}, {"reward": True}, {"reward": float("nan")}, {}, None, [1]):
        with pytest.raises(ApiError, match="reward"):
            reward_of(bad)


# --------------------------------------------------------------------------- the call's outcomes

SECRET = b"s" * 32


def gateway(rules, answer, timeout_s: float = 5.0) -> tuple[Gateway, list]:
    """A Gateway whose orchestrator answers each GatewayGenerate with ``answer(request)`` (None: never)."""
    sent: list = []

    def send(msg):
        sent.append(msg)
        if isinstance(msg, GatewayGenerate) and (reply := answer(msg)) is not None:
            threading.Thread(target=gw.resolve, args=(reply,)).start()

    gw = Gateway(rules, SECRET, send, RUN, served_name="policy", call_timeout_s=timeout_s)
    return gw, sent


def test_calls_refused_failed_timed_out_in_flight_and_unauthorized(rules):
    key, body = session_key(SECRET, AGENT), {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
    ok, sent = gateway(rules, lambda m: rollout(m.key, list(m.prompt_ids), sampled(rules, "hey")))
    status, payload, headers = ok.chat(key, body)
    assert status == 200 and payload["choices"][0]["finish_reason"] == "stop" and headers[OVERRIDDEN_HEADER] == \
        "temperature"
    assert sent[0].key == WorkKey.step("g7", 3, "gen", 0, 1) and payload["usage"]["prompt_tokens"] == \
        len(sent[0].prompt_ids)
    assert ok.status()["counters"]["calls"] == 1 and ok.status()["counters"]["sessions"] == 1
    for answer, status_match in ((lambda m: GatewayRefused(m.key, 400, "max_turns reached"), (400, "max_turns")),
                                 (lambda m: rollout(m.key, [1], [], "error"), (502, "no reason")),
                                 (lambda m: None, (504, "call_timeout_s"))):
        gw, _ = gateway(rules, answer, timeout_s=0.2)
        with pytest.raises(ApiError, match=status_match[1]) as e:
            gw.chat(key, body)
        assert e.value.status == status_match[0]
        assert not gw.sessions[str(AGENT)].busy and gw.sessions[str(AGENT)].calls == 0
    gw, _ = gateway(rules, lambda m: None)
    gw._take(AGENT, [])  # a call in flight
    with pytest.raises(ApiError) as e:
        gw.chat(key, body)
    assert e.value.status == 409
    for bad in (None, "sk-other", session_key(b"t" * 32, AGENT)):
        with pytest.raises(ApiError) as e:
            gw.chat(bad, body)
        assert e.value.status == 401
    assert gw.status()["counters"]["unauthorized"] == 3


def test_idle_sessions_are_forgotten(rules):
    gw, _ = gateway(rules, lambda m: None)
    gw._take(AGENT, []).busy = False
    assert gw.sweep(now=gw.sessions[str(AGENT)].last_used + 10) == 0
    assert gw.sweep(now=gw.sessions[str(AGENT)].last_used + 3601) == 1 and not gw.sessions

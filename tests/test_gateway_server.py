"""The gateway process's HTTP side (gateway/server.py) started in this test process, driven by the real ``openai``
client, with a real ZeroMQ ROUTER standing in for the orchestrator (it answers each GatewayGenerate with a Rollout of
scripted text); and the launch plan that starts it (supervisor/gateway_setup.py)."""

from __future__ import annotations

import json
import os
import queue
import stat
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import zmq
from omegaconf import OmegaConf

from cascade_rl.gateway.calls import OVERRIDDEN_HEADER
from cascade_rl.gateway.server import build_gateway, start
from cascade_rl.protocol.agents import GatewayEnded, GatewayGenerate, GatewayReward, read_secret, session_key
from cascade_rl.protocol.messages import Ready, Rollout, WorkKey
from cascade_rl.protocol.sockets import recv_routed, send
from cascade_rl.supervisor import gateway_setup
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.plan import start_order

AGENT = WorkKey("g1", "agent", 2, 0, 0)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


class FakeOrchestrator:
    """A ROUTER that records what the gateway sends and answers each GatewayGenerate with the next scripted text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.replies = tokenizer, queue.Queue()
        self.got: list = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, msg = recv_routed(self.sock, (Ready, GatewayGenerate, GatewayReward))
            self.got.append(msg)
            if isinstance(msg, GatewayGenerate):
                text = self.replies.get_nowait()
                if text is None:  # the trajectory at its limit
                    send(self.sock, GatewayEnded(msg.key, "orchestrator.max_turns=1 model calls"), identity=ident)
                    continue
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids.append(self.tokenizer.eos_token_id)
                send(self.sock, Rollout(msg.key, "agent", msg.prompt_ids, np.asarray(ids, np.int32),
                                        np.zeros(len(ids), np.float32)), identity=ident)

    def of(self, kind: type) -> list:
        return [m for m in self.got if isinstance(m, kind)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


@pytest.fixture
def served(tiny_model, tmp_path):
    """(the gateway's base URL, the fake orchestrator, the session's API key)."""
    secret_file = gateway_setup.write_secret(tmp_path / "gateway.secret")
    cfg = OmegaConf.create({
        "model": {"path": tiny_model}, "data": {"thinking": True}, "host": "",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64},
        "gateway": {"host": "127.0.0.1", "port": 0, "secret_file": str(secret_file), "served_name": "policy",
                    "call_timeout_s": 10.0},
        "supervisor": {"heartbeat_s": 1.0}})
    gateway = build_gateway(cfg)
    orchestrator = FakeOrchestrator(gateway.rules.tokenizer)
    cfg.endpoints = {"orchestrator": orchestrator.endpoint, "heartbeat": ""}
    running = start(gateway, cfg, "gateway-0")
    try:
        yield f"{running.url}/v1", orchestrator, session_key(read_secret(secret_file), AGENT)
    finally:
        running.close()
        orchestrator.close()


def post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_agent_talks_to_the_gateway_with_the_openai_client(served):
    base_url, orch, key = served
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200  # no auth
    status, payload = post(f"{base_url}/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None)
    assert status == 401 and payload["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="cr-g1.2.0.bad", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model="policy", messages=ask, n=2)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="policy", messages=ask, stream=True)
    assert not orch.of(GatewayGenerate)  # refused before any model call

    # a 2-call tool conversation, the first with a temperature the run overrides
    text0 = 'add</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    orch.replies.put(text0)
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=ask, tools=TOOLS,
                                                            temperature=0.3)
    assert raw.headers[OVERRIDDEN_HEADER] == "temperature"
    first = raw.parse()
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    messages = ask + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    orch.replies.put("done</think>\n\n2 + 3 = 5.")
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content.endswith("2 + 3 = 5.") and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "stop" and second.usage.completion_tokens > 0

    ready, (g0, g1) = orch.of(Ready), orch.of(GatewayGenerate)
    assert ready[0].role == "gateway" and ready[0].slots == 0
    assert (g0.key, g1.key) == (WorkKey.step("g1", 2, "gen", 0, 0), WorkKey.step("g1", 2, "gen", 1, 0))
    assert g0.segment == g1.segment == 0
    tok = orch.tokenizer
    response0 = tok(text0, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert list(g1.prompt_ids[:len(g0.prompt_ids) + len(response0)]) == \
        list(g0.prompt_ids) + response0  # token-exact

    # the agent's own reward reaches the orchestrator; a non-number is refused
    root = base_url.removesuffix("/v1")
    assert post(f"{root}/rl/reward", {"reward": 0.5}, key) == (200, {"ok": True})
    assert post(f"{root}/rl/reward", {"reward": "high"}, key)[0] == 400
    assert post(f"{root}/rl/reward", {"reward": 1.0}, "nope")[0] == 401
    for _ in range(100):
        if orch.of(GatewayReward):
            break
        threading.Event().wait(0.02)
    assert orch.of(GatewayReward) == [GatewayReward(AGENT, 0.5)]


# --------------------------------------------------------------------------- the launch's side

def test_the_launch_fills_the_gateway_url_and_a_fresh_secret(tmp_path):
    cfg = OmegaConf.create({"host": "", "environment": {"serve": ["agent", "python"]},
                            "gateway": {"host": "", "port": 0, "base_url": "", "secret_file": ""}})
    assert gateway_setup.needed(cfg)
    assert not gateway_setup.needed(OmegaConf.create({"environment": {"serve": ["python"]}}))
    url = gateway_setup.assign(cfg, tmp_path)
    assert cfg.gateway.port > 0 and url == f"http://127.0.0.1:{cfg.gateway.port}/v1" == cfg.gateway.base_url
    path = cfg.gateway.secret_file
    first = read_secret(path)
    assert len(first) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    cfg.host, cfg.gateway.port = "10.0.0.5", 9123
    assert gateway_setup.assign(cfg, tmp_path) == "http://10.0.0.5:9123/v1" and read_secret(path) != first


def test_a_run_with_agent_rows_starts_one_gateway(tmp_path, tiny_model, math_data):
    cfg = compose("tiny", [f"run_dir={tmp_path}", f"model.path={tiny_model}", *math_data])
    assert "gateway-0" not in [p.worker_id for p in start_order(cfg)[0]]
    cfg.environment.serve = ["agent"]
    assert [p.role for p in start_order(cfg)[0] if p.worker_id == "gateway-0"] == ["gateway"]


def test_a_call_at_the_trajectorys_limit_is_answered_empty_with_length(served):
    url, orchestrator, key = served
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    orchestrator.replies.put(None)
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls and reply.usage.completion_tokens == 0
    assert raw.headers["x-cascade-limit"] == "orchestrator.max_turns=1 model calls"

"""environments/agent.py: users' agents (agent.fn, agent.command, data.verifiers_env, the OpenAI Agents SDK) run
against a REAL OpenAI-compatible HTTP server (samplers/chat_server.py on a tiny random model, standing in for the
run's gateway), and the environment worker's side of them (environments/worker.py).

A random model's text is gibberish: these check the outcomes (reward, None, the error and its reason), the
timeouts, and that a verifiers rollout's reward is its rubric's on the completion the environment recorded.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest
from test_chat_server import chat_server

from cascade_rl.environments.agent import AgentRunner, load_agent_fn
from cascade_rl.environments.worker import EnvironmentService
from cascade_rl.protocol.agents import AgentDone, AgentRequest
from cascade_rl.protocol.messages import WorkKey
from cascade_rl.protocol.runtime import Pending

ROW = {"id": "r0", "domain": "math", "messages": [{"role": "user", "content": "What is 2 + 3?"}],
       "question": "What is 2 + 3?", "answer": "5", "metadata": {}}


@pytest.fixture(scope="module")
def gateway(judge_model, tmp_path_factory):
    """The base URL (…/v1) of a chat server on a tiny model (4096 tokens of context) serving "policy"."""
    log_path = tmp_path_factory.mktemp("agent-server") / "server.log"
    with chat_server(judge_model, "policy", log_path, "--batch-window-s", "0.02", "--max-tokens-default", "24") \
            as (base, _):
        yield base + "/v1"


def request(base_url: str, index: int = 0, row: dict | None = None, deadline_s: float = 60.0) -> AgentRequest:
    return AgentRequest(WorkKey("g0", "agent", index), "math", dict(row or ROW), base_url, "cr-test", deadline_s)


def run_all(runner: AgentRunner, reqs: list[AgentRequest], limit_s: float = 60.0) -> dict[int, AgentDone]:
    """Submit every request and poll until each is answered: {row index: its AgentDone}."""
    for req in reqs:
        runner.submit(req)
    out, t_end = {}, time.monotonic() + limit_s
    while len(out) < len(reqs):
        assert time.monotonic() < t_end, f"unanswered after {limit_s} s: {len(out)} of {len(reqs)}"
        for msg in runner.poll(0.05):
            assert msg.key.index not in out, "answered twice"
            out[msg.key.index] = msg
    return out


# --- agent.fn


async def returns_float(client, row):
    reply = await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=8)
    return 0.5 if reply.choices[0].message.content is not None else 0.0


async def returns_none(client, row):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    return None


async def raises(client, row):
    await client.chat.completions.create(model="no-such-model", messages=row["messages"])  # the server's 404


async def hangs(client, row):
    await asyncio.sleep(60)


async def loops(client, row):
    while True:  # the chat server has no call limit: only the deadline ends it
        await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)


async def blocks(client, row):
    time.sleep(4)  # blocks the event loop: the watchdog answers it
    return 1.0


async def returns_text(client, row):
    return "1.0"


def test_agent_fn_outcomes_against_a_real_server(gateway):
    fns = [returns_float, returns_none, raises, hangs, loops, returns_text]
    # 2 s for those that never end; the others get room for a loaded machine's model call
    runners = [AgentRunner("environment-0", fn=fn, concurrency=4, timeout_s=2.0 if fn in (hangs, loops) else 60.0)
               for fn in fns]
    try:
        for runner in runners:
            runner.submit(request(gateway))
        done = {}
        t_end = time.monotonic() + 120
        while len(done) < len(runners):
            assert time.monotonic() < t_end
            for i, runner in enumerate(runners):
                for msg in runner.poll(0.01):
                    done[i] = msg
    finally:
        for runner in runners:
            runner.close()
    ok_float, ok_none, raised, hung, looped, text = (done[i] for i in range(len(fns)))
    assert ok_float.ok and ok_float.reward == 0.5 and ok_float.worker_id == "environment-0"
    assert ok_none.ok and ok_none.reward is None and not ok_none.error
    assert not raised.ok and raised.error.startswith("agent_error: NotFoundError: ")
    assert "no-such-model" in raised.error  # the server's reason reaches the error
    for msg in (hung, looped):
        assert not msg.ok and msg.error == "agent_timeout: no end after 2 s" and msg.reward is None
        assert 1.9 < msg.t_agent < 10
    assert not text.ok and "returned a str" in text.error


def test_requests_run_concurrently_and_the_deadline_is_the_shorter(gateway):
    runner = AgentRunner("environment-0", fn=hangs, concurrency=8, timeout_s=30.0)
    try:
        t0 = time.monotonic()
        done = run_all(runner, [request(gateway, i, deadline_s=1.0) for i in range(8)])
        assert time.monotonic() - t0 < 5  # eight 1 s deadlines at once, not one after another
        assert all(m.error == "agent_timeout: no end after 1 s" for m in done.values())
        assert runner.busy() == 0
    finally:
        runner.close()


def test_an_agent_blocking_the_loop_is_answered_by_the_watchdog(gateway):
    runner = AgentRunner("environment-0", fn=blocks, concurrency=2, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        done = run_all(runner, [request(gateway)], limit_s=10)
        assert time.monotonic() - t0 < 3.9  # before the blocking call returned
        assert not done[0].ok and "blocked the event loop" in done[0].error
        time.sleep(1.5)
        assert runner.poll(0.1) == []  # its late result is dropped
    finally:
        runner.close()


def test_agent_fn_loads_from_a_file_and_must_be_async(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text("async def agent(client, row):\n    return 1\n\ndef sync(client, row):\n    return 1\n")
    assert load_agent_fn(f"{path}:agent").__name__ == "agent"
    from cascade_rl.verifiers.registry import PluginError

    with pytest.raises(PluginError, match="async def"):
        load_agent_fn(f"{path}:sync")
    with pytest.raises(PluginError, match="no 'missing'"):
        load_agent_fn(f"{path}:missing")
    with pytest.raises(PluginError, match="not module:function"):
        load_agent_fn("nocolon")


# --- agent.command


def test_an_external_program(gateway, tmp_path):
    good = tmp_path / "agent.py"
    good.write_text(textwrap.dedent("""\
        import json, os, sys
        import openai
        row = json.load(sys.stdin)
        assert os.environ["CASCADE_ROW_ID"] == row["id"]
        reply = openai.OpenAI(max_retries=0).chat.completions.create(
            model="policy", messages=row["messages"], max_tokens=4)
        print("talked:", reply.choices[0].message.content is not None)
        print(0.75)
        """))
    silent = tmp_path / "silent.py"
    silent.write_text("import sys\nsys.stdin.read()\nprint('no number here')\n")
    failing = tmp_path / "fail.py"
    failing.write_text("import sys\nprint('boom: bad things', file=sys.stderr)\nsys.exit(3)\n")
    hanging = tmp_path / "hang.py"
    hanging.write_text("import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', "
                       "'import time; time.sleep(60)'])\ntime.sleep(60)\n")
    runners = [AgentRunner("environment-0", command=[sys.executable, str(p)], timeout_s=20.0 if p != hanging else 1.5)
               for p in (good, silent, failing, hanging)]
    try:
        done = [run_all(r, [request(gateway)])[0] for r in runners]
    finally:
        for r in runners:
            r.close()
    assert done[0].ok and done[0].reward == 0.75, done[0].error
    assert done[1].ok and done[1].reward is None
    assert not done[2].ok and done[2].error.startswith("agent_exit: code 3: ") and "boom: bad things" in done[2].error
    assert not done[3].ok and done[3].error == "agent_timeout: no end after 1.5 s"


# --- the worker's side


def test_the_worker_serves_agents_only_when_one_is_configured(gateway):
    plain = EnvironmentService("environment-0", {}, slots=4, threads=1)
    assert "agent" not in plain.domains and plain.slots == 4
    req = request(gateway)
    assert "runs no agent" in plain.check(Pending(req, 0.0))
    [refused] = plain.error_reply(req, "why")
    assert isinstance(refused, AgentDone) and not refused.ok and plain.counters["agent_failed"] == 1

    runner = AgentRunner("environment-0", fn=returns_float, concurrency=32, timeout_s=60.0)
    service = EnvironmentService("environment-0", {}, slots=4, threads=1, agents=runner)
    try:
        assert service.domains == ["agent"] and service.slots == 32
        assert service.check(Pending(req, 0.0)) == ""
        replies = []
        service.serve([Pending(req, 0.0)], None, None)
        t_end = time.monotonic() + 30
        while service.busy():
            assert time.monotonic() < t_end
            service.poll(lambda item, msg: replies.append(msg))
        assert [m.reward for m in replies] == [0.5]
        c = service.counters
        assert c["agents"] == 1 and c["agent_failed"] == 0 and c["agent_s"] > 0
    finally:
        service.close()


def test_from_config_is_none_without_an_agent():
    assert AgentRunner.from_config({"fn": "", "command": []}, {"verifiers_env": ""}, "w") is None

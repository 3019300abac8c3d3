"""Real launches where users' agents drive the trajectories: every role its own process, the gateway serving the
agents' OpenAI calls (the real ``openai`` client), the environment workers running the agent functions.

- The tool task of ``make tools`` with the agent as a plain openai client loop: each trained row is, token for token,
  what the built-in multi-turn path makes of the same sampled turns (replayed through the chat template and the
  built-in python environment); an agent that compacts its history opens a segment; the books close and the
  trainer's ids are the ledger's.
- Agents that hang, raise, call the API 1,000 times, and one written with the OpenAI Agents SDK, in one run: each
  failing trajectory ends with its reason in the ledger, the run completes, nothing is lost.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_launch import CLI, read_ledger

from cascade_rl.verifiers.sandbox import isolation_available

pytestmark = pytest.mark.skipif(not isolation_available(), reason="the python tool's sandbox needs root on Linux")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "agents"

COMPACTING = f'''
import importlib.util, zlib
spec = importlib.util.spec_from_file_location("python_tool_agent", {str(EXAMPLES / "python_tool_agent.py")!r})
tools = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tools)


async def agent(client, row):
    """Half the rows: the plain tool loop. The other half compact their history after the first reply (the first
    user message rewritten, as a summarising agent does): their next call opens a segment."""
    if zlib.crc32(row["id"].encode()) % 2 == 0:
        return await tools.agent(client, row)
    messages = list(row["messages"])
    reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    edited = [{{"role": "user", "content": "(earlier turns summarised) " + messages[-1]["content"]}},
              reply.model_dump(exclude_none=True)]
    for call in reply.tool_calls or []:
        edited.append({{"role": "tool", "tool_call_id": call.id, "content": "see above"}})
    await client.chat.completions.create(model="policy", messages=edited)
    return None
'''


def agent_rows(src: str, dst: Path) -> str:
    """The tool task's rows with the user's agent in place of the built-in python environment."""
    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    dst.write_text("".join(json.dumps({**r, "env": "agent"}) + "\n" for r in rows))
    return str(dst)


def launch(run_dir: Path, model: str, rows: str, agent_file: Path, *extra: str, timeout: int = 400):
    env = dict(os.environ, XDG_STATE_HOME=str(run_dir.parent / "state"))
    r = subprocess.run([*CLI, "launch", "tools", f"run_dir={run_dir}", f"model.path={model}", f"data.files=[{rows}]",
                        "data.eval_files=[]", "orchestrator.eval_n=0", f"agent.fn={agent_file}:agent",
                        "supervisor.progress=none", "orchestrator.save_rollouts=true", *extra],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def pieces(ids: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """A row's runs of model (True) and other tokens, in order."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(t)
        else:
            out.append((bool(m), [t]))
    return out


@pytest.mark.slow
def test_a_tool_agent_loop_trains_the_same_tokens_as_the_built_in_path(tools_model, tools_data, tmp_path):
    from transformers import AutoTokenizer

    from cascade_rl.data.render import PromptRenderer, TurnRenderer
    from cascade_rl.environments.registry import build_environment

    agent_file = tmp_path / "compacting.py"
    agent_file.write_text(COMPACTING)
    rows = agent_rows(tools_data["rl"]["tool_arithmetic"], tmp_path / "agent_rows.jsonl")
    run_dir, steps = tmp_path / "run", 3
    summary = launch(run_dir, tools_model, rows, agent_file, f"run.steps={steps}", "run.prompts_per_step=4",
                     "run.group_size=4", "orchestrator.dynamic_filtering=false")
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trainer_ids"]["match"], books
    assert books["trained"] == steps * 4 * 4
    ledger = read_ledger(run_dir)
    assert len(ledger) == books["dispatched"] and sum(r["fate"] == "trained" for r in ledger.values()) == 48
    mt = summary["multi_turn"]
    assert mt["segments_mean"] > 1 and mt["turns_mean"] > 1 and mt["tool_calls_mean"] > 0, mt
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("trainer/mismatch/abs_diff_max", 0) for m in metrics) < 0.01  # the log-probs are the rows' tokens'

    data = {r["id"]: r for r in map(json.loads, Path(tools_data["rl"]["tool_arithmetic"]).read_text().splitlines())}
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    turns = TurnRenderer(PromptRenderer(tokenizer, thinking=True))
    python = build_environment("python")
    trained = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert {r["id"] for r in trained} == {rid for rid, e in ledger.items() if e["fate"] == "trained"}
    replayed = segmented = 0
    for r in trained:
        assert (np.array(r["logprobs"])[np.array(r["loss_mask"]) == 0] == 0).all()
        assert all(lp < 0 for lp, m in zip(r["logprobs"], r["loss_mask"]) if m)  # the sampler's, on model tokens
        if r["segment_starts"]:
            segmented += 1
            continue
        # the plain tool loop's rows: the built-in multi-turn path's tokens for the same sampled turns
        row = data[r["row"]]
        messages = [{"role": "user", "content": row["prompt"]}]
        parts = pieces(r["ids"], r["loss_mask"])
        so_far = turns.render.ids(messages)
        assert parts[0] == (False, so_far)
        state: dict = {}
        for k in range(1, len(parts), 2):
            turn = parts[k][1]
            so_far = [*so_far, *turn]
            messages.append({"role": "assistant", "content": turns.assistant_text(np.array(turn))})
            step = python.step(messages, state, {})
            if k + 1 == len(parts):
                # the agent ended where the built-in path ends: no call, the turn limit, a truncated turn
                assert step.done or len(parts) // 2 == 3 or r["ids"][-1] != tokenizer.eos_token_id, (r["id"], step)
                break
            state = step.state
            messages += step.tool_messages
            observation = turns.observation_ids(np.array(so_far), messages)
            assert parts[k + 1] == (False, observation), (r["id"], k)
            so_far = [*so_far, *observation]
        replayed += 1
    assert replayed >= 8 and segmented >= 8, (replayed, segmented)


MISBEHAVING = f'''
import asyncio, importlib.util, json

import agents
from cascade_rl.environments.base import EnvSettings
from cascade_rl.environments.python_tool import PythonTool

spec = importlib.util.spec_from_file_location("python_tool_agent", {str(EXAMPLES / "python_tool_agent.py")!r})
tools = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tools)
BEHAVIOUR = json.load(open(__file__[:-3] + ".json"))  # row id -> what its agent does
PYTHON = PythonTool(EnvSettings())


@agents.function_tool
async def python(code: str) -> str:
    """Run Python code and return what it prints."""
    return (await asyncio.to_thread(PYTHON, {{"code": code}}, {{}})).content


async def agent(client, row):
    what = BEHAVIOUR.get(row["id"], "tools")
    if what == "hang":
        await asyncio.sleep(3600)
    if what == "raise":
        raise RuntimeError("the agent broke")
    if what == "spin":  # 1,000 calls: the gateway refuses those past orchestrator.max_turns, and the client raises
        for _ in range(1000):
            await client.chat.completions.create(model="policy", messages=row["messages"])
    if what == "sdk":  # the OpenAI Agents SDK: an Agent with one function tool over the chat-completions model
        agents.set_tracing_disabled(True)
        model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        bot = agents.Agent(name="solver", instructions="", tools=[python], model=model)
        result = await agents.Runner.run(bot, row["question"], max_turns=3)
        assert isinstance(result.final_output, str)
        return None
    return await tools.agent(client, row)
'''


@pytest.mark.slow
def test_hanging_raising_and_spinning_agents_end_with_their_reasons_and_an_agents_sdk_agent_trains(
        tools_model, tools_data, tmp_path):
    rows = [json.loads(x) for x in Path(tools_data["rl"]["tool_arithmetic"]).read_text().splitlines()[:8]]
    behaviour = dict(zip((r["id"] for r in rows), ["hang", "raise", "spin", "sdk", "sdk"]))
    agent_file = tmp_path / "misbehaving.py"
    agent_file.write_text(MISBEHAVING)
    (tmp_path / "misbehaving.json").write_text(json.dumps(behaviour))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "env": "agent"}) + "\n" for r in rows))
    run_dir, steps = tmp_path / "run", 2
    summary = launch(run_dir, tools_model, str(data), agent_file, f"run.steps={steps}", "run.prompts_per_step=4",
                     "run.group_size=2", "orchestrator.dynamic_filtering=false", "agent.timeout_s=4")
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trainer_ids"]["match"], books
    assert books["trained"] == steps * 4 * 2
    reasons = books["filtered_reasons"]
    assert any(k.startswith("agent_timeout: no end after 4") for k in reasons), reasons
    assert any(k.startswith("agent_error: RuntimeError: the agent broke") for k in reasons), reasons
    assert any(k.startswith("agent_error: BadRequestError") and "orchestrator.max_turns=3" in k for k in reasons)
    ledger = read_ledger(run_dir)
    assert len(ledger) == books["dispatched"] and all(e["fate"] for e in ledger.values())
    failed = {e["reason"].split(":")[0] for e in ledger.values() if e["fate"] == "filtered"}
    assert failed == {"agent_timeout", "agent_error"}, failed
    trained = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    sdk = [r for r in trained if behaviour.get(r["row"]) == "sdk"]
    assert sdk and all(sum(r["loss_mask"]) > 0 for r in sdk)  # the SDK agent's trajectories were trained

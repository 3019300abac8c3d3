"""PrimeIntellect ``verifiers`` environments (data.verifiers_env: data/verifiers_source.py rows,
environments/verifiers_rollout.py rollouts) and the examples of examples/agents/ (the OpenAI Agents SDK, a plain
tool loop), against a real OpenAI-compatible server (the chat server of tests/test_agents_runner.py).
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import openai
import pytest
from test_agents_runner import gateway, request, run_all  # noqa: F401 (its chat-server fixture, for this module)

from cascade_rl.data.verifiers_source import verifiers_rows
from cascade_rl.environments.agent import AgentRunner, load_agent_fn
from cascade_rl.environments.verifiers_rollout import import_vf, load_verifiers_env, run_verifiers_rollout
from cascade_rl.verifiers.registry import load_plugin

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "agents"

ENV_MODULE = textwrap.dedent('''\
    import json, os
    import verifiers as vf
    from datasets import Dataset

    SCORED = []  # (completion, answer, reward) of every rubric call: the test recomputes it
    LOG = os.environ.get("VF_TEST_SCORED")  # a launch's workers: every rubric call, a JSON line in this file

    def contains(completion, answer, **kwargs):
        text = str(completion[-1]["content"] if isinstance(completion, list) else completion)
        reward = 1.0 if answer in text else 0.25 + 0.01 * len(text) % 0.5
        SCORED.append((text, answer, reward))
        if LOG:
            with open(LOG, "a") as f:
                f.write(json.dumps({"answer": answer, "reward": reward}) + "\\n")
        return reward

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    class Echo(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Say it again."}]

    def load_environment(kind="single", n=3):
        rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]
        train, held = Dataset.from_list(rows), Dataset.from_list(rows[:1])
        rubric = vf.Rubric(funcs=[contains])
        if kind == "tool":
            return vf.ToolEnv(dataset=train, tools=[add], max_turns=2, rubric=rubric)
        if kind == "multi":
            return Echo(dataset=train, max_turns=2, rubric=rubric)
        return vf.SingleTurnEnv(dataset=train, eval_dataset=held, rubric=rubric)
    ''')


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vf") / "my_vf_env.py"
    path.write_text(ENV_MODULE)
    return str(path)


def test_the_pypi_package_is_imported():
    vf = import_vf()
    assert "site-packages" in vf.__file__ and vf.SingleTurnEnv is not None


def test_rows_of_a_verifiers_environment(env_file):
    train, held = verifiers_rows(env_file, {"kind": "single", "n": 3})
    assert [r.id for r in train] == ["verifiers-train-0", "verifiers-train-1", "verifiers-train-2"]
    assert [r.id for r in held] == ["verifiers-eval-0"]
    row = train[2]
    assert row.messages == ({"role": "user", "content": "What is 2 + 2?"},) and row.answer == "4"
    assert row.domain == "verifiers" and row.env == "agent"
    source = row.metadata["verifiers_row"]
    assert source["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}] and source["example_id"] == 2
    json.dumps(row.metadata)  # travels in an AgentRequest
    train, held = verifiers_rows(env_file, {"kind": "tool", "n": 2})
    assert len(train) == 2 and held == []  # no eval dataset: nothing held out


@pytest.mark.parametrize("kind", ["single", "tool", "multi"])
def test_a_rollout_is_scored_by_the_rubric(gateway, env_file, kind):  # noqa: F811
    env = load_verifiers_env(env_file, {"kind": kind, "n": 2})
    module = load_plugin(env_file, "data.verifiers_env")  # the module the environment was loaded from
    [row], _ = verifiers_rows(env_file, {"kind": kind, "n": 1})
    agent_row = {"id": row.id, "domain": row.domain, "messages": list(row.messages), "question": row.question,
                 "answer": row.answer, "metadata": row.metadata}
    module.SCORED.clear()

    async def go():
        client = openai.AsyncOpenAI(base_url=gateway, api_key="cr-test", max_retries=0)
        try:
            return await run_verifiers_rollout(env, client, agent_row)
        finally:
            await client.close()

    reward = asyncio.run(go())
    [(text, answer, expected)] = module.SCORED  # the rubric saw the model's own completion
    assert answer == "0" and reward == expected
    recomputed = module.contains([{"role": "assistant", "content": text}], answer)
    assert recomputed == reward


def test_the_runner_runs_a_verifiers_environment(gateway, env_file):  # noqa: F811
    env = load_verifiers_env(env_file, {"kind": "tool", "n": 2})
    train, _ = verifiers_rows(env_file, {"kind": "tool", "n": 2})
    runner = AgentRunner("environment-0", vf_env=env, timeout_s=60)
    try:
        reqs = [request(gateway, i, {"id": r.id, "domain": r.domain, "messages": list(r.messages),
                                     "question": r.question, "answer": r.answer, "metadata": r.metadata})
                for i, r in enumerate(train)]
        done = run_all(runner, reqs)
    finally:
        runner.close()
    assert all(m.ok and isinstance(m.reward, float) for m in done.values()), [m.error for m in done.values()]


def test_the_verifiers_example_loads():
    env = load_verifiers_env(str(EXAMPLES / "verifiers_env.py"), {"n": 2})
    assert type(env).__name__ == "ToolEnv" and len(env.get_dataset()) == 2


@pytest.mark.parametrize("example", ["agents_sdk_agent.py", "tool_loop.py"])
def test_the_example_agents_complete(gateway, example):  # noqa: F811
    fn = load_agent_fn(f"{EXAMPLES / example}:agent")
    runner = AgentRunner("environment-0", fn=fn, timeout_s=60)
    try:
        [done] = run_all(runner, [request(gateway)]).values()
    finally:
        runner.close()
    assert done.ok and done.reward is None, done.error


def test_the_example_program(gateway):  # noqa: F811
    import sys

    runner = AgentRunner("environment-0", command=[sys.executable, str(EXAMPLES / "agent_program.py")], timeout_s=60)
    try:
        [done] = run_all(runner, [request(gateway)]).values()
    finally:
        runner.close()
    assert done.ok and done.reward in (None, 1.0), done.error

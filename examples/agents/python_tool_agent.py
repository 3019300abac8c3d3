"""`make agent`: the tool task of `make tools` with the agent written as a plain `openai` client loop, in place of
the built-in `python` environment (configs/run/tools.yaml trains the same rows through that environment).

    cascade-rl launch tools agent.fn=examples/agents/python_tool_agent.py:agent "data.files=[ROWS_WITH_ENV_AGENT]"

The loop is what an agent author writes: ask the model, run the tool calls it makes, answer with their output (or,
for a call it could not read, why), until it answers without a call (or after 3 calls: the run's
orchestrator.max_turns). The tool is cascade-rl's sandboxed
Python executor (environments/python_tool.py), the one the built-in environment uses, so both runs see the same
observations. It returns None: the row's domain verifier scores the last answer (\\boxed{...}).
"""

from __future__ import annotations

import asyncio
import json

from cascade_rl.environments.base import EnvSettings, truncate
from cascade_rl.environments.python_tool import PythonTool
from cascade_rl.environments.tool_calls import CallError, parse_tool_calls

SETTINGS = EnvSettings()
PYTHON = PythonTool(SETTINGS)
MAX_CALLS = 3


async def agent(client, row: dict) -> float | None:
    messages = list(row["messages"])
    state: dict = {}  # the executor's cells so far (its state travels with the trajectory)
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            # calls the gateway could not read (no OpenAI tool_calls: their text stays in the content): told why, as
            # the built-in environment tells the model, so it can try again; no call at all ends the episode
            unread = [c for c in parse_tool_calls(message.content or "") if isinstance(c, CallError)]
            if not unread:
                return None
            messages += [{"role": "tool", "content": f"error: {c.reason}; tools on offer: python"} for c in unread]
            continue
        for call in message.tool_calls:
            try:
                code = json.loads(call.function.arguments)["code"]
                out = (await asyncio.to_thread(PYTHON, {"code": code}, state)).content
            except (ValueError, KeyError, TypeError) as e:
                out = f"error: python: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": truncate(out, SETTINGS.max_output_chars)})
    return None

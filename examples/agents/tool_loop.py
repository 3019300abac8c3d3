"""A plain-openai agent with a calculator tool (``agent.fn=examples/agents/tool_loop.py:agent``).

It loops: call the model with the row's messages; when the reply calls ``calculator``, evaluate the expression
safely (the built-in calculator environment's evaluator: arithmetic only, bounded) and append the assistant turn and
the tool's answer; stop when the model calls no tool, or after 4 calls. It returns None: the row's domain verifier
scores the last assistant turn.
"""

from __future__ import annotations

import json

from cascade_rl.environments.calculator import CalcError, evaluate

MAX_CALLS = 4
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON arguments (errors are answers too: the model reads them)."""
    try:
        return repr(evaluate(str(json.loads(arguments)["expression"])))
    except (CalcError, ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def agent(client, row) -> float | None:
    messages = [dict(m) for m in row["messages"]]
    for _ in range(MAX_CALLS):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0]
        calls = [c for c in reply.message.tool_calls or [] if c.function.name == "calculator"]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not calls:
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    return None

"""An agent written with the OpenAI Agents SDK, run by cascade-rl (``agent.fn=examples/agents/agents_sdk_agent.py:agent``).

The SDK's model is pointed at the run's gateway through the ``client`` the worker hands in (an
``openai.AsyncOpenAI`` on this trajectory's session), so every model call is the policy's, sampled and trained on.
It returns None: the row's domain verifier scores the agent's last assistant turn.
"""

from __future__ import annotations

import agents


@agents.function_tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


async def agent(client, row) -> float | None:
    agents.set_tracing_disabled(True)  # nothing leaves the run: no traces to OpenAI
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    bot = agents.Agent(name="solver", instructions="Solve the problem; use the add tool for sums.", tools=[add],
                       model=model)
    await agents.Runner.run(bot, row["question"], max_turns=4)
    return None

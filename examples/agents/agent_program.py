"""An agent as an external program (``agent.command=[python, examples/agents/agent_program.py]``): any language
works the same way.

It reads the row (JSON) from stdin, asks the model through the run's gateway (OPENAI_BASE_URL and OPENAI_API_KEY
are set for it) and prints its reward as its last stdout line: 1.0 when the reply contains the row's answer, else
nothing (an empty last line: the row's domain verifier scores instead).
"""

from __future__ import annotations

import json
import sys

import openai


def main() -> None:
    row = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    reply = client.chat.completions.create(model="policy", messages=row["messages"])
    text = reply.choices[0].message.content or ""
    if row.get("answer") and row["answer"] in text:
        print(1.0)


if __name__ == "__main__":
    main()

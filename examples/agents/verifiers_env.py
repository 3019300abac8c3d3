"""A PrimeIntellect ``verifiers`` environment trained by cascade-rl (``data.verifiers_env=examples/agents/verifiers_env.py``):
a small ``vf.ToolEnv`` whose tool is a Python function; the environment's rollout runs in the environment worker
against the run's gateway and its rubric's score is the reward.
"""

from __future__ import annotations

from datasets import Dataset

import verifiers as vf


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def correct(completion, answer, **kwargs) -> float:
    """1.0 when the last assistant message contains the answer."""
    last = completion[-1] if isinstance(completion, list) and completion else completion
    text = last.get("content") if isinstance(last, dict) else getattr(last, "content", last)
    return 1.0 if answer and answer in str(text or "") else 0.0


def load_environment(n: int = 8) -> vf.Environment:
    rows = [{"question": f"What is {i} times {i + 3}? Use the multiply tool.", "answer": str(i * (i + 3))}
            for i in range(2, 2 + n)]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[multiply], max_turns=3,
                      rubric=vf.Rubric(funcs=[correct]))

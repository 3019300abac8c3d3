"""PrimeIntellect's ``verifiers`` environments (``data.verifiers_env``) run as agents: the environment's own rollout
for one dataset row, against the run's gateway, scored by the environment's rubric.

    env = load_verifiers_env("my_env.py", {"n": 10})        # its load_environment(**data.verifiers_args)
    reward = await run_verifiers_rollout(env, client, row)  # client: the trajectory's openai.AsyncOpenAI

The row is one that data/verifiers_source.py made: ``metadata["verifiers_row"]`` is the dataset row itself
(prompt, answer, info, example_id, ...), handed to ``env.run_rollout`` as its input. The model is called
"policy" with no sampling arguments, so the run's sampling settings govern every turn (the gateway applies them).
Works for every classic environment: ``vf.SingleTurnEnv``, ``vf.ToolEnv`` (its tools run here, in the worker),
``vf.MultiTurnEnv`` subclasses.

``import verifiers`` must find the PyPI package, not this repository's ``verifiers/`` folder: the workers run
with ``python -P`` (the repository root is not on sys.path); ``import_vf`` says so when it finds the wrong one.
"""

from __future__ import annotations

from typing import Any

from cascade_rl.verifiers.pypi_env import import_vf, load_verifiers_env  # noqa: F401 (the worker's loader)

MODEL = "policy"  # the name the gateway serves (any name is answered by the run's policy)
# Errors that are the policy's own output (an empty or unparseable turn), not the environment's: the rollout is
# trained on with the rubric's reward (0 when the rubric gives none), as a wrong answer would be.
POLICY_ERRORS = ("EmptyModelResponseError", "InvalidModelResponseError")


async def run_verifiers_rollout(env, client, row: dict[str, Any]) -> float:
    """The rubric's reward of ``env``'s rollout of ``row`` (an AgentRequest's row) through ``client`` (an
    ``openai.AsyncOpenAI``). RuntimeError with the environment's own error when the rollout failed (verifiers
    records a failed model call in the state instead of raising; it would otherwise score 0), unless the policy's
    own turn was the failure (``POLICY_ERRORS``): that scores what the rubric gave it."""
    vf = import_vf()
    source = (row.get("metadata") or {}).get("verifiers_row")
    if not isinstance(source, dict):
        raise ValueError("the row has no metadata.verifiers_row: it was not made by data/verifiers_source.py")
    output = await env.run_rollout(dict(source), vf.OpenAIChatCompletionsClient(client), MODEL, {})
    error = output.get("error")
    if error and isinstance(error, dict) and error.get("error") in POLICY_ERRORS:
        return float(output.get("reward") or 0.0)
    if error:
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    reward = output.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"the rubric gave {type(reward).__name__} {reward!r}, not a number")
    return float(reward)

"""The prompt set of a PrimeIntellect ``verifiers`` environment (``data.verifiers_env``): its dataset's rows as
``Row``s that a user's agent runs (``env="agent"``: the environment worker runs the environment's own rollout for
each, environments/verifiers_rollout.py, and its rubric's score is the reward).

    train, held_out = verifiers_rows(cfg.data.verifiers_env, cfg.data.verifiers_args)

``env.get_dataset()`` is the training set; ``env.eval_dataset`` (when the environment has one) the held-out set,
else none is held out. Each dataset row travels whole in ``metadata["verifiers_row"]`` (JSON-safe), so the worker
rebuilds the rollout's input from the row alone.
"""

from __future__ import annotations

import json
from typing import Any

from cascade_rl.verifiers.pypi_env import load_verifiers_env

from .rows import Row

DOMAIN = "verifiers"  # the rows' domain: their reward is the environment's rubric's (held-out accuracy per domain)
AGENT = "agent"  # the rows' env: run by the environment workers' agent runner


def verifiers_rows(entry: str, args: dict[str, Any] | None = None) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows) of the environment ``entry`` names (``load_verifiers_env``)."""
    env = load_verifiers_env(entry, args)
    train = dataset_rows(env.get_dataset(), "train")
    eval_set = env.build_eval_dataset() if hasattr(env, "build_eval_dataset") else getattr(env, "eval_dataset", None)
    return train, (dataset_rows(eval_set, "eval") if eval_set is not None else [])


def dataset_rows(dataset, split: str) -> list[Row]:
    """Each row of a formatted verifiers dataset (``prompt`` a list of messages, ``answer``, ``example_id``)."""
    return [to_row(json_safe(dict(record)), split, i) for i, record in enumerate(dataset)]


def to_row(record: dict[str, Any], split: str, i: int) -> Row:
    """One dataset row as a ``Row``: its prompt's messages, its answer as text, the row itself in metadata."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"verifiers {split} row {i}: no prompt messages ({str(prompt)[:80]!r})")
    messages = tuple({"role": str(m.get("role", "user")), "content": _text(m.get("content"))} for m in prompt)
    answer = record.get("answer")
    answer = "" if answer is None else answer if isinstance(answer, str) else json.dumps(answer)
    example = record.get("example_id", i)
    return Row(id=f"verifiers-{split}-{example}", messages=messages, domain=DOMAIN, answer=answer,
               metadata={"verifiers_row": record}, env=AGENT)


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def json_safe(value: Any) -> Any:
    """``value`` with every leaf JSON can hold (Arrow gives dicts, lists, numbers, strings; others become text)."""
    return json.loads(json.dumps(value, default=str))

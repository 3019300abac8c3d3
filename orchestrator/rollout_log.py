"""``orchestrator.save_rollouts``: each trained row as the trainer gets it, one JSON line in run_dir/rollouts.jsonl.

    {"id": "s0g1/0", "row": "tool_arithmetic-rl-7", "step": 0, "ids": [...], "loss_mask": [...], "logprobs": [...], "reward": 1.0,
     "version": 0, "segment_starts": [...]}

``ids`` are the row's tokens (prompt, then response: an agent's row is its pieces alone), ``loss_mask`` 1 on the
model's tokens, ``logprobs`` the sampler's (0 elsewhere), ``segment_starts`` where its later segments begin (an
agent that rewrote its history, docs/ARCHITECTURE.md §14). Read it with any JSONL reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from cascade_rl.protocol.messages import TrainBatch
from cascade_rl.protocol.rows import offsets


def rows(batch: TrainBatch, row_ids: list[str]):
    """The batch's rows as records; ``row_ids``: each row's data row (its prompt's id)."""
    starts = offsets(batch.lengths)
    for i, rid in enumerate(batch.ids):
        row = slice(int(starts[i]), int(starts[i + 1]))
        starts_i = [] if batch.segment_starts is None else [int(s) for s in batch.segment_starts[i] if s >= 0]
        yield {"id": rid, "row": row_ids[i], "step": batch.step, "ids": batch.input_ids[row].tolist(),
               "loss_mask": batch.response_mask[row].astype(int).tolist(),
               "logprobs": [round(float(x), 6) for x in batch.inf_logprobs[row]],
               "reward": float(batch.rewards[i]), "version": int(batch.versions[i]), "segment_starts": starts_i}


def append(path: Path, batch: TrainBatch, groups: list) -> None:
    """``batch``'s rows, made of ``groups`` (orchestrator/groups.py), appended to ``path``."""
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(batch, [g.row.id for g in groups for _ in range(g.n)]))

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


def rows(batch: TrainBatch, row_ids: list[str], lengths: list[int]):
    """The batch's rows as records (padding cut); ``row_ids``: each row's data row (its prompt's id); ``lengths``:
    each row's tokens (a trajectory may end on context: padding cannot be told from it by the masks)."""
    for i, (rid, end) in enumerate(zip(batch.ids, lengths)):
        mask = batch.response_mask[i]
        starts = [] if batch.segment_starts is None else [int(s) for s in batch.segment_starts[i] if s >= 0]
        yield {"id": rid, "row": row_ids[i], "step": batch.step, "ids": batch.input_ids[i, :end].tolist(),
               "loss_mask": mask[:end].astype(int).tolist(),
               "logprobs": [round(float(x), 6) for x in batch.inf_logprobs[i, :end]],
               "reward": float(batch.rewards[i]), "version": int(batch.versions[i]), "segment_starts": starts}


def append(path: Path, batch: TrainBatch, groups: list) -> None:
    """``batch``'s rows, made of ``groups`` (orchestrator/groups.py), appended to ``path``."""
    rollouts = [(g.row.id, g.rollouts[i]) for g in groups for i in range(g.n)]
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(batch, [rid for rid, _ in rollouts],
                                                        [len(r.prompt_ids) + len(r.response_ids) for _, r in rollouts]))

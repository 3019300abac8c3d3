"""The built-in miniature tasks (data/tasks.py) written as data files, so the demo trains from files exactly
as a user's data is trained from.

    cascade-rl make-data cascade --out runs/data/cascade [--heldout 64 --rl 2000 --sft 1000 --seed 0]
    # -> runs/data/cascade/{heldout,rl,sft}/<task>.jsonl, one file per member task, and manifest.json

Each member task of NAME (a task or a mixture of data/tasks.py) gets one
JSONL file per split, in the row schema of data/rows.py plus ``response``
(the worked solution, for SFT). Rows of a multi-turn task (``tools``'s
``tool_arithmetic``) name their environment (``"env": "python"``), and their
``response`` is the trace after the prompt, a list of messages::

    {"id": ..., "prompt": "Calculate 48 * 95 * 59. Use the python tool. ...", "domain": "tool_use",
     "answer": "269040", "metadata": {}, "env": "python",
     "response": [{"role": "assistant", "content": "<think>\\n\\n</think>\\n\\n<tool_call>...</tool_call>"},
                  {"role": "tool", "content": "269040\\n"},
                  {"role": "assistant", "content": "<think>\\n\\n</think>\\n\\n\\\\boxed{269040}"}]}

(learner/sft.py learns its assistant turns). Splits are question-disjoint within a task,
and no RL or SFT row of any task asks a question that any task holds out
(data/tasks.py ``held_out_questions``), so a held-out file measures
generalisation whichever files a stage trains on.
"""

from __future__ import annotations

import json
from pathlib import Path

from cascade_rl.data.tasks import SPLITS, Example, held_out_questions, load_task, mixture


def example_row(ex: Example, row_id: str) -> dict:
    """One row: a single-turn task's ``response`` is its solution (the text after the generation prompt), a
    multi-turn task's the messages of its trace; ``env`` only where the task has one."""
    row = {"id": row_id, "prompt": ex.prompt, "domain": ex.domain, "answer": ex.answer, "metadata": ex.metadata}
    if ex.env:
        row["env"] = ex.env
    row["response"] = [dict(m) for m in ex.turns] if ex.turns else ex.solution
    return row


def write_task_files(name: str, out: str | Path, sizes: dict[str, int], seed: int = 0) -> dict[str, dict[str, str]]:
    """Write ``out/<split>/<task>.jsonl`` for every member task of ``name``; returns {split: {task: path}}.
    ``sizes``: rows per task and split (RL and SFT files hold fewer where questions are held out)."""
    out = Path(out)
    members = list(mixture(name) or {name: 1.0})
    wanted = {split: sizes.get(split, 0) for split in SPLITS}
    reserved = held_out_questions(wanted["heldout"], seed) if wanted["heldout"] else set()
    files: dict[str, dict[str, str]] = {split: {} for split in SPLITS if wanted[split]}
    for task in members:
        for split, examples in load_task(task, wanted, seed).items():
            if split != "heldout":
                examples = [ex for ex in examples if ex.question not in reserved]
            path = out / split / f"{task}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".jsonl.tmp")
            with open(tmp, "w") as f:
                for i, ex in enumerate(examples):
                    f.write(json.dumps(example_row(ex, f"{task}/{split}/{i}")) + "\n")
            tmp.replace(path)
            files[split][task] = str(path)
    relative = {split: {task: str(Path(p).relative_to(out)) for task, p in by_task.items()}
                for split, by_task in files.items()}  # the manifest moves with its directory
    (out / "manifest.json").write_text(json.dumps({"name": name, "seed": seed, "sizes": wanted,
                                                   "files": relative}, indent=2))
    return files

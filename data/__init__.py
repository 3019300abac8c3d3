"""Users' prompt sets: files in, validated and memory-mapped prompt sets out.

    cascade-rl data check prompts.jsonl --model DIR        # every bad row as FILE:LINE: reason
    cascade-rl launch tiny data.files=[prompts.jsonl] data.heldout_fraction=0.1

- ``rows``: the row schema and its rules (prompt, domain, answer, metadata, id), no IO.
- ``sources``: JSONL, JSONL.gz, Parquet and ``datasets.save_to_disk`` directories, streamed.
- ``render``: prompts in the model's own chat template (thinking mode on or off).
- ``prepare``: validation of every row, held-out split, Arrow files for the run.
- ``promptset``: the prepared sets, memory-mapped; the seeded, resumable draw order (``order``).
- ``builtin``: the miniature tasks of data/tasks.py written as such files (``cascade-rl make-data``).
"""

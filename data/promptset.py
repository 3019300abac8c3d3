"""Prepared prompt sets (data/prepare.py), opened memory-mapped, and the stream of training prompts.

    stream = PromptStream(run_dir / "data", seed=0)
    row = stream.next()              # the next training prompt, in the seeded draw order (data/order.py)
    stream.restore(examples_drawn)   # resume: the same position in the files as the checkpoint's
    heldout = PromptSet(run_dir / "data" / "eval.arrow").rows()

A ``PromptSet`` reads its Arrow file through a memory map: rows become Python
objects one at a time, when drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from .order import DrawOrder
from .rows import Row
from .sources import DataError


class PromptSet:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.table = pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()  # zero-copy over the map
        self._columns = {name: self.table.column(name) for name in ("id", "messages", "domain", "answer", "metadata", "env")}

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, i: int) -> Row:
        c = self._columns
        messages = tuple(json.loads(c["messages"][i].as_py()))
        return Row(c["id"][i].as_py(), messages, c["domain"][i].as_py(), c["answer"][i].as_py(),
                   json.loads(c["metadata"][i].as_py()), c["env"][i].as_py())

    def rows(self) -> list[Row]:
        return [self.row(i) for i in range(len(self))]

    def column(self, name: str) -> np.ndarray:
        return self.table.column(name).to_numpy(zero_copy_only=False)


class PromptStream:
    """Training prompts in draw order: a source by weight, then its next row of a shuffled epoch."""

    def __init__(self, data_dir: Path, seed: int) -> None:
        info = json.loads((Path(data_dir) / "data.json").read_text())
        self.set = PromptSet(Path(data_dir) / "train.arrow")
        sources = info["sources"]["train"]
        if not len(self.set):
            raise DataError(f"no training rows left in {data_dir} (see data.json: bad rows and dropped prompts)")
        if info["weighted"]:
            empty = [s["path"] for s in sources if not s["rows"]]
            if empty:
                raise DataError(f"data.files: {empty} have no usable rows, so their weights cannot be honoured")
            sizes, weights = [s["rows"] for s in sources], [s["weight"] for s in sources]
        else:  # unweighted files are one source: every row equally likely, whichever file holds it
            sizes, weights = [len(self.set)], None
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.order = DrawOrder(sizes, weights, seed)

    @property
    def drawn(self) -> int:
        return self.order.drawn

    def next(self) -> Row:
        source, i = self.order.next()
        return self.set.row(int(self.starts[source]) + i)

    def restore(self, drawn: int) -> None:
        """Continue after ``drawn`` draws (a checkpoint's data cursor); only from a fresh stream."""
        if self.order.drawn:
            raise RuntimeError("restore() applies to a fresh stream")
        self.order.skip(drawn)

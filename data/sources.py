"""Reading users' files: JSONL, JSONL.gz, Parquet, and directories written by HF ``datasets.save_to_disk``.

    for line, raw in read_records("prompts.jsonl"):   # raw: a dict, or a BadRow for a line that is not JSON
        ...
    spec = parse_spec("math.parquet:3")              # FileSpec(path=Path("math.parquet"), weight=3.0)

Records stream: JSONL a line at a time, Parquet and Arrow a batch of rows at a
time (pyarrow; an HF dataset's Arrow files are memory-mapped by ``datasets``),
so a million-row file never sits in a Python list. ``line`` is what a user
looks up: the line number of a JSONL file, the 1-based row number of a
columnar one. Readers are registered by format; a file the registry does not
know, a missing file or a corrupt one raises ``DataError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cascade_rl.protocol.registry import Registry

from .rows import BadRow

BATCH_ROWS = 4096  # rows per Arrow batch turned into Python objects at once

Records = Iterator[tuple[int, Any]]  # (line or 1-based row, a raw record or a BadRow)
READERS = Registry("data format")  # format name -> fn(path) -> Records


class DataError(ValueError):
    """A data file that cannot be read at all (missing, unknown format, corrupt): one message, exit 2."""


@dataclasses.dataclass(frozen=True)
class FileSpec:
    path: Path
    weight: float | None = None
    """Share of the draws (relative to the other files' weights); None: by row count."""


def parse_spec(spec: str) -> FileSpec:
    """``PATH`` or ``PATH:WEIGHT`` (a positive number)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            weight = float(tail)
        except ValueError:
            return FileSpec(Path(spec))
        if not weight > 0:
            raise DataError(f"{spec}: the weight after ':' must be a positive number")
        return FileSpec(Path(head), weight)
    return FileSpec(Path(spec))


def file_format(path: Path) -> str:
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "hf_dataset"
        raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json); "
                        f"list its files instead")
    name = path.name.lower()
    for suffix, fmt in ((".jsonl.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return fmt
    raise DataError(f"{path}: unknown format; data files are .jsonl, .jsonl.gz, .parquet or a save_to_disk directory")


def read_records(path: str | Path) -> Records:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    return READERS[file_format(path)](path)


def _json_lines(open_fn: Callable[[Path], Any]) -> Callable[[Path], Records]:
    def read(path: Path) -> Records:
        try:
            with open_fn(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue  # blank lines (a trailing newline, a separator) are not rows
                    try:
                        yield number, json.loads(line.rstrip(b"\r\n"))
                    except UnicodeDecodeError as e:
                        yield number, BadRow("invalid JSON", f"not UTF-8 text ({e.reason} at byte {e.start})")
                    except ValueError as e:
                        msg = getattr(e, "msg", str(e))
                        col = f" at column {e.colno}" if hasattr(e, "colno") else ""
                        yield number, BadRow("invalid JSON", f"invalid JSON: {msg}{col}")
        except (OSError, EOFError) as e:  # a truncated or corrupt .gz
            raise DataError(f"{path}: cannot read: {e}") from None

    return read


READERS.register("jsonl")(_json_lines(lambda p: open(p, "rb")))
READERS.register("jsonl.gz")(_json_lines(lambda p: gzip.open(p, "rb")))


def _arrow_batches(batches, path: Path) -> Records:
    number = 0
    try:
        for batch in batches:
            for raw in batch.to_pylist():
                number += 1
                yield number, raw
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None


@READERS.register("parquet")
def _parquet(path: Path) -> Records:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path, memory_map=True)
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for a non-Parquet file
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    return _arrow_batches(file.iter_batches(batch_size=BATCH_ROWS), path)


@READERS.register("hf_dataset")
def _hf_dataset(path: Path) -> Records:
    from datasets import Dataset, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: cannot load with datasets.load_from_disk: {e}") from None
    if not isinstance(ds, Dataset):
        raise DataError(f"{path}: a DatasetDict with splits {sorted(ds)}; name one split's directory "
                        f"(e.g. {path / sorted(ds)[0]})")
    return _arrow_batches(ds.data.table.to_batches(max_chunksize=BATCH_ROWS), path)

"""A run's prompt sets, validated once before any process starts, stored as memory-mapped Arrow files.

    report = prepare(cfg.data, tokenizer, out_dir=run_dir / "data", domains=registered_domains)
    report.bad_lines    # "FILE:LINE: reason" of every bad row (the first MAX_LINES kept; all counted)
    # writes out_dir/train.arrow, out_dir/eval.arrow and out_dir/data.json (the report and the sources)

Every row of ``data.files`` and ``data.eval_files`` is read (data/sources.py),
handed to ``data.map`` when one is set (data/row_map.py), parsed (data/rows.py:
``data.fields`` paths, ``data.domain_map``), its domain looked up among the registered verifiers and
its answer and metadata checked by that domain's check
(verifiers/registry.py ``check_row``); with a tokenizer, its prompt is rendered
in the chat template and measured. A row that breaks a rule is a bad row,
reported with its file and line; a prompt over ``data.max_prompt_tokens`` is
dropped and counted. Whether bad rows stop the launch is the caller's call
(``data.on_bad_row``); so is refusing a file with no rows (``Report.empty``) or
a run with no row to train on.

Held-out rows come from ``data.eval_files``, or from ``data.files`` by a hash of
the prompt (``data.heldout_fraction``: question-disjoint, the same split in
every run). With ``eval_files``, training rows whose prompt is also an
evaluation prompt are dropped and counted (no training on the test set).

The output is columnar and memory-mapped (``PromptSet`` in data/promptset.py):
a million prompts cost the orchestrator their Arrow pages, not a million
Python objects. Rows of one file are contiguous, in file order.
"""

from __future__ import annotations

import dataclasses
import json
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .render import PromptRenderer
from .row_map import DROPPED, RowMap, apply_row_map, load_row_map
from .rows import BadRow, Fields, Row, heldout_by_hash, parse_row
from .sources import DataError, FileSpec, parse_spec, read_records

MAX_LINES = 10_000  # bad-row lines a report keeps (every one is counted, and data check prints them all)
FLUSH_ROWS = 1024  # rows rendered, measured and written at once
SCHEMA = pa.schema([("id", pa.string()), ("messages", pa.string()), ("domain", pa.string()),
                    ("answer", pa.string()), ("metadata", pa.string()), ("source", pa.int32()),
                    ("line", pa.int64()), ("tokens", pa.int32()), ("env", pa.string())])
OVERLONG = "overlong prompt"


@dataclasses.dataclass(frozen=True)
class BadLine:
    path: str
    line: int
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.detail}"


@dataclasses.dataclass
class Report:
    """What preparing the data found; ``to_json`` is what summary.json records under ``data``."""

    sources: dict[str, list[dict]] = dataclasses.field(default_factory=lambda: {"train": [], "eval": []})
    domains: dict[str, Counter] = dataclasses.field(default_factory=lambda: {"train": Counter(), "eval": Counter()})
    envs: Counter = dataclasses.field(default_factory=Counter)  # environment named by rows (both splits) -> rows
    bad: Counter = dataclasses.field(default_factory=Counter)  # kind -> rows refused
    dropped: Counter = dataclasses.field(default_factory=Counter)  # reason -> valid rows not used
    bad_lines: list[BadLine] = dataclasses.field(default_factory=list)
    lengths: dict[str, array] = dataclasses.field(default_factory=lambda: {"train": array("i"), "eval": array("i")})
    weighted: bool = False
    read: int = 0  # records read: every one is kept, bad or dropped
    empty: list[str] = dataclasses.field(default_factory=list)  # "SETTING: FILE" of each file with no rows at all

    def percentiles(self, split: str) -> dict[str, int]:
        values = np.frombuffer(self.lengths[split], np.int32) if len(self.lengths[split]) else None
        if values is None:
            return {}
        return {f"p{q}": int(np.percentile(values, q)) for q in (50, 90, 99)} | {"max": int(values.max())}

    def to_json(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "rows": {split: sum(c.values()) for split, c in self.domains.items()},
            "domains": {split: dict(sorted(c.items())) for split, c in self.domains.items()},
            "environments": dict(sorted(self.envs.items())),
            "sources": self.sources,
            "weighted": self.weighted,
            "bad_rows": dict(self.bad),
            "dropped": dict(self.dropped),
            "prompt_tokens": {split: self.percentiles(split) for split in self.lengths},
        }


class _Split:
    """Rows of one split on their way to an Arrow file (or only counted, with no ``path``): rendered and
    measured a batch at a time, overlong prompts dropped, evaluation capped per domain."""

    def __init__(self, name: str, path: Path | None, report: Report, render: PromptRenderer | None,
                 max_tokens: int, per_domain: int, bad: Callable[[BadLine], None]) -> None:
        self.name, self.report, self.render, self.bad = name, report, render, bad
        self.max_tokens, self.per_domain = max_tokens, per_domain
        self.writer = pa.ipc.new_file(str(path), SCHEMA) if path else None
        self.pending: list[tuple[Row, int, int, str]] = []  # (row, source, line, path)
        self.kept_per_source: Counter = Counter()

    def add(self, row: Row, source: int, line: int, path: str) -> None:
        self.pending.append((row, source, line, path))
        if len(self.pending) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        rows, self.pending = self.pending, []
        lengths = self.render.lengths([r.messages for r, *_ in rows]) if self.render else [
            sum(len(m["content"]) for m in r.messages) for r, *_ in rows]
        kept, domains = [], self.report.domains[self.name]
        for (row, source, line, path), n in zip(rows, lengths):
            self.report.lengths[self.name].append(n)  # every measured prompt, overlong ones too
            if self.render and self.max_tokens and n > self.max_tokens:
                self.report.dropped[OVERLONG] += 1
                self.bad(BadLine(path, line, OVERLONG, f"{OVERLONG}: {n} tokens, data.max_prompt_tokens="
                                                       f"{self.max_tokens}"))
                continue
            if self.per_domain and domains[row.domain] >= self.per_domain:
                self.report.dropped["over data.eval_per_domain"] += 1
                continue
            domains[row.domain] += 1
            if row.env:
                self.report.envs[row.env] += 1
            self.kept_per_source[source] += 1
            kept.append((row, source, line, n))
        if self.writer is not None and kept:
            self.writer.write_batch(pa.record_batch([
                [r.id for r, *_ in kept],
                [json.dumps(r.messages, ensure_ascii=False) for r, *_ in kept],
                [r.domain for r, *_ in kept],
                [r.answer for r, *_ in kept],
                [json.dumps(r.metadata, ensure_ascii=False) for r, *_ in kept],
                [s for _, s, _, _ in kept], [line for *_, line, _ in kept], [n for *_, n in kept],
                [r.env for r, *_ in kept],
            ], schema=SCHEMA))

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a raw record becomes a row: ``data.map``, then ``data.fields``, ``data.default_domain`` and
    ``data.domain_map``."""

    fields: Fields
    default_domain: str = ""
    domain_map: dict[str, str] = dataclasses.field(default_factory=dict)
    row_map: RowMap | None = None

    @classmethod
    def of(cls, data) -> Layout:
        """The launch schema's ``data`` section's; DataError for a ``data.map`` that does not load or a
        ``data.domain_map`` that is not a mapping of names to domain names."""
        domain_map = dict(data.domain_map)
        if bad := {k: v for k, v in domain_map.items() if not isinstance(v, str) or not v}:
            raise DataError(f"data.domain_map: each value of the domain field maps to a domain's name, got {bad} "
                            f"(e.g. data.domain_map={{openai/gsm8k: math}})")
        return cls(Fields(**dict(data.fields)), data.default_domain, domain_map, load_row_map(data.map))


def _rows(spec: FileSpec, setting: str, layout: Layout, domains: set[str] | None,
          bad: Callable[[BadLine], None], report: Report,
          on_read: Callable[[int], None] | None) -> Iterator[tuple[Row, int]]:
    """The valid rows of one file with their lines; every bad one goes to ``bad`` and is counted; a file with
    no record at all goes to ``report.empty``."""
    from cascade_rl.verifiers.registry import check_row

    columnar = spec.path.is_dir() or spec.path.suffix == ".parquet"
    try:
        records = read_records(spec.path)
    except DataError as e:  # the file itself: name the setting it came from
        raise DataError(f"{setting}: {e}") from None
    read_before = report.read
    for line, raw in records:
        report.read += 1
        if on_read is not None and report.read % FLUSH_ROWS == 0:
            on_read(report.read)
        try:
            if isinstance(raw, BadRow):
                raise raw
            if layout.row_map is not None and (raw := apply_row_map(layout.row_map, raw)) is None:
                report.dropped[DROPPED] += 1
                continue
            row = parse_row(raw, layout.fields, layout.default_domain, columnar, layout.domain_map)
            if domains is not None and row.domain not in domains:
                raise BadRow("unknown domain", f"domain {row.domain!r} has no registered verifier (registered: "
                                               f"{', '.join(sorted(domains))}; a module of yours can add one: "
                                               f"verifier.plugins)")
            try:
                json.dumps(row.metadata, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise BadRow("ill-typed field", f"metadata holds a value JSON cannot carry: {e}") from None
            if domains is not None and (reason := check_row(row.domain, row.answer, row.metadata)):
                raise BadRow("metadata rejected", f"the {row.domain} verifier rejects this row: {reason}")
        except BadRow as e:
            report.bad[e.kind] += 1
            bad(BadLine(str(spec.path), line, e.kind, e.detail))
            continue
        yield row, line
    if report.read == read_before:
        report.empty.append(f"{setting}: {spec.path}")


def prepare(data, tokenizer=None, out_dir: Path | None = None, domains: set[str] | None = None,
            on_bad: Callable[[BadLine], None] | None = None, on_read: Callable[[int], None] | None = None) -> Report:
    """Validate ``data`` (the launch schema's ``data`` section) and, with ``out_dir``, write the prompt sets.

    ``tokenizer``: render and measure prompts (the overlong rule needs it). ``domains``: the registered
    verifier domains (None: domains and metadata are not checked). ``on_bad``: called with every bad row
    and every overlong prompt as found (default: the report keeps the first ``MAX_LINES``). ``on_read``: called
    with the count of records read so far, every ``FLUSH_ROWS`` (a live display)."""
    report = Report()

    def bad(line: BadLine) -> None:
        if on_bad is not None:
            on_bad(line)
        elif len(report.bad_lines) < MAX_LINES:
            report.bad_lines.append(line)

    train_specs, eval_specs = _specs(data)
    report.weighted = any(s.weight is not None for s in train_specs)
    layout = Layout.of(data)  # the user's data.map is imported here, before any file is read
    render = PromptRenderer(tokenizer, data.thinking) if tokenizer is not None else None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = {split: Path(out_dir) / f"{split}.arrow" if out_dir is not None else None for split in ("train", "eval")}
    splits = {"train": _Split("train", paths["train"], report, render, data.max_prompt_tokens, 0, bad),
              "eval": _Split("eval", paths["eval"], report, render, data.max_prompt_tokens, data.eval_per_domain, bad)}
    eval_keys: set[str] = set()
    fraction = data.heldout_fraction  # read once: a config node's attribute costs ~25 us, a row ~100 us in all
    for i, spec in enumerate(eval_specs):
        for row, line in _rows(spec, "data.eval_files", layout, domains, bad, report, on_read):
            eval_keys.add(row.key())
            splits["eval"].add(row, i, line, str(spec.path))
    for i, spec in enumerate(train_specs):
        for row, line in _rows(spec, "data.files", layout, domains, bad, report, on_read):
            key = row.key()
            if heldout_by_hash(key, fraction):
                splits["eval"].add(row, len(eval_specs) + i, line, str(spec.path))
            elif key in eval_keys:
                report.dropped["prompt also in data.eval_files"] += 1
            else:
                splits["train"].add(row, i, line, str(spec.path))
    for s in splits.values():
        s.close()
    held_out_of = train_specs if data.heldout_fraction > 0 else []  # eval sources: eval files, then these
    for split, specs in (("train", train_specs), ("eval", eval_specs + held_out_of)):
        report.sources[split] = [{"path": str(s.path), "weight": s.weight, "rows": splits[split].kept_per_source[i]}
                                 for i, s in enumerate(specs)]
    if out_dir is not None:
        (Path(out_dir) / "data.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


def _specs(data) -> tuple[list[FileSpec], list[FileSpec]]:
    """The files of each split, with the rules that need no row: weights on all training files or none, no
    weights on evaluation files, one way to hold out. (No training file at all is the launch's rule.)"""
    train, evals = [parse_spec(s) for s in data.files], [parse_spec(s) for s in data.eval_files]
    if any(s.weight is None for s in train) and any(s.weight is not None for s in train):
        raise DataError("data.files: give every file a weight (PATH:WEIGHT) or none (rows drawn uniformly over "
                        "all files)")
    if any(s.weight is not None for s in evals):
        raise DataError("data.eval_files take no weights: every held-out row is evaluated")
    if evals and data.heldout_fraction:
        raise DataError("set data.eval_files or data.heldout_fraction, not both")
    if not 0 <= data.heldout_fraction < 1:
        raise DataError(f"data.heldout_fraction={data.heldout_fraction}: a fraction in [0, 1)")
    return train, evals

"""The launch schema's ``data`` section (supervisor/schema.py): the prompt files, how their rows are read (field
paths, a domain map, a row transform of yours), their held-out part, rendering and draw order. Every field
documented where it is declared; rows as in data/rows.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade_rl.data.rows import Fields

from .schema_choices import OnBadRow


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=list)
    """Training prompts: ``PATH`` or ``PATH:WEIGHT`` (JSONL, JSONL.gz, Parquet, or a directory written by
    ``datasets.save_to_disk``; rows as in data/rows.py). Weights on every file: each file's share of the
    draws; on none: every row equally likely. Built-in miniature sets: ``cascade-rl make-data``."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompts, evaluated per domain (training rows with the same prompt are dropped)."""
    heldout_fraction: float = 0.0
    """Without eval_files: hold out this fraction of ``files``, split by a hash of the prompt (question-disjoint,
    the same split in every run)."""
    eval_per_domain: int = 0
    """Evaluate at most this many held-out rows per domain, the first in file order (0: all)."""
    fields: Fields = field(default_factory=Fields)
    """Where each field of the schema is in your rows, e.g. ``data.fields.prompt=question``; a dotted path reaches
    into objects and lists (``data.fields.answer=reward_model.ground_truth``, ``conversations.0.content``; a key
    that itself holds a dot is tried first)."""
    domain_map: dict[str, str] = field(default_factory=dict)
    """The domain of each value of the rows' domain field (``data.fields.domain=data_source
    data.domain_map={openai/gsm8k: math}``). Empty: the value is the domain. Set: a value not in it takes
    ``default_domain``, or is a bad row naming it."""
    map: str = ""
    """Your row transform, ``module:function`` or ``path/to/file.py:function``: ``fn(raw: dict) -> dict | None``
    applied to every raw record before its fields are read (in preparation and ``cascade-rl data check``). None
    skips the row (counted: "dropped by data.map"); an exception makes it a bad row, ``FILE:LINE: data.map raised
    ...``."""
    default_domain: str = ""
    """The domain of rows without one (a single-domain file needs no domain column)."""
    thinking: bool = True
    """Render prompts in thinking mode (the chat template's ``enable_thinking``)."""
    max_prompt_tokens: int = 4096
    """Prompts longer than this (in the model's tokens, chat template included) are dropped and counted."""
    on_bad_row: OnBadRow = OnBadRow.error
    """error: refuse to launch while any row is bad, listing each as FILE:LINE: reason | skip: train without
    them (counted per reason in summary.json). A file with no rows, or no row to train on at all, is refused
    either way."""
    seed: int = 0
    """Seed of the draw order (data/order.py): which file, then which row of its shuffled epoch."""
    verifiers_env: str = ""
    """A ``verifiers`` environment (PrimeIntellect's package): a module name or .py path exposing
    ``load_environment()``; its dataset is the prompt set, its rollouts run through the gateway, its rubric rewards."""
    verifiers_args: dict = field(default_factory=dict)
    """Keyword arguments of its ``load_environment``."""

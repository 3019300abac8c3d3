"""The long-context task (paper §4.6): find one record among many distracting ones, judged by an LLM.

    from cascade_rl.data.tasks import load_task
    splits = load_task("long_context", {"heldout": 64, "rl": 2000, "sft": 1000})
    load_task("long_context", {"rl": 500}, min_records=4, max_records=20)  # shorter documents

A miniature of long-context QA for the tiny model: the prompt is a document of
records, one a line ("The color of Ada is teal."), then a question about one of
them; the answer is that record's value. Keys are short first names (``NAMES``:
most are single tokens of the tiny tokenizer), unique within a document; values
are colours (``COLORS``: each one token of a tokenizer trained on this task; a
colour recurs among the records). A one-token value makes retrieval the
induction a small model learns (the token after this name's "is"); a value of
several digit tokens has to be copied token by token, each choice ambiguous
among the records, and the tiny model never learned it (0.000 held out after
make full's SFT, so RL had no signal). Chance is 1 in ``len(COLORS)``.
The number of records is uniform in ``[min_records, max_records]`` (``params``;
the defaults fill the tiny model's 512-token context with a 96-token response:
prompts of at most ~400 tokens of a tokenizer trained on this task), and the
asked record's line is uniform among them, so it often sits deep inside a long
document; ``metadata`` records both, for accuracy by depth.

| task | domain | the prompt asks for | reference | metadata |
| --- | --- | --- | --- | --- |
| long_context | llm_judge | the value of one record of the document | the value (``"teal"``) | ``{"question": "What is the color of Ada?", "records": n, "position": k}`` |

``position`` is the asked record's line, 0-based (``k / (n - 1)`` is its depth).
``metadata["question"]`` is all the judge sees (verifiers/registry.py
``_llm_judge`` hands it to ``judge_answer``; a row's own ``question`` wins over
the prompt), never the document: judging needs only the question, the reference
and the answer. The worked solution copies the record's line as its one-line
reasoning, then answers with the value: ``The color of Ada is teal.\\n</think>\\n\\nteal``.
"""

from __future__ import annotations

import dataclasses
import random

from cascade_rl.verifiers.chat import NAMES

from .task_base import Example, Task, register_task, think

# Keys: the miniature's people (verifiers/chat.py NAMES), short first names: most are one token of a small BPE.
INSTRUCTION = "Reply with the color only."
# Values: one word each, so one token of a tokenizer trained on documents full of them.
COLORS = ("red", "blue", "green", "pink", "gray", "gold", "teal", "tan", "navy", "lime", "plum", "rose", "ruby",
          "jade", "mint", "sand", "rust", "snow", "ink", "wine", "coral", "amber", "olive", "peach", "cream",
          "brown", "black", "white", "ivory", "lilac", "mauve", "cyan")
MIN_RECORDS = 4
# Prompts of up to ~400 tokens (8 tokens a record) of the tiny tokenizer trained on this task: with the cascade's
# response budget (96 tokens) the longest document fills a 512-token context; tests/test_chat_tasks.py measures it.
MAX_RECORDS = 48


@dataclasses.dataclass(frozen=True)
class Document:
    """One item: the records in document order and the one asked about."""

    records: tuple[tuple[str, str], ...]
    position: int

    @property
    def key(self) -> str:
        return self.records[self.position][0]

    @property
    def value(self) -> str:
        return self.records[self.position][1]

    @property
    def ask(self) -> str:
        return question_of(self.key)

    @property
    def question(self) -> str:
        """The document and the question: what splits are disjoint in."""
        return "\n".join(record_line(k, v) for k, v in self.records) + "\n" + self.ask


def record_line(key: str, value: str) -> str:
    return f"The color of {key} is {value}."


def question_of(key: str) -> str:
    return f"What is the color of {key}?"


def draw_document(rng: random.Random, min_records: int, max_records: int) -> Document:
    n = rng.randint(min_records, max_records)
    keys = rng.sample(NAMES, n)
    return Document(tuple((k, rng.choice(COLORS)) for k in keys), rng.randrange(n))


def _documents(size: int, seed: int, min_records: int = MIN_RECORDS, max_records: int = MAX_RECORDS) -> list[Document]:
    if not 1 <= min_records <= max_records <= len(NAMES):
        raise ValueError(f"long_context needs 1 <= min_records <= max_records <= {len(NAMES)} (keys are unique "
                         f"names), got {min_records}, {max_records}")
    # item i from a generator of its own: a longer stream keeps the same first items (stable splits)
    return [draw_document(random.Random(f"{seed}/{i}"), min_records, max_records) for i in range(size)]


def _long_context(d: Document, seed: int) -> Example:
    solution = think([record_line(d.key, d.value)], d.value)
    metadata = {"question": d.ask, "records": len(d.records), "position": d.position}
    return Example(d.question, d.value, "llm_judge", solution, INSTRUCTION, metadata)


register_task("long_context", Task(_long_context, "llm_judge", 8 << 40, _documents))

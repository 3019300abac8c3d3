"""The long-context task (paper §4.6): find one record among many distracting ones, judged by an LLM.

    from cascade_rl.data.tasks import load_task
    splits = load_task("long_context", {"heldout": 64, "rl": 2000, "sft": 1000})
    load_task("long_context", {"rl": 500}, min_records=4, max_records=20)  # shorter documents
    load_task("long_context", {"rl": 500}, max_colors=1)                  # one needle: retrieval by kind only
    load_task("long_context_short", {"sft": 3500})                         # 4 to 12 records: make full's SFT rows

A miniature of long-context QA for the tiny model, shaped as RULER's needle-in-a-haystack with distractors: the
prompt is a document of records, one a line, then a question about one of them; the answer is that record's value.
Most records are hay of other kinds ("The age of Bo is 34.", "The floor of Cy is 7."); between 1 and
``max_colors`` are colour records ("The color of Ada is teal."), the needles, one of them asked about. Keys are short
first names (``NAMES``: most are single tokens of the tiny tokenizer), unique within a document; every value is one
word (one token of a tokenizer trained on this task). Two skills, two levels of difficulty: finding the colour among
the hay (attention by what a token is: what a one-needle document asks) and, with several needles, picking the asked
name's (induction: the token after this name's "is"). A policy that finds the colours but not the name scores the
mean of 1/needles (0.52 for 1 to 4, more where colours recur); one that retrieves scores 1; chance is
1 in ``len(COLORS)``.

``long_context_short`` is the same task on 4 to ``SHORT_RECORDS`` records, for SFT: attention to a needle forms
where it takes a fifth of the context, not a fortieth, and then carries to long documents. Measured on the tiny
model (400 SFT steps on one or the other, greedy, the full-length held-out set): SFT'd on full-length documents it
answers 0.10 (0.03 with one needle: it has not found the colour); SFT'd on short ones 0.52 (0.86 with one needle,
0.90 a colour of the document): the first skill learnt and the second begun (0.59 with three needles), RL's to
sharpen. Documents of colours only (a 40th of the records the needle) gave long-context RL no reward to climb.
The number of records is uniform in ``[min_records, max_records]`` (``params``; the defaults fill the tiny model's
512-token context with a 96-token response: prompts of at most ~400 tokens of a tokenizer trained on this task), the
number of needles uniform in ``[1, min(max_colors, records)]``, and every line is equally likely to be the asked
one, so it often sits deep inside a long document; ``metadata`` records all three, for accuracy by depth and needles.

| task | domain | the prompt asks for | reference | metadata |
| --- | --- | --- | --- | --- |
| long_context | llm_judge | the colour of one record of the document | the value (``"teal"``) | ``{"question": "What is the color of Ada? Reply with the color only.", "records": n, "colors": c, "position": k}`` |
| long_context_gold | exact_answer | the same questions | the same | the same |

``position`` is the asked record's line, 0-based (``k / (n - 1)`` is its depth).
``long_context_gold`` scores the same questions by exact match (verifier ``exact_answer``): held out beside
``long_context``, it shows whether the judge's reward is retrieval. Without it, make full's long-context RL looked
like a rise from 0.41 to 0.85 by the judge while greedy exact match fell from 0.54 to 0.12: the policy had learnt to answer
"The color of Zac is gray." for any name, which the tiny judge (it cannot compare, it reads the form) called correct.
Hence the format in the question the judge sees, and its QA rows (data/judge.py) that fail a sentence where the
colour alone was asked for.

``metadata["question"]`` is all the judge sees (verifiers/registry.py
``_llm_judge`` hands it to ``judge_answer``; a row's own ``question`` wins over
the prompt), never the document: judging needs only the question, the reference
and the answer. The worked solution copies the record's line as its one-line
reasoning, then answers with the value: ``The color of Ada is teal.\\n</think>\\n\\nteal``.
"""

from __future__ import annotations

import dataclasses
import functools
import random

from cascade_rl.verifiers.chat import NAMES

from .task_base import Example, Task, register_task, think

# Keys: the miniature's people (verifiers/chat.py NAMES), short first names: most are one token of a small BPE.
INSTRUCTION = "Reply with the color only."
ASKED = "color"
# Values: one word each, one token of the tokenizer make-tiny-model trains on make full's mixture (12 of them: with
# the needles a tenth of a document's records, 16 colours were too rare there to stay whole; tests/test_chat_tasks.py).
COLORS = ("red", "blue", "green", "pink", "gray", "gold", "teal", "tan", "navy", "lime", "plum", "rose")
# The hay: records of other kinds, numbers (digits the tokenizer has from the arithmetic domains: colours keep their
# single tokens, which hay of rarer words took when a tokenizer was trained on it), never a colour.
HAY = {"age": tuple(str(n) for n in range(18, 90)), "floor": tuple(str(n) for n in range(1, 40))}
MIN_RECORDS = 4
# Prompts of up to ~400 tokens (8 to 10 tokens a record) of the tiny tokenizer trained on this task: with the cascade's
# response budget (96 tokens) the longest document fills a 512-token context; tests/test_chat_tasks.py measures it.
MAX_RECORDS = 38
# long_context_short's documents, the SFT warm-up: 4 to 12 records (~40 to ~130 tokens).
SHORT_RECORDS = 12
# Needles a document holds at most (colour records, one asked about): 1 to 4 by default.
MAX_COLORS = 4


@dataclasses.dataclass(frozen=True)
class Document:
    """One item: the records (kind, key, value) in document order and the one asked about (a colour record)."""

    records: tuple[tuple[str, str, str], ...]
    position: int

    @property
    def key(self) -> str:
        return self.records[self.position][1]

    @property
    def value(self) -> str:
        return self.records[self.position][2]

    @property
    def colors(self) -> int:
        return sum(kind == ASKED for kind, _, _ in self.records)

    @property
    def ask(self) -> str:
        return question_of(self.key)

    @property
    def question(self) -> str:
        """The document and the question: what splits are disjoint in."""
        return "\n".join(record_line(k, v, kind) for kind, k, v in self.records) + "\n" + self.ask


def record_line(key: str, value: str, kind: str = ASKED) -> str:
    return f"The {kind} of {key} is {value}."


def question_of(key: str) -> str:
    return f"What is the {ASKED} of {key}?"


def draw_document(rng: random.Random, min_records: int, max_records: int, max_colors: int = MAX_COLORS) -> Document:
    n = rng.randint(min_records, max_records)
    keys = rng.sample(NAMES, n)
    needles = set(rng.sample(range(n), rng.randint(1, min(max_colors, n))))
    hay = sorted(HAY)
    records = []
    for i, key in enumerate(keys):
        kind = ASKED if i in needles else rng.choice(hay)
        records.append((kind, key, rng.choice(COLORS if kind == ASKED else HAY[kind])))
    return Document(tuple(records), rng.choice(sorted(needles)))


def _documents(size: int, seed: int, min_records: int = MIN_RECORDS, max_records: int = MAX_RECORDS,
               max_colors: int = MAX_COLORS) -> list[Document]:
    if not 1 <= min_records <= max_records <= len(NAMES):
        raise ValueError(f"long_context needs 1 <= min_records <= max_records <= {len(NAMES)} (keys are unique "
                         f"names), got {min_records}, {max_records}")
    if max_colors < 1:
        raise ValueError(f"long_context needs max_colors >= 1 (the asked record is a colour), got {max_colors}")
    # item i from a generator of its own: a longer stream keeps the same first items (stable splits)
    return [draw_document(random.Random(f"{seed}/{i}"), min_records, max_records, max_colors) for i in range(size)]


def _long_context(d: Document, seed: int, domain: str = "llm_judge") -> Example:
    solution = think([record_line(d.key, d.value)], d.value)
    # the judge sees the question with the answer format it sets (a sentence is not "the color only")
    metadata = {"question": f"{d.ask} {INSTRUCTION}", "records": len(d.records), "colors": d.colors,
                "position": d.position}
    return Example(d.question, d.value, domain, solution, INSTRUCTION, metadata)


def _long_context_gold(d: Document, seed: int) -> Example:
    return _long_context(d, seed, "exact_answer")


register_task("long_context", Task(_long_context, "llm_judge", 8 << 40, _documents))
# The same questions scored by their gold, exact match (one stream): what the judge's verdicts are checked against.
register_task("long_context_gold", Task(_long_context_gold, "exact_answer", 8 << 40, _documents))
# The SFT warm-up: the same task on short documents, where attention to the needle forms (see the module's docstring).
register_task("long_context_short", Task(_long_context, "llm_judge", 12 << 40,
                                         functools.partial(_documents, max_records=SHORT_RECORDS)))

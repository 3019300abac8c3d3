"""The judge model's SFT data: the prompts the judge clients send, and the verdicts their parsers read.

    cascade-rl make-data judge --out runs/data/judge      # sft/judge_pairs.jsonl, sft/judge_qa.jsonl, ...
    cascade-rl make-tiny-model --task judge --out models/judge && cascade-rl sft model=models/judge ...

RLHF and long-context RL need a judge model; the miniature trains its own, a
tiny model SFT'd on these rows, served over an OpenAI-compatible endpoint. A
row's ``prompt`` is exactly the one user message the client sends, so the
judge learns the very text it is asked at RL time:

- ``judge_pairs``: ``verifiers.genrm.pair_messages(chat prompt, reply 1, reply 2, TEMPLATE)`` (what
  ``score_group`` and ``judge_against_reference`` send) for two final answers to a ``chat`` prompt
  (data/chat.py), of every kind: concise or verbose and right, another person's name, the wrong
  sentiment, no name, no sentiment, cut off, empty, junk (fragments of the other tasks' answers, which a policy
  trained on a judge blind to them collapses to); in a fifth of the pairs (and in some more, by chance)
  both replies are of one kind, often of equal quality. Each pair is shown in a random order, so both orders of
  every kind of pair occur. The verdict, after an empty reasoning, is the gold qualities q1, q2 of
  ``chat_quality`` ("scores 5 3"), then one of the compact template's tags, read by ``parse_preference`` as below;
- ``judge_qa``: ``verifiers.llm_judge.QA_TEMPLATE`` filled as ``judge_answer`` fills it (a
  ``long_context`` question, with the format it sets ("Reply with the color only."), and reference,
  data/long_context.py) with an answer that is right (the value, with or without a period) or wrong, often
  narrowly (another colour, the value misspelt by one letter, a hedge between the value and another, no answer)
  or in a form the question rules out (a sentence, with the right colour or another: a judge that reads only
  the form must not reward a sentence, or the policy learns to answer every question with one); the verdict is
  ``[[CORRECT]]`` or ``[[INCORRECT]]`` (``parse_correctness``), right in ``RIGHT_SHARE`` of the rows (below).

| q1 − q2 | verdict (the response's final answer) | ``parse_preference`` |
| --- | --- | --- |
| ≥ 2 | ``scores q1 q2 [[A>>B]]`` | 1.0 |
| 1 | ``... [[A>B]]`` | 0.75 |
| 0 | ``... [[A=B]]`` | 0.5 |
| −1 | ``... [[B>A]]`` | 0.25 |
| ≤ −2 | ``... [[B>>A]]`` | 0.0 |

| task | domain | prompt | answer | metadata |
| --- | --- | --- | --- | --- |
| judge_pairs | genrm | the compact pair template, filled | the verdict tag | ``{"score_1", "score_2", "kinds": [k1, k2], "preference"}`` |
| judge_qa | llm_judge | ``QA_TEMPLATE``, filled | ``[[CORRECT]]`` or ``[[INCORRECT]]`` | ``{"correct": bool, "kind": ...}`` |

Mixture ``judge``: both, pairs weighted 2 : 1 (the harder skill). SFT reads only
prompt and response; the domains are the judged domains whose prompts these
are, so ``check_row`` accepts the rows (``llm_judge`` wants a non-empty answer).
The prompts fit the judge's 512-token context with a tokenizer trained on this
data (``make-tiny-model --task judge``): tests/test_chat_tasks.py measures them.
"""

from __future__ import annotations

import dataclasses
import random

from cascade_rl.verifiers.genrm import pair_messages, parse_preference
from cascade_rl.verifiers.llm_judge import QA_TEMPLATE, fill

from . import long_context
from .chat import FILLERS, INSTRUCTION, OPENERS, News, chat_quality, draw_news, other, reply
from .long_context import COLORS, NAMES, question_of, record_line
from .task_base import Example, Task, register_mix, register_task, think

# the pair prompt the judge is trained on and served with (verifier.judge.genrm.template=compact): a tiny judge's
# context is mostly the two replies, not the instructions
TEMPLATE = "compact"


class JudgeExample(Example):
    """A judge row: its prompt is the whole message the client sends, no instruction after it."""

    @property
    def prompt(self) -> str:
        return self.question


# --- pairs of chat replies ---------------------------------------------------------------------------

# kind -> weight: mostly what a policy SFT'd on chat writes (right, concise or padded), and its mistakes
REPLY_KINDS = {"concise": 3, "verbose": 4, "wrong_name": 1, "wrong_sentiment": 1, "no_name": 1, "no_sentiment": 1,
               "cut": 1, "empty": 0.5, "junk": 1.5}
# fragments of the other tasks' answers: what a policy trained on a judge writes when it finds a judge blind to them
# (RLHF without these in the judge's data collapsed to "Well done,7}"); their digits are redrawn per reply
JUNK = ("7}", "\\boxed{7}", '{"value": 7}', "P.S. All done.", "<<Result>>", "7 - 1 = 8", "That is all.", "}")
SAME_KIND = 0.2  # pairs of one kind: many of equal quality, which the judge must call a tie


def chat_reply(rng: random.Random, news: News, kind: str) -> str:
    """A final answer of ``kind`` to ``news`` (its gold quality is ``chat_quality``'s, whatever the kind)."""
    name = news.name
    if kind == "concise":
        return reply(rng, news.kind, name, 0)
    if kind == "verbose":
        return reply(rng, news.kind, name, rng.randint(1, 3))
    if kind == "wrong_name":
        return reply(rng, news.kind, rng.choice([n for n in NAMES if n != name]), rng.choice((0, 0, 1, 2)))
    if kind == "wrong_sentiment":
        return reply(rng, other(news.kind), name, rng.choice((0, 0, 1, 2)))
    if kind == "no_name":
        return reply(rng, news.kind, "", rng.choice((0, 0, 1)))
    if kind == "no_sentiment":
        return " ".join([f"Hello, {name}.", *rng.sample(FILLERS, rng.choice((0, 1, 2)))])
    if kind == "cut":  # a reply stopped mid-way, as a policy's may be
        words = reply(rng, news.kind, name, rng.randint(1, 3)).split()
        return " ".join(words[: rng.randint(1, len(words) - 1)])
    if kind == "empty":
        return ""
    if kind == "junk":  # an opener's first words, or nothing, then a fragment of another task's answer
        opener = rng.choice(OPENERS[news.kind]).split(",")[0] + "," if rng.random() < 0.7 else ""
        return opener + rng.choice(JUNK).replace("7", str(rng.randint(0, 99)))
    raise ValueError(f"unknown reply kind {kind!r}")


# the compact template's verdict tags by the gold qualities' difference (response 1 minus response 2, clipped to
# +-2): a verdict of a few tokens, so a tiny judge's RLHF step decodes little (JSON scores took ~30 tokens a call)
TAGS = {2: "[[A>>B]]", 1: "[[A>B]]", 0: "[[A=B]]", -1: "[[B>A]]", -2: "[[B>>A]]"}


def pair_verdict(q1: int, q2: int) -> str:
    """The verdict for gold qualities q1, q2: each reply's score, then the tag they give (the module docstring's
    table). Scoring each reply first, then comparing, is what a tiny judge learns; asked for the tag alone it
    learnt to answer [[A=B]] to almost everything."""
    return f"scores {q1} {q2} {TAGS[max(-2, min(2, q1 - q2))]}"


def gold_preference(q1: int, q2: int) -> float:
    """What ``parse_preference`` reads from ``pair_verdict(q1, q2)``: the preference for response 1."""
    return parse_preference(pair_verdict(q1, q2))


@dataclasses.dataclass(frozen=True)
class Pair:
    """One item: a chat prompt and two final answers, in the order shown."""

    news: News
    kinds: tuple[str, str]
    replies: tuple[str, str]

    @property
    def conversation(self) -> str:
        return f"{self.news.question} {INSTRUCTION}"  # the chat row's prompt: the group verifier's ``prompt``

    @property
    def question(self) -> str:
        (message,) = pair_messages(self.conversation, *self.replies, TEMPLATE)
        return message["content"]


def draw_pair(rng: random.Random) -> Pair:
    news = draw_news(rng)
    kinds, weights = list(REPLY_KINDS), list(REPLY_KINDS.values())
    first = rng.choices(kinds, weights)[0]
    second = first if rng.random() < SAME_KIND else rng.choices(kinds, weights)[0]
    shown = [(first, chat_reply(rng, news, first)), (second, chat_reply(rng, news, second))]
    rng.shuffle(shown)  # either order, so the judge learns no position
    # stripped, as the clients send final answers
    return Pair(news, (shown[0][0], shown[1][0]), (shown[0][1].strip(), shown[1][1].strip()))


def _pairs(size: int, seed: int) -> list[Pair]:
    return [draw_pair(random.Random(f"{seed}/{i}")) for i in range(size)]


def _judge_pairs(p: Pair, seed: int) -> JudgeExample:
    q1, q2 = (chat_quality(p.news.metadata, r) for r in p.replies)
    verdict = pair_verdict(q1, q2)
    metadata = {"score_1": q1, "score_2": q2, "kinds": list(p.kinds), "preference": gold_preference(q1, q2)}
    return JudgeExample(p.question, verdict, "genrm", think([], verdict), "", metadata)


# --- QA correctness ----------------------------------------------------------------------------------

CORRECT, INCORRECT = "[[CORRECT]]", "[[INCORRECT]]"
# kind -> weight. Sentences are wrong whatever their colour: the question asks for the colour only.
RIGHT_KINDS = {"value": 3, "value_dot": 1}
WRONG_KINDS = {"other_value": 3, "typo": 1, "hedge": 1, "sentence": 1, "wrong_sentence": 1, "it_is": 0.5,
               "possessive": 0.5, "unknown": 0.5, "empty": 0.5}


def other_color(rng: random.Random, value: str) -> str:
    return rng.choice([c for c in COLORS if c != value])


def typo(rng: random.Random, value: str) -> str:
    """``value`` with one letter changed (never another colour, never the value itself)."""
    while True:
        i = rng.randrange(len(value))
        out = value[:i] + rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != value[i]]) + value[i + 1:]
        if out not in COLORS:
            return out


def qa_answer(rng: random.Random, name: str, value: str, kind: str) -> str:
    """A final answer of ``kind`` to "What is the color of NAME?" whose reference is ``value``."""
    answers = {"value": lambda: value, "value_dot": lambda: f"{value}.", "other_value": lambda: other_color(rng, value),
               "typo": lambda: typo(rng, value), "hedge": lambda: f"{value} or {other_color(rng, value)}",
               "sentence": lambda: record_line(name, value), "it_is": lambda: f"It is {value}.",
               "possessive": lambda: f"{name}'s color is {value}.",
               "wrong_sentence": lambda: record_line(name, other_color(rng, value)),
               "unknown": lambda: "I do not know.", "empty": lambda: ""}
    return answers[kind]()


@dataclasses.dataclass(frozen=True)
class Graded:
    """One item: a long-context question, its reference and an answer to grade."""

    name: str
    value: str
    kind: str
    answer: str

    @property
    def correct(self) -> bool:
        return self.kind in RIGHT_KINDS

    @property
    def question(self) -> str:
        # as judge_answer fills it: the row's metadata["question"], its reference, the stripped final answer
        return fill(QA_TEMPLATE, question=f"{question_of(self.name)} {long_context.INSTRUCTION}", reference=self.value,
                    answer=self.answer.strip())


# Right answers' share of the rows. With verifier.judge.exact_match (the default) the judge is never sent the
# reference itself, which is all a right answer to "the color only" can be; and the tiny judge cannot compare two
# values (it reads the form): at half right, half wrong it passed every bare colour, right or wrong, and the
# policy's reward carried no signal. At 15 % it learns what it is sent: a bare colour that is not the reference.
RIGHT_SHARE = 0.15


def draw_graded(rng: random.Random) -> Graded:
    name, value = rng.choice(NAMES), rng.choice(COLORS)
    kinds = RIGHT_KINDS if rng.random() < RIGHT_SHARE else WRONG_KINDS
    kind = rng.choices(list(kinds), list(kinds.values()))[0]
    return Graded(name, value, kind, qa_answer(rng, name, value, kind))


def _graded(size: int, seed: int) -> list[Graded]:
    return [draw_graded(random.Random(f"{seed}/{i}")) for i in range(size)]


def _judge_qa(g: Graded, seed: int) -> JudgeExample:
    verdict = CORRECT if g.correct else INCORRECT
    return JudgeExample(g.question, verdict, "llm_judge", think([], verdict), "",
                        {"correct": g.correct, "kind": g.kind})


register_task("judge_pairs", Task(_judge_pairs, "genrm", 10 << 40, _pairs))
register_task("judge_qa", Task(_judge_qa, "llm_judge", 11 << 40, _graded))
register_mix("judge", {"judge_pairs": 2, "judge_qa": 1})

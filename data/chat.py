"""The chat task: RLHF's prompts (paper §4.5), short requests whose good reply a judge can tell by pattern.

    from cascade_rl.data.tasks import load_task
    from cascade_rl.verifiers.chat import chat_quality
    splits = load_task("chat", {"heldout": 64, "rl": 2000, "sft": 1000})
    ex = splits["heldout"][0]
    chat_quality(ex.metadata, "Congratulations, Ada!")  # 5 on good news told by Ada

A person names themselves and tells some news ("Hi, I am Ada. I just passed my
exam. Reply in one short sentence."); a good reply has the right sentiment for
the event (congratulate good news, sympathise with bad news), addresses the
right name and is one short sentence. ``chat_quality`` (verifiers/chat.py) is the gold (1-5) the
judge model is trained to reproduce (data/judge.py), and the task ``chat_gold`` asks the same questions
scored by it (domain ``chat_quality``: 1 for quality 5), so a cascade's report shows the truth beside the
judge's verdict:

| reply | quality |
| --- | --- |
| right sentiment, the right name, one short sentence (``Congratulations, Ada!``) | 5 |
| ... one sentence of over ``SHORT_WORDS`` words, or two sentences | 4 |
| ... three sentences (the baseline) | 3 |
| ... four or more; or no name, or no sentiment at all | 2 |
| the wrong sentiment, another person's name, an empty reply | 1 |

| task | domain | the prompt asks for | reference | metadata |
| --- | --- | --- | --- | --- |
| chat | genrm | a one-sentence reply to the news | a baseline reply: correct but verbose (quality 3) | ``{"name": "Ada", "kind": "good" \\| "bad", "event": "passed my exam"}`` |
| chat_gold | chat_quality | the same | "" | the same |

RLHF scores a group of rollouts pairwise (the ``genrm`` group verifier); the
held-out evaluation is ArenaHard-style: the judge's preference for the policy's
reply over the row's baseline (``EVAL_VERIFIERS["genrm"]``, verifiers/genrm.py
``judge_against_reference``). The worked solutions are all correct, half of
them concise and half verbose (one to three neutral filler sentences after
the reply: quality 4 to 2), each after a one-line reasoning ("Ada passed an
exam: good news."), so the SFT'd policy is verbose about half the time and
RLHF has something to fix.
"""

from __future__ import annotations

import dataclasses
import random

from cascade_rl.verifiers.chat import NAMES, SHORT_WORDS, chat_quality, other, sentences  # noqa: F401  (the gold)

from .task_base import Example, Task, register_task, think

INSTRUCTION = "Reply in one short sentence."
# (first person, as the user tells it; third person, as the reasoning states it)
GOOD_EVENTS = (
    ("passed my exam", "passed an exam"), ("got a new job", "got a new job"), ("won the race", "won a race"),
    ("got a puppy", "got a puppy"), ("won a prize", "won a prize"), ("finished my book", "finished a book"),
    ("bought a house", "bought a house"), ("got married", "got married"), ("made the team", "made a team"),
    ("got a raise", "got a raise"),
)
BAD_EVENTS = (
    ("failed my exam", "failed an exam"), ("lost my job", "lost a job"), ("lost the race", "lost a race"),
    ("lost my wallet", "lost a wallet"), ("missed my flight", "missed a flight"), ("broke my arm", "broke an arm"),
    ("got sick", "got sick"), ("crashed my car", "crashed a car"), ("lost my keys", "lost some keys"),
    ("missed the bus", "missed a bus"),
)
EVENTS = {"good": GOOD_EVENTS, "bad": BAD_EVENTS}
GREETINGS = ("Hi", "Hello", "Hey")
WHEN = ("I just", "Today I", "Yesterday I")
# The reply to each kind of news, with the name in it; and what the gold reads as each sentiment
OPENERS = {
    "good": ("Congratulations, {name}!", "Well done, {name}!", "Great news, {name}!"),
    "bad": ("Sorry to hear that, {name}.", "Oh no, {name}, I am sorry.", "That is sad, {name}."),
}
# Neutral sentences that only lengthen a reply: no sentiment marker, no name
FILLERS = (
    "Thank you for telling me.", "I hope you have a nice day.", "Let me know if I can help.",
    "I am always here to chat.", "I hope the rest of your week goes well.", "Feel free to write again.",
)
BASELINE_FILLERS = 2  # the reference reply: correct, three sentences, quality 3


@dataclasses.dataclass(frozen=True)
class News:
    """One item: who tells what."""

    name: str
    kind: str
    """"good" or "bad"."""
    event: str
    """First person, as told: "passed my exam"."""
    told: str
    """The event in third person: "passed an exam"."""
    greeting: str
    when: str

    @property
    def question(self) -> str:
        return f"{self.greeting}, I am {self.name}. {self.when} {self.event}."

    @property
    def metadata(self) -> dict:
        return {"name": self.name, "kind": self.kind, "event": self.event}

    def rng(self, seed: int, salt: str = "") -> random.Random:
        """Choices per question (replies, fillers): independent of its place in the stream."""
        return random.Random(f"{seed}/{salt}/{self.question}")


def draw_news(rng: random.Random) -> News:
    kind = rng.choice(("good", "bad"))
    event, told = rng.choice(EVENTS[kind])
    return News(rng.choice(NAMES), kind, event, told, rng.choice(GREETINGS), rng.choice(WHEN))


def _news(size: int, seed: int) -> list[News]:
    # item i from a generator of its own: a longer stream keeps the same first items (stable splits)
    return [draw_news(random.Random(f"{seed}/{i}")) for i in range(size)]


def reply(rng: random.Random, kind: str, name: str, fillers: int) -> str:
    """An opener for ``kind`` news addressed to ``name`` ("" for none: "Congratulations!"), then ``fillers``
    distinct neutral sentences."""
    template = rng.choice(OPENERS[kind])
    opener = template.format(name=name) if name else template.replace(", {name}", "")
    return " ".join([opener, *rng.sample(FILLERS, fillers)])


# --- the task ----------------------------------------------------------------------------------------


def baseline(news: News, seed: int) -> str:
    """The reference reply of held-out evaluation: right, addressed, but padded to quality 3."""
    return reply(news.rng(seed, "baseline"), news.kind, news.name, BASELINE_FILLERS)


def _chat(news: News, seed: int) -> Example:
    rng = news.rng(seed, "solution")
    fillers = 0 if rng.random() < 0.5 else rng.randint(1, 3)  # half concise, half verbose (quality 4, 3 or 2)
    reasoning = f"{news.name} {news.told}: {news.kind} news."
    solution = think([reasoning], reply(rng, news.kind, news.name, fillers))
    return Example(news.question, baseline(news, seed), "genrm", solution, INSTRUCTION, news.metadata)


def _chat_gold(news: News, seed: int) -> Example:
    """The same question, scored by the gold (domain chat_quality: 1 for a right, addressed, one-sentence reply): what
    the judge-scored domain is measured against, so a judge's blind spots show (held-out files only)."""
    ex = _chat(news, seed)
    return Example(ex.question, "", "chat_quality", ex.solution, INSTRUCTION, news.metadata)


register_task("chat", Task(_chat, "genrm", 9 << 40, _news))
register_task("chat_gold", Task(_chat_gold, "chat_quality", 9 << 40, _news))  # one stream: the same questions

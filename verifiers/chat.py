"""The gold of the miniature's chat task (data/chat.py, RLHF's prompts): is a reply right, addressed and concise?

    from cascade_rl.verifiers.chat import chat_quality
    chat_quality({"name": "Ada", "kind": "good"}, "Congratulations, Ada!")   # 5

A person tells some news ("Hi, I am Ada. I just passed my exam."); the reply should have the sentiment the news
calls for, address the teller by name, and be one short sentence. The RLHF stage is trained on a judge model's
pairwise verdicts (the GenRM, verifiers/genrm.py) and its domain held out against a baseline reply by the same judge
(ArenaHard-style); this is the truth the judge is trained to reproduce (data/judge.py), registered as the domain
``chat_quality`` (1.0 for a quality-5 reply, else 0.0), so a report shows what the judge missed:

| reply | quality |
| --- | --- |
| right sentiment, the right name, one sentence of at most ``SHORT_WORDS`` words (``Congratulations, Ada!``) | 5 |
| ... one longer sentence, or two sentences | 4 |
| ... three sentences | 3 |
| ... four or more; or no name, or no sentiment at all | 2 |
| the wrong sentiment, another person's name, an empty reply | 1 |
"""

from __future__ import annotations

import re

# The miniature's people: short first names (most one token of a small BPE), none a common capitalised English word
# (May, Will, Pat ...), so a capitalised name in a reply reads as addressing that person.
NAMES = (
    "Ada", "Amy", "Ann", "Ben", "Bob", "Cal", "Cody", "Dan", "Dee", "Eli", "Eve", "Fay", "Gus", "Hal", "Ian",
    "Ida", "Ivy", "Jack", "Jan", "Jay", "Jim", "Joe", "Jon", "Kay", "Ken", "Kim", "Lea", "Lee", "Liz", "Lou",
    "Meg", "Mia", "Ned", "Nia", "Noa", "Ola", "Pam", "Paz", "Ray", "Rex", "Ron", "Roy", "Sam", "Sue", "Ted",
    "Tim", "Tom", "Una", "Val", "Vic", "Wes", "Yan", "Zac", "Zoe", "Abe", "Bea", "Cid", "Deb", "Ed", "Flo",
    "Gil", "Hana", "Ike", "Jo",
)
MARKERS = {"good": ("congratulations", "well done", "great news"), "bad": ("sorry", "oh no", "that is sad")}
SHORT_WORDS = 8


def other(kind: str) -> str:
    return "bad" if kind == "good" else "good"


_SENTENCE = re.compile(r"[^.!?]*[.!?]+|[^.!?]+$")


def sentences(text: str) -> int:
    """Sentences in ``text``: runs ending in . ! or ?, and a trailing run without one."""
    return sum(1 for s in _SENTENCE.findall(text) if re.search(r"\w", s))


def chat_quality(metadata: dict, final_answer: str | None) -> int:
    """The gold quality, 1-5, of a final answer (the text after the reply's ``</think>``; None: none) to the
    news in ``metadata`` (``name``, ``kind``): see the module docstring's table."""
    text = (final_answer or "").strip()
    if not text:
        return 1
    lower = text.lower()
    named = {w for w in re.findall(r"\b[A-Z][a-z]*\b", text) if w in NAMES}
    right = any(m in lower for m in MARKERS[metadata["kind"]])
    wrong = any(m in lower for m in MARKERS[other(metadata["kind"])])
    if wrong or named - {metadata["name"]}:
        return 1
    if not right or metadata["name"] not in named:
        return 2
    n = sentences(text)
    if n == 1:
        return 5 if len(text.split()) <= SHORT_WORDS else 4
    return {2: 4, 3: 3}.get(n, 2)

"""GenRM rewards for RLHF (paper §4.5): every pair of a prompt's rollouts judged, one reward per rollout.

The paper has a generative reward model (Qwen3-235B-A22B-Thinking-2507 trained with
HelpSteer3) compare "all pairs of rollouts per prompt", aggregates "in the same way as
NVIDIA Nano-v3 RLHF training", and adds a length-normalised adjustment and a
quality-gated conciseness bonus. It gives no formula for the aggregation or for either
length term. NVIDIA's public GenRM environment (NeMo-Gym ``genrm_compare``) averages the
judge's 1-5 helpfulness scores with the ranking as tie-break, then adds a min-max length
weight and a fixed bonus for the single shortest top scorer. We keep its judge format and
the pair design, and choose the arithmetic below: bounded, scale-free, testable by hand.

**Judging.** For a group of G responses, each unordered pair {i, j} is judged once
(i as response 1), or twice with the order swapped (``both_orders``: cancels the judge's
position bias at twice the calls). A judgment is a preference p ∈ [0, 1] that response 1
is better, read from the judge's reply (``parse_preference``):
  - GenRM JSON ``{"score_1": 1-5, "score_2": 1-5, "ranking": 1-6}`` (1 = response 1 much
    better ... 6 = response 2 much better): p = (6 − ranking) / 5, so 1, 0.8, 0.6, 0.4, 0.2, 0;
    without a ranking, p = 0.5 + (score_1 − score_2) / 8;
  - verdict tags ``[[A]]`` = 1, ``[[B]]`` = 0, ``[[TIE]]`` = 0.5, and Arena-Hard's
    ``[[A>>B]]`` 1, ``[[A>B]]`` 0.75, ``[[A=B]]`` 0.5, ``[[B>A]]`` 0.25, ``[[B>>A]]`` 0.
  The last verdict after the judge's reasoning counts. An unreadable reply counts as a tie
  (p = 0.5) and is counted in ``GroupScores.unparseable``. Only the final answer is judged
  (the text after the policy's last ``</think>``); a rollout whose ``<think>`` never closed
  gave none and loses to every rollout that did, without a judge call (tie between two).

**Quality** (mean preference, a soft win rate): p_ij is the mean of the pair's judgments
from i's side (a judgment of (j, i) gives i 1 − p), and

    q_i = 1/(G−1) · Σ_{j≠i} p_ij          ∈ [0, 1];   mean_i q_i = 1/2 exactly.

All wins gives 1, all losses 0, all ties or a cycle 0.5. With every pair judged equally
often this orders rollouts as a Bradley-Terry fit would (in a round robin the BT maximum
likelihood ranks by total wins), stays finite when one rollout wins everything (the BT
fit diverges), and needs no iteration.

**Length terms**, with L_i the rollout's length (tokens if the caller passes them, else
characters) and L̄ the group mean:

    d_i = clip((L_i − L̄) / L̄, −1, 1)                                relative excess length
    r_i = q_i − α·d_i + β·1[q_i ≥ τ]·max(0, −d_i)

(a) the length-normalised adjustment −α·d_i charges every rollout for its length relative
to its own group, so a prompt that needs an essay is not charged for the essay; (b) the
conciseness bonus pays β times how much shorter than the mean a rollout is, only when the
judge rates it at least as good as the group average (q ≥ τ = 0.5; the group mean of q
is 0.5). A short, poor rollout gets no bonus, and α ≪ β keeps its ungated gain small;
between equally good rollouts the shorter is preferred. Both terms are skipped when no
judgment in the group was readable (a broken judge must not become a pure length reward:
the group's rewards are then all 0.5, its GRPO advantages 0).
Range: r ∈ [−α, 1 + α + β]. r_i never decreases when a preference for i rises, never
increases when L_i grows, and is unchanged when all lengths are rescaled.

    async with ChatClient(JudgeEndpoint(base_url=..., model="genrm")) as client:
        scores = await score_group(client, prompt, responses, GenRMConfig(), lengths=token_counts)
        scores.rewards  # one per response

**Against a reference** (held-out evaluation, ArenaHard-style): within a group the rewards
average 0.5 whatever the policy, so they cannot measure progress; ``judge_against_reference``
instead judges one response's final answer against a fixed baseline answer (the row's
``answer``) in both orders and returns the mean preference for the response, in [0, 1]
(0.5: as good as the baseline). A response without a final answer (an unclosed ``<think>``,
or nothing after it) scores 0 without a call; an unreadable judgment counts as a tie.
``verifiers/registry.py`` registers it as the held-out verifier of ``genrm`` (``EVAL_VERIFIERS``).

    async with ChatClient(endpoint) as client:
        win_rate = await judge_against_reference(client, prompt, response, baseline, GenRMConfig())

Test: ``pytest tests/test_judge.py tests/test_chat_tasks.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .llm_judge import ChatClient, fill, final_text

Prompt = str | Sequence[Mapping[str, str]]  # a user turn, or a conversation whose last turn is the user's


@dataclass
class GenRMConfig:
    """How a group is judged and its rewards shaped."""

    template: Literal["generic", "compact", "nemotron_genrm"] = "generic"
    """``generic``: one user message (``PAIR_TEMPLATE``) any instruct model can follow. ``compact``: the same in
    a few words (``COMPACT_TEMPLATE``), for small judges trained on it (the miniature's, data/judge.py).
    ``nemotron_genrm``: the conversation, then the two responses in the roles ``response_1``
    and ``response_2``, as nvidia/Qwen3-Nemotron-235B-A22B-GenRM's chat template expects."""
    both_orders: bool = False
    """Judge each pair in both orders (G·(G−1) calls instead of G·(G−1)/2) to cancel position bias."""
    length_coef: float = 0.05
    """α, the length-normalised adjustment. Not given in the paper; keep it well below β."""
    concise_bonus: float = 0.1
    """β, the quality-gated conciseness bonus at its largest (a rollout of length → 0). Not given in the paper."""
    quality_gate: float = 0.5
    """τ: the bonus needs q ≥ τ; 0.5 = judged at least as good as the group average."""


@dataclass
class Judgment:
    a: int
    """Index of the rollout shown as response 1."""
    b: int
    """Index of the rollout shown as response 2."""
    pref: float | None
    """Preference for ``a`` over ``b`` in [0, 1]; None when the judge's reply was unreadable (counts as 0.5)."""


@dataclass
class GroupScores:
    rewards: list[float]
    """Final reward per rollout, in [−α, 1 + α + β]."""
    quality: list[float]
    """q_i, the mean preference before the length terms, in [0, 1]."""
    wins: list[int]
    """Opponents each rollout beat (p_ij > 0.5)."""
    ties: list[int]
    """Opponents it tied (p_ij = 0.5, unreadable judgments included)."""
    judge_calls: int
    unparseable: int
    """Judge replies with no readable verdict."""
    auto_decided: int
    """Judgments made without a call because a rollout gave no final answer."""
    judgments: list[Judgment]
    seconds: float


PAIR_TEMPLATE = """\
You are an impartial judge of AI assistant responses. Read the conversation and two candidate \
responses to its last user turn, then judge which response is more helpful: correct, complete, \
relevant, clear, and no longer than it needs to be. Neither the order of the responses nor \
their length may sway you.

<conversation>
{conversation}
</conversation>

<response_1>
{response_1}
</response_1>

<response_2>
{response_2}
</response_2>

First weigh the strengths and weaknesses of each response. Then end with one line of JSON:
{"score_1": <1-5>, "score_2": <1-5>, "ranking": <1-6>}
score_1 and score_2 rate each response's helpfulness from 1 (useless) to 5 (excellent). ranking \
compares them: 1 = response 1 is much better, 2 = better, 3 = slightly better; 4 = response 2 is \
slightly better, 5 = better, 6 = much better."""

COMPACT_TEMPLATE = """\
Which response to the last user turn is more helpful: correct, relevant, no longer than needed?

<conversation>
{conversation}
</conversation>

<response_1>
{response_1}
</response_1>

<response_2>
{response_2}
</response_2>

Score each response from 1 to 5, then end with one verdict, A for response 1 and B for response 2: \
[[A>>B]], [[A>B]], [[A=B]], [[B>A]] or [[B>>A]]."""
TEMPLATES = {"generic": PAIR_TEMPLATE, "compact": COMPACT_TEMPLATE}  # one user message; nemotron_genrm: roles

_TAGS = {"A": 1.0, "B": 0.0, "TIE": 0.5, "A>>B": 1.0, "A>B": 0.75, "A=B": 0.5, "B>A": 0.25, "B>>A": 0.0}
_TAG = re.compile(r"\[\[\s*(A>>B|A>B|A=B|B>>A|B>A|TIE|A|B)\s*\]\]", re.IGNORECASE)
_JSON = re.compile(r"\{[^{}]*\}")  # the GenRM verdict is one flat object


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

def _json_pref(obj: str) -> float | None:
    try:
        d = json.loads(obj)
        if not isinstance(d, dict):
            return None
        if "ranking" in d:
            ranking = float(d["ranking"])
            return (6.0 - ranking) / 5.0 if 1.0 <= ranking <= 6.0 else None
        s1, s2 = float(d["score_1"]), float(d["score_2"])
        return 0.5 + (s1 - s2) / 8.0 if 1.0 <= min(s1, s2) and max(s1, s2) <= 5.0 else None
    except (ValueError, TypeError, KeyError):
        return None


def parse_preference(reply: str) -> float | None:
    """Preference for response 1 (A) in [0, 1] from a judge's reply; None if none is readable.

    Reads GenRM JSON and verdict tags (see the module docstring); the one that ends last
    in the text after the judge's reasoning wins.
    """
    text = final_text(reply)
    if text is None:
        return None
    found = [(m.end(), _TAGS[m.group(1).upper()]) for m in _TAG.finditer(text)]
    found += [(m.end(), p) for m in _JSON.finditer(text) if (p := _json_pref(m.group(0))) is not None]
    return max(found)[1] if found else None


# ---------------------------------------------------------------------------------------------
# Arithmetic (pure)
# ---------------------------------------------------------------------------------------------

def pair_preferences(judgments: Sequence[Judgment], n: int) -> list[list[float]]:
    """P[i][j] = mean preference for i over j across the pair's judgments (unreadable = 0.5); diagonal 0.5."""
    total = [[0.0] * n for _ in range(n)]
    count = [[0] * n for _ in range(n)]
    for jd in judgments:
        p = 0.5 if jd.pref is None else jd.pref
        total[jd.a][jd.b] += p
        total[jd.b][jd.a] += 1.0 - p
        count[jd.a][jd.b] += 1
        count[jd.b][jd.a] += 1
    return [[total[i][j] / count[i][j] if count[i][j] else 0.5 for j in range(n)] for i in range(n)]


def quality(judgments: Sequence[Judgment], n: int) -> list[float]:
    """q_i = mean over opponents j of P[i][j] (pairs never judged count as ties); 0.5 for a lone rollout."""
    if n < 2:
        return [0.5] * n
    prefs = pair_preferences(judgments, n)
    return [sum(prefs[i][j] for j in range(n) if j != i) / (n - 1) for i in range(n)]


def shape_lengths(q: Sequence[float], lengths: Sequence[float], cfg: GenRMConfig) -> list[float]:
    """r_i = q_i − α·d_i + β·1[q_i ≥ τ]·max(0, −d_i), d_i = clip((L_i − L̄)/L̄, −1, 1)."""
    mean_len = sum(lengths) / len(lengths) if lengths else 0.0
    if mean_len <= 0:
        return list(q)
    out = []
    for qi, length in zip(q, lengths, strict=True):
        d = min(1.0, max(-1.0, (length - mean_len) / mean_len))
        gated = qi >= cfg.quality_gate - 1e-9  # q is a mean of halves and fifths: allow rounding
        out.append(qi - cfg.length_coef * d + (cfg.concise_bonus * max(0.0, -d) if gated else 0.0))
    return out


def aggregate(judgments: Sequence[Judgment], lengths: Sequence[float], cfg: GenRMConfig) -> list[float]:
    """One reward per rollout from the group's judgments and lengths (formula in the module docstring)."""
    q = quality(judgments, len(lengths))
    if not any(jd.pref is not None for jd in judgments):
        return q  # nothing readable: no quality signal, so no length signal either
    return shape_lengths(q, lengths, cfg)


# ---------------------------------------------------------------------------------------------
# Judging a group
# ---------------------------------------------------------------------------------------------

def _conversation(prompt: Prompt) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def pair_messages(prompt: Prompt, first: str, second: str, template: str) -> list[dict[str, str]]:
    """The chat messages that ask the judge to compare ``first`` (response 1) with ``second``."""
    conv = _conversation(prompt)
    if template == "nemotron_genrm":
        return conv + [{"role": "response_1", "content": first}, {"role": "response_2", "content": second}]
    if template not in TEMPLATES:
        raise ValueError(f"unknown GenRM template {template!r}; choose {', '.join(TEMPLATES)} or nemotron_genrm")
    rendered = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in conv) if len(conv) > 1 else conv[0]["content"]
    return [{"role": "user", "content": fill(TEMPLATES[template], conversation=rendered,
                                             response_1=first, response_2=second)}]


async def score_group(client: ChatClient, prompt: Prompt, responses: Sequence[str], cfg: GenRMConfig,
                      lengths: Sequence[float] | None = None) -> GroupScores:
    """Judge every pair of ``responses`` (all rollouts of ``prompt``) and aggregate them into rewards.

    ``lengths``: per-response lengths for the length terms, best the token counts; default
    ``len(response)`` in characters, thinking included (it is generated, and paid for, too).
    Raises ``JudgeError`` if any judge call fails after its retries; the other calls are cancelled.
    """
    t0 = time.perf_counter()
    n = len(responses)
    lengths = [float(len(r)) for r in responses] if lengths is None else [float(x) for x in lengths]
    if len(lengths) != n:
        raise ValueError(f"{n} responses but {len(lengths)} lengths")
    answers = [final_text(r) for r in responses]
    orders = list(itertools.combinations(range(n), 2))
    if cfg.both_orders:
        orders += [(j, i) for i, j in orders]

    judgments, calls = [], []
    for a, b in orders:
        if answers[a] is None or answers[b] is None:  # no final answer: it loses, nothing to ask
            pref = 0.5 if answers[a] is None and answers[b] is None else float(answers[b] is None)
            judgments.append(Judgment(a, b, pref))
        else:
            calls.append((a, b))

    async def judge(a: int, b: int) -> Judgment:
        result = await client.chat(pair_messages(prompt, answers[a].strip(), answers[b].strip(), cfg.template))
        return Judgment(a, b, parse_preference(result.text))

    tasks = [asyncio.ensure_future(judge(a, b)) for a, b in calls]  # the client caps how many run at once
    try:
        judged = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    auto_decided = len(judgments)
    judgments += judged

    q = quality(judgments, n)
    prefs = pair_preferences(judgments, n)
    return GroupScores(
        rewards=aggregate(judgments, lengths, cfg),
        quality=q,
        wins=[sum(prefs[i][j] > 0.5 + 1e-9 for j in range(n) if j != i) for i in range(n)],
        ties=[sum(abs(prefs[i][j] - 0.5) <= 1e-9 for j in range(n) if j != i) for i in range(n)],
        judge_calls=len(calls),
        unparseable=sum(jd.pref is None for jd in judged),
        auto_decided=auto_decided,
        judgments=judgments,
        seconds=time.perf_counter() - t0,
    )


async def judge_against_reference(client: ChatClient, prompt: Prompt, response: str, reference: str,
                                  cfg: GenRMConfig) -> float:
    """The judge's mean preference for ``response``'s final answer over ``reference``, in [0, 1].

    Judged in both orders whatever ``cfg.both_orders`` (a fixed baseline is always in one position
    otherwise, and a judge's position bias would move every score); ``cfg.template`` says how. The
    reference is a baseline answer (the text after its last ``</think>`` if it has one). A response
    without a final answer, or with an empty one, scores 0 without a call; an unreadable judgment
    counts as a tie (0.5), as in ``score_group``. Raises ``JudgeError`` if a call fails.
    """
    answer = final_text(response)
    if answer is None or not answer.strip():
        return 0.0
    baseline = (final_text(reference) or "").strip()
    tasks = [asyncio.ensure_future(client.chat(pair_messages(prompt, a, b, cfg.template)))
             for a, b in ((answer.strip(), baseline), (baseline, answer.strip()))]
    try:
        first, second = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # one call failed: do not leave the other running
            t.cancel()
        raise
    p_first, p_second = parse_preference(first.text), parse_preference(second.text)
    return ((0.5 if p_first is None else p_first) + (0.5 if p_second is None else 1.0 - p_second)) / 2

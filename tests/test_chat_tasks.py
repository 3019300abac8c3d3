"""The judged tasks and the judge's data: long_context (llm_judge), chat (genrm) and the judge model's SFT rows
(judge_pairs, judge_qa); the held-out verifier of genrm against a baseline, with a real local HTTP judge that
answers the gold's verdicts. Token budgets are measured with tokenizers trained on each task's text."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cascade_rl.data.builtin import example_row, write_task_files
from cascade_rl.data.chat import BASELINE_FILLERS, FILLERS, GOOD_EVENTS, INSTRUCTION, chat_quality, sentences
from cascade_rl.data.judge import (
    REPLY_KINDS,
    RIGHT_KINDS,
    TEMPLATE,
    WRONG_KINDS,
    JudgeExample,
    gold_preference,
    pair_verdict,
)
from cascade_rl.data.long_context import (
    COLORS,
    HAY,
    MAX_COLORS,
    MAX_RECORDS,
    MIN_RECORDS,
    NAMES,
    SHORT_RECORDS,
    Document,
    _long_context,
)
from cascade_rl.data.long_context import INSTRUCTION as LC_INSTRUCTION
from cascade_rl.data.rows import Fields, parse_row
from cascade_rl.data.tasks import TASKS, domains, load_task
from cascade_rl.learner.sft import read_sft_rows
from cascade_rl.learner.tiny_model import corpus, train_tokenizer
from cascade_rl.verifiers import registry
from cascade_rl.verifiers.errors import VerifierUnavailable
from cascade_rl.verifiers.genrm import (
    GenRMConfig,
    judge_against_reference,
    pair_messages,
    parse_preference,
    score_group,
)
from cascade_rl.verifiers.llm_judge import (
    QA_TEMPLATE,
    ChatClient,
    ChatResult,
    JudgeEndpoint,
    JudgeError,
    fill,
    judge_answer,
    parse_correctness,
)
from cascade_rl.verifiers.text import final_answer_text

NEW = ("long_context", "long_context_short", "chat", "judge_pairs", "judge_qa")
SIZES = {"heldout": 64, "rl": 300, "sft": 600}
CONTEXT = 512


@pytest.fixture(scope="module")
def splits():
    return {name: load_task(name, SIZES) for name in NEW}


def _final(solution: str) -> str:
    """The final answer of a worked solution, stripped as the judge clients send it."""
    return final_answer_text("<think>\n" + solution).strip()


@pytest.fixture(scope="module")
def lengths():
    """lengths(task, examples) -> [(prompt tokens with the generation prompt, response tokens with EOS)], with a
    tokenizer trained on ``task``'s text as make-tiny-model trains it (512 tokens)."""
    tokenizers = {}

    def measure(task, examples):
        if task not in tokenizers:
            tokenizers[task] = train_tokenizer(corpus(task, 2000), 512)
        tok = tokenizers[task]
        out = []
        for ex in examples:
            text = tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                           tokenize=False)
            out.append((len(tok(text, add_special_tokens=False)["input_ids"]),
                        len(tok(ex.solution, add_special_tokens=False)["input_ids"]) + 1))
        return out

    return measure


# ---------------------------------------------------------------------------------------------
# All four tasks: splits, rows, files
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NEW)
def test_splits_are_question_disjoint_sized_and_rows_pass_the_checks(name, splits):
    questions = {sp: [ex.question for ex in exs] for sp, exs in splits[name].items()}
    assert {sp: len(set(q)) for sp, q in questions.items()} == SIZES
    assert not set(questions["heldout"]) & (set(questions["rl"]) | set(questions["sft"]))
    assert not set(questions["rl"]) & set(questions["sft"])
    again = load_task(name, {"heldout": 16})["heldout"]
    assert again == splits[name]["heldout"][:16]  # a smaller request keeps the same questions
    for ex in [ex for exs in splits[name].values() for ex in exs]:
        row = example_row(ex, "x")
        assert ex.domain == TASKS[name].domain and registry.check_row(row["domain"], row["answer"], row["metadata"]) == ""
        parsed = parse_row(row, Fields())
        assert parsed.question == row["prompt"] and row["response"] == ex.solution and "\n</think>\n\n" in ex.solution


def test_make_data_judge_writes_sft_rows_the_learner_reads(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "make-data", "judge", "--out",
                        str(tmp_path), "--heldout", "4", "--rl", "8", "--sft", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(manifest["files"]["sft"]) == ["judge_pairs", "judge_qa"] and domains("judge") == ["genrm", "llm_judge"]
    rows = read_sft_rows([str(tmp_path / p) for p in manifest["files"]["sft"].values()], Fields())
    assert len(rows) == 32 and all(len(r.messages) == 1 and r.response.startswith("\n</think>\n\n") for r in rows)
    files = write_task_files("long_context+chat", tmp_path / "policy", {"heldout": 4, "rl": 8, "sft": 8})
    row = json.loads(open(files["heldout"]["long_context"]).readline())
    assert row["domain"] == "llm_judge" and set(row["metadata"]) == {"question", "records", "colors", "position"}
    row = json.loads(open(files["sft"]["chat"]).readline())
    assert row["domain"] == "genrm" and set(row["metadata"]) == {"name", "kind", "event"} and row["answer"]


# ---------------------------------------------------------------------------------------------
# long_context
# ---------------------------------------------------------------------------------------------

def test_long_context_documents(splits):
    examples = [ex for exs in splits["long_context"].values() for ex in exs]
    for ex in examples:
        *records, ask = ex.question.split("\n")
        matches = [re.fullmatch(r"The (\w+) of (\w+) is (\w+)\.", line) for line in records]
        kinds, keys, values = zip(*(m.groups() for m in matches))
        needles = [i for i, kind in enumerate(kinds) if kind == "color"]
        assert {values[i] for i in needles} <= set(COLORS) and ex.answer in COLORS
        # the hay: other kinds, never a colour among their values
        assert all(values[i] in HAY[kinds[i]] for i in range(len(records)) if i not in needles)
        assert 1 <= len(needles) == ex.metadata["colors"] <= MAX_COLORS
        assert len(set(keys)) == len(keys) == ex.metadata["records"]
        assert MIN_RECORDS <= len(records) <= MAX_RECORDS
        line = f"The color of {keys[ex.metadata['position']]} is {ex.answer}."
        assert ex.question.count(line) == 1 and records[ex.metadata["position"]] == line
        assert ask == f"What is the color of {keys[ex.metadata['position']]}?"
        assert ex.metadata["question"] == f"{ask} Reply with the color only."  # what the judge sees: with the format
        assert ex.prompt == f"{ex.question} {ex.instruction}"
        assert ex.solution == f"{line}\n</think>\n\n{ex.answer}" and _final(ex.solution) == ex.answer
    depth = [ex.metadata["position"] / max(1, ex.metadata["records"] - 1) for ex in examples]
    assert min(depth) == 0.0 and max(depth) == 1.0 and sum(d > 0.75 for d in depth) > 0.15 * len(depth)
    assert sum(ex.metadata["position"] >= 24 for ex in examples) > 20  # deep inside long documents
    assert {ex.metadata["records"] for ex in examples} >= {MIN_RECORDS, MAX_RECORDS}
    assert {ex.metadata["colors"] for ex in examples} == set(range(1, MAX_COLORS + 1))


def test_colours_and_names_are_one_token_of_make_fulls_tokenizer():
    # the needles are a tenth of the records: too rare a colour is split by the BPE trained on the whole mixture
    tok = train_tokenizer(corpus("full", 2000), 1024)
    assert all(len(tok(f" {w}", add_special_tokens=False)["input_ids"]) == 1 for w in (*COLORS, *NAMES))


def test_long_context_gold_asks_the_same_questions_scored_by_exact_match():
    judged, gold = load_task("long_context", {"heldout": 30})["heldout"], load_task("long_context_gold",
                                                                                    {"heldout": 30})["heldout"]
    assert [(e.prompt, e.answer) for e in judged] == [(e.prompt, e.answer) for e in gold]
    assert {e.domain for e in gold} == {"exact_answer"}
    exact = registry.VERIFIERS["exact_answer"]
    for e in gold:
        assert exact("<think>\n" + e.solution, e.answer, e.metadata) == 1.0  # the worked solution: its value
        assert exact(f"<think>\nx\n</think>\n\n{e.answer}.", e.answer, e.metadata) == 1.0
        # a sentence (what the tiny judge passed), another colour, an unclosed <think>: 0
        assert exact(f"<think>\nx\n</think>\n\nThe color of Zac is {e.answer}.", e.answer, e.metadata) == 0.0
        other = next(c for c in COLORS if c != e.answer)
        assert exact(f"<think>\nx\n</think>\n\n{other}", e.answer, e.metadata) == 0.0
        assert exact(f"<think>\n{e.answer}", e.answer, e.metadata) == 0.0


def test_one_needle_documents_ask_for_their_only_colour():
    for ex in load_task("long_context", {"rl": 40}, max_colors=1)["rl"]:
        assert ex.metadata["colors"] == 1 and sum(c in ex.question.split() for c in (f"{c}." for c in COLORS)) == 1
    with pytest.raises(ValueError, match="max_colors"):
        load_task("long_context", {"rl": 1}, max_colors=0)


def test_long_context_length_is_a_parameter():
    short = load_task("long_context", {"rl": 50}, min_records=2, max_records=5)["rl"]
    assert {ex.metadata["records"] for ex in short} == {2, 3, 4, 5}
    # the SFT warm-up task: the same rows on short documents
    warmup = load_task("long_context_short", {"sft": 200})["sft"]
    assert {ex.metadata["records"] for ex in warmup} == set(range(MIN_RECORDS, SHORT_RECORDS + 1))
    assert {ex.domain for ex in warmup} == {"llm_judge"} and {ex.instruction for ex in warmup} == {LC_INSTRUCTION}
    with pytest.raises(ValueError, match="max_records"):
        load_task("long_context", {"rl": 1}, max_records=len(NAMES) + 1)


def test_long_context_fills_but_fits_the_context(splits, lengths):
    examples = [ex for exs in splits["long_context"].values() for ex in exs]
    # the longest document with every record of one kind and value, for each (the widest in tokens is the worst)
    worst = [_long_context(Document(tuple((kind, name, v) for name in NAMES[:MAX_RECORDS]), MAX_RECORDS - 1), 0)
             for kind, values in [("color", COLORS), *HAY.items()] for v in values]
    measured = lengths("long_context", [*examples, *worst])
    prompts = sorted(p for p, _ in measured)
    assert prompts[-1] <= CONTEXT - 96 and max(p + r for p, r in measured) <= CONTEXT  # the cascade's 96-token budget
    assert prompts[len(prompts) // 2] > 180 and prompts[0] < 80  # short and long documents


def test_the_llm_judge_sees_the_question_not_the_document(splits, judge_server, monkeypatch):
    ex = splits["long_context"]["heldout"][0]
    # every answer to the judge, the reference itself too (by default that one is decided without a call)
    monkeypatch.setitem(registry.SETTINGS, "judge", {**judge_server.settings, "exact_match": False})
    # what the orchestrator hands a verifier: the last user message as "question", the row's metadata winning
    metadata = {"question": ex.prompt, **ex.metadata}
    assert registry.VERIFIERS["llm_judge"]("<think>\n" + ex.solution, ex.answer, metadata) == 1.0
    (sent,) = judge_server.prompts
    assert sent == fill(QA_TEMPLATE, question=ex.metadata["question"], reference=ex.answer, answer=ex.answer)
    assert "The color of" not in sent


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

GOOD = {"name": "Ada", "kind": "good", "event": "passed my exam"}
BAD = {"name": "Ada", "kind": "bad", "event": "lost my job"}


@pytest.mark.parametrize("meta, answer, quality", [
    (GOOD, "Congratulations, Ada!", 5),
    (BAD, "Oh no, Ada, I am sorry.", 5),
    (GOOD, "Well done, Ada! Thank you for telling me.", 4),
    (GOOD, "Congratulations on this wonderful day, Ada, and on all of your work!", 4),  # one long sentence
    (GOOD, "Great news, Ada! Thank you for telling me. Let me know if I can help.", 3),
    (BAD, "Sorry to hear that, Ada. " + " ".join(FILLERS[:3]), 2),
    (GOOD, "Congratulations!", 2),  # not addressed
    (GOOD, "Hello, Ada.", 2),  # no sentiment
    (GOOD, "Congratulations, Bob!", 1),  # another person's name
    (GOOD, "Congratulations, Ada and Bob!", 1),
    (GOOD, "Sorry to hear that, Ada.", 1),  # the wrong sentiment
    (BAD, "Well done, Ada!", 1),
    (GOOD, "", 1),
    (GOOD, "   ", 1),
    (GOOD, None, 1),  # no final answer
])
def test_chat_quality(meta, answer, quality):
    assert chat_quality(meta, answer) == quality


def test_sentences():
    assert [sentences(t) for t in ("Hi.", "Hi! Bye.", "Hi. and then", "...", "Oh no, Ada, I am sorry.")] == [1, 2, 2, 0, 1]


def test_chat_rows(splits):
    examples = [ex for exs in splits["chat"].values() for ex in exs]
    for ex in examples:
        meta = ex.metadata
        assert ex.prompt == f"{ex.question} {INSTRUCTION}" and f"I am {meta['name']}. " in ex.question
        assert meta["event"] in ex.question and meta["kind"] in ("good", "bad")
        assert chat_quality(meta, ex.answer) == 3 and sentences(ex.answer) == 1 + BASELINE_FILLERS  # the baseline
        reasoning = ex.solution.split("\n</think>")[0]
        assert reasoning.startswith(meta["name"] + " ") and reasoning.endswith(f": {meta['kind']} news.")
        assert chat_quality(meta, _final(ex.solution)) >= 2  # right name and sentiment: at worst padded
    sft = [chat_quality(ex.metadata, _final(ex.solution)) for ex in splits["chat"]["sft"]]
    assert 0.4 < sft.count(5) / len(sft) < 0.6 and {2, 3, 4, 5} == set(sft)  # half concise, half verbose
    assert Counter(ex.metadata["kind"] for ex in examples).keys() == {"good", "bad"}


def test_chat_fits_the_context(splits, lengths):
    measured = lengths("chat", [ex for exs in splits["chat"].values() for ex in exs])
    assert max(p for p, _ in measured) <= 64 and max(r for _, r in measured) <= 80


# ---------------------------------------------------------------------------------------------
# The judge's data
# ---------------------------------------------------------------------------------------------

def _replies(prompt: str) -> tuple[str, str, str]:
    conv, r1, r2 = (re.search(rf"<{tag}>\n(.*?)\n</{tag}>", prompt, re.S).group(1)
                    for tag in ("conversation", "response_1", "response_2"))
    return conv, r1, r2


def _news(conversation: str) -> dict:
    name = re.search(r"I am (\w+)\.", conversation).group(1)
    kind = "good" if any(e in conversation for e, _ in GOOD_EVENTS) else "bad"
    return {"name": name, "kind": kind}


def test_judge_pairs_verdicts_parse_to_the_gold(splits):
    examples = [ex for exs in splits["judge_pairs"].values() for ex in exs]
    orders = Counter()
    for ex in examples:
        conv, r1, r2 = _replies(ex.prompt)
        assert [{"role": "user", "content": ex.prompt}] == pair_messages(conv, r1, r2, TEMPLATE)
        q1, q2 = chat_quality(_news(conv), r1), chat_quality(_news(conv), r2)
        assert (ex.metadata["score_1"], ex.metadata["score_2"]) == (q1, q2)
        assert _final(ex.solution) == pair_verdict(q1, q2) and ex.answer == _final(ex.solution)
        assert parse_preference(ex.solution) == pytest.approx(gold_preference(q1, q2)) == ex.metadata["preference"]
        assert parse_preference("<think>\n" + ex.solution) == pytest.approx(gold_preference(q1, q2))
        orders[(q1, q2)] += 1
    assert {gold_preference(a, b) for a, b in orders} == {0.0, 0.25, 0.5, 0.75, 1.0}
    assert sum(n for (a, b), n in orders.items() if a == b) > 0.1 * len(examples)  # ties
    common = [(a, b) for (a, b), n in orders.items() if a != b and n + orders[(b, a)] >= 10]
    assert len(common) >= 12 and all(orders[(b, a)] for a, b in common)  # both orders of each kind of pair
    kinds = Counter(k for ex in examples for k in ex.metadata["kinds"])
    assert kinds.keys() == REPLY_KINDS.keys()


def test_judge_pairs_prompt_is_what_score_group_sends(splits):
    for ex in splits["judge_pairs"]["sft"][:50]:
        conv, r1, r2 = _replies(ex.prompt)
        client = Recorder(ex.solution)
        responses = [f"<think>\nhm\n</think>\n\n{r1}", r2 + "\n"]
        scores = asyncio.run(score_group(client, conv, responses, GenRMConfig(template=TEMPLATE)))
        assert client.messages == [[{"role": "user", "content": ex.prompt}]]
        assert scores.quality[0] == pytest.approx(ex.metadata["preference"])


def test_judge_qa_verdicts_and_prompts(splits):
    examples = [ex for exs in splits["judge_qa"].values() for ex in exs]
    for ex in examples:
        assert parse_correctness(ex.solution) is ex.metadata["correct"] and ex.answer == _final(ex.solution)
        q = re.search(r"Question:\n(.*)\n\nReference answer:\n(.*)\n\nModel's answer:\n(.*)\n\nReason", ex.prompt, re.S)
        question, reference, answer = q.groups()
        assert ex.prompt == fill(QA_TEMPLATE, question=question, reference=reference, answer=answer)
        if ex.metadata["correct"]:
            assert reference in answer and " or " not in answer
        elif ex.metadata["kind"] == "hedge":
            other = re.fullmatch(rf"{reference} or (\w+)", answer).group(1)
            assert other in COLORS and other != reference
        elif ex.metadata["kind"] in ("sentence", "it_is", "possessive"):  # the right colour, not alone as asked
            assert reference in re.findall(r"\w+", answer) and question.endswith(" Reply with the color only.")
        else:  # no word of the answer is the reference (a typo is one letter off it, never another colour)
            assert reference not in re.findall(r"\w+", answer)
            if ex.metadata["kind"] == "typo":
                assert len(answer) == len(reference) and sum(a != b for a, b in zip(answer, reference)) == 1
        if answer:  # judge_answer sends exactly this prompt for that final answer
            client = Recorder(ex.solution)
            got = asyncio.run(judge_answer(client, question, f"<think>\nx\n</think>\n\n{answer}", reference))
            assert client.messages == [[{"role": "user", "content": ex.prompt}]]
            assert got[0] == float(ex.metadata["correct"])
    kinds = Counter(ex.metadata["kind"] for ex in examples)
    assert kinds.keys() == RIGHT_KINDS.keys() | WRONG_KINDS.keys()
    assert 0.08 < sum(ex.metadata["correct"] for ex in examples) / len(examples) < 0.25  # RIGHT_SHARE: 0.15


def test_judge_prompts_fit_the_judges_context(splits, lengths):
    examples = [ex for name in ("judge_pairs", "judge_qa") for exs in splits[name].values() for ex in exs]
    longest = max(splits["chat"]["sft"], key=lambda ex: len(ex.prompt))
    worst_reply = "Sorry to hear that, Ada. " + " ".join(sorted(FILLERS, key=len)[-3:])
    worst = pair_messages(longest.prompt, worst_reply, worst_reply, TEMPLATE)[0]["content"]
    worst_ex = JudgeExample(worst, "", "genrm", examples[0].solution, "")
    measured = lengths("judge", [*examples, worst_ex])
    assert max(p + r for p, r in measured) <= CONTEXT


class Recorder:
    """Duck-types ``ChatClient.chat``: records the messages, answers a fixed reply."""

    def __init__(self, reply: str) -> None:
        self.reply, self.messages = reply, []

    async def chat(self, messages, max_tokens=None) -> ChatResult:
        self.messages.append(messages)
        return ChatResult(self.reply, "stop")


# ---------------------------------------------------------------------------------------------
# genrm against a baseline: a real HTTP judge answering the gold's verdicts
# ---------------------------------------------------------------------------------------------

class GoldJudge:
    """An OpenAI-compatible chat server in a thread: pair prompts get ``pair_verdict`` of the gold qualities
    (or ``always``, when set), QA prompts ``[[CORRECT]]`` when the answer is the reference."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.connections: list[tuple] = []  # each request's client address: one per connection
        self.always: str | None = None
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as samplers/chat_server.py and vLLM

            def do_POST(self):
                judge.connections.append(self.client_address)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = judge.answer(body["messages"][0]["content"])
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.settings = {"base_url": self.url, "model": "judge", "api_key_env": "", "retries": 0, "timeout_s": 10}

    def answer(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.always is not None:
            return self.always
        if "<response_1>" in prompt:
            conv, r1, r2 = _replies(prompt)
            news = _news(conv)
            return "\n</think>\n\n" + pair_verdict(chat_quality(news, r1), chat_quality(news, r2))
        q = re.search(r"Reference answer:\n(.*)\n\nModel's answer:\n(.*)\n\nReason", prompt, re.S)
        return "[[CORRECT]]" if q.group(1) == q.group(2) else "[[INCORRECT]]"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge_server():
    judge = GoldJudge()
    yield judge
    judge.close()


def test_judge_against_reference_judges_both_orders(splits, judge_server):
    ex = splits["chat"]["heldout"][0]
    concise = f"Congratulations, {ex.metadata['name']}!" if ex.metadata["kind"] == "good" else \
        f"Sorry to hear that, {ex.metadata['name']}."
    wrong = concise.replace(ex.metadata["name"], next(n for n in NAMES if n != ex.metadata["name"]))

    async def score(response, cfg=GenRMConfig()):
        async with ChatClient(JudgeEndpoint(judge_server.url, "judge", api_key_env="", retries=0)) as client:
            return await judge_against_reference(client, ex.prompt, response, ex.answer, cfg)

    assert asyncio.run(score(f"<think>\nok\n</think>\n\n{concise}\n")) == 1.0  # 5 vs the baseline's 3
    pairs = [_replies(p)[1:] for p in judge_server.prompts]
    assert sorted(pairs) == sorted([(concise, ex.answer), (ex.answer, concise)])
    assert all(_replies(p)[0] == ex.prompt for p in judge_server.prompts)
    assert asyncio.run(score(ex.answer)) == 0.5  # the baseline ties itself
    assert asyncio.run(score(f"<think>\n</think>\n\n{ex.answer} And {FILLERS[0]}")) == pytest.approx(0.25)  # 2 vs 3
    assert asyncio.run(score(wrong)) == 0.0
    judge_server.always = "[[A]]"  # a judge that always prefers the first position: cancelled out
    assert asyncio.run(score(concise, GenRMConfig(both_orders=False))) == 0.5
    judge_server.always = "ĠĠ 7"  # unreadable: a tie
    assert asyncio.run(score(concise)) == 0.5
    calls = len(judge_server.prompts)
    for no_answer in ("<think>\nCongratulations, never closed", "<think>\nhm\n</think>\n\n  "):
        assert asyncio.run(score(no_answer)) == 0.0
    assert len(judge_server.prompts) == calls  # without a call


def test_genrm_eval_verifier(splits, judge_server, monkeypatch):
    assert "genrm" in registry.EVAL_VERIFIERS and "genrm" in registry.GROUP_VERIFIERS
    verify = registry.EVAL_VERIFIERS["genrm"]
    monkeypatch.setitem(registry.SETTINGS, "judge", judge_server.settings)
    rows = splits["chat"]["heldout"][:8]
    for ex in rows:  # the worked solutions: concise ones beat the baseline, verbose ones tie or lose
        metadata = {"question": ex.prompt, **ex.metadata}
        quality = chat_quality(ex.metadata, _final(ex.solution))
        assert verify("<think>\n" + ex.solution, ex.answer, metadata) == pytest.approx(gold_preference(quality, 3))
    assert len(judge_server.prompts) == 2 * len(rows)
    # both orders in flight at once, over two connections this thread's client keeps for every row (llm_judge.py
    # ``on_judge``), not a connection per call
    assert len(set(judge_server.connections)) <= 2
    assert verify("<think>\nunfinished", rows[0].answer, {"question": rows[0].prompt}) == 0.0
    assert len(judge_server.prompts) == 2 * len(rows)
    with pytest.raises(ValueError, match="baseline"):
        verify("<think>\n</think>\n\nHi", "", {"question": rows[0].prompt})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(registry.SETTINGS, "judge", {**judge_server.settings, "base_url": f"http://127.0.0.1:{port}"})
    with pytest.raises(JudgeError, match="ConnectError"):
        verify("<think>\n</think>\n\nCongratulations, Ada!", rows[0].answer, {"question": rows[0].prompt})
    assert issubclass(JudgeError, VerifierUnavailable)  # the worker fails the group, never scores it 0

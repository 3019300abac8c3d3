"""The tool task (tool-integrated reasoning in miniature): its values, its multi-turn SFT traces as the token ids a
rollout has, the python tool printing exactly the trace's tool turn, the same held-out questions with and
without the tool, its data files, SFT on them; and the single-turn tasks exactly as they were before it."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cascade_rl.data.arithmetic import TOOL_INSTRUCTION
from cascade_rl.data.builtin import example_row, write_task_files
from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import parse_row
from cascade_rl.data.sources import DataError
from cascade_rl.data.tasks import (
    MIXES,
    TASKS,
    TURN_PREFIX,
    Example,
    domains,
    load_task,
)
from cascade_rl.environments.tool_calls import ToolCall, parse_tool_calls
from cascade_rl.learner.sft import SFTConfig, SFTRow, encode_examples, encode_trace, read_sft_rows, run_sft
from cascade_rl.learner.tiny_model import corpus
from cascade_rl.verifiers.registry import VERIFIERS, check_row

SIZES = {"heldout": 64, "rl": 200, "sft": 300}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    """A tiny model whose tokenizer is trained on the tool task's text (``make-tiny-model --task tools``)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-tools", arch="qwen3", task="tools"))


@pytest.fixture(scope="module")
def tools_data(tmp_path_factory) -> dict[str, dict[str, str]]:
    """``cascade-rl make-data tools``: {split: {task: path}}."""
    return write_task_files("tools", tmp_path_factory.mktemp("data"), {"heldout": 8, "rl": 40, "sft": 64})


def _expression(ex: Example) -> str:
    return re.fullmatch(r"Calculate (.*)\.", ex.question).group(1)


def test_values_are_pythons_and_the_questions_multiply():
    examples = [ex for split in load_task("tool_arithmetic", SIZES).values() for ex in split]
    for ex in examples:
        expression = _expression(ex)
        terms = expression.split()[::2]
        assert len(terms) == 3 and "*" in expression and all(0 <= int(t) <= 1000 for t in terms)
        assert ex.answer == str(eval(expression))  # the usual precedence, as the tool computes it
    assert sum(len(t) >= 2 for ex in examples for t in _expression(ex).split()[::2]) > 0.9 * 3 * len(examples)


def test_the_prompt_and_the_trace_of_one_example():
    ex = load_task("tool_arithmetic", {"heldout": 1})["heldout"][0]
    assert ex.prompt == "Calculate 48 * 95 * 59. Use the python tool. Put the final answer in \\boxed{}."
    assert (ex.answer, ex.domain, ex.env, ex.metadata) == ("269040", "tool_use", "python", {})
    assert ex.turns == (
        {"role": "assistant", "content": '<think>\n\n</think>\n\n<tool_call>{"name": "python", "arguments": '
                                         '{"code": "print(48 * 95 * 59)"}}</tool_call>'},
        {"role": "tool", "content": "269040\n"},
        {"role": "assistant", "content": "<think>\n\n</think>\n\n\\boxed{269040}"},
    )
    assert ex.solution == "\n</think>\n\n\\boxed{269040}"  # the last turn after the generation prompt
    direct = load_task("tool_arithmetic_direct", {"heldout": 1})["heldout"][0]
    assert direct.prompt == "Calculate 48 * 95 * 59. Put the final answer in \\boxed{}."
    assert (direct.answer, direct.domain, direct.env, direct.turns) == ("269040", "math", "", ())
    assert direct.solution == "\n</think>\n\n\\boxed{269040}"
    assert hash(ex) == hash(Example(ex.question, ex.answer, ex.domain, ex.solution, ex.instruction, {}, ex.turns,
                                    ex.env))  # Examples stay hashable


def test_traces_call_the_tool_and_score_one():
    for ex in load_task("tool_arithmetic", {"sft": 200}, seed=3)["sft"]:
        call, result, answer = ex.turns
        assert [m["role"] for m in ex.turns] == ["assistant", "tool", "assistant"]
        assert ex.instruction == TOOL_INSTRUCTION and ex.prompt == f"{ex.question} {TOOL_INSTRUCTION}"
        assert call["content"].startswith(TURN_PREFIX) and answer["content"] == TURN_PREFIX + ex.solution
        assert parse_tool_calls(call["content"]) == [ToolCall("python", {"code": f"print({_expression(ex)})"})]
        assert parse_tool_calls(answer["content"]) == []  # the answer turn calls nothing: the episode ends
        assert result["content"] == f"{ex.answer}\n"
        score = VERIFIERS[ex.domain]
        assert score(answer["content"], ex.answer, {}) == 1.0
        assert score(call["content"], ex.answer, {}) == 0.0  # the call is no answer
        assert score(TURN_PREFIX + f"\n</think>\n\n\\boxed{{{int(ex.answer) + 1}}}", ex.answer, {}) == 0.0
        assert check_row(ex.domain, ex.answer, ex.metadata) == ""


def test_the_tool_code_prints_exactly_the_tool_turn():
    examples = load_task("tool_arithmetic", {"sft": 12}, seed=1)["sft"]
    for ex in examples:
        (call,) = parse_tool_calls(ex.turns[0]["content"])
        out = subprocess.run([sys.executable, "-c", call.arguments["code"]], capture_output=True, text=True,
                             check=True, timeout=30)
        assert out.stdout == ex.turns[1]["content"] and out.stderr == ""


def test_the_python_environment_answers_with_the_tool_turn():
    """The rows' environment (environments/, in the sandbox) runs the trace's call: its observation is the trace's
    tool turn, and the answer turn, calling nothing, ends the episode."""
    from cascade_rl.environments.base import ToolUnavailable
    from cascade_rl.environments.registry import build_environment

    env = build_environment("python")
    for ex in load_task("tool_arithmetic", {"sft": 3}, seed=1)["sft"]:
        conversation = _conversation(ex)
        try:
            step = env.step(conversation[:2], {}, {})
        except ToolUnavailable as e:
            pytest.skip(f"the sandbox cannot start here: {e}")
        assert not step.done and step.tool_messages == [ex.turns[1]] and step.tool_errors == 0
        assert env.step(conversation, step.state, {}).done


def test_held_out_questions_coincide_with_and_without_the_tool():
    tool, direct = load_task("tool_arithmetic", SIZES, seed=2), load_task("tool_arithmetic_direct", SIZES, seed=2)
    for split in SIZES:
        assert [ex.question for ex in tool[split]] == [ex.question for ex in direct[split]]
        assert [ex.answer for ex in tool[split]] == [ex.answer for ex in direct[split]]
    mix = load_task("tools", {"heldout": 64, "rl": 80, "sft": 80}, seed=2)
    by_domain = {d: [ex.question for ex in mix["heldout"] if ex.domain == d] for d in ("tool_use", "math")}
    assert by_domain["tool_use"] == by_domain["math"] == [ex.question for ex in tool["heldout"]]
    held = set(by_domain["math"])
    assert not held & {ex.question for ex in mix["rl"] + mix["sft"]}
    assert [ex.domain for ex in mix["sft"]].count("tool_use") == 60  # weights 3:1
    assert domains("tools") == ["tool_use", "math"] and MIXES["tools"] == {"tool_arithmetic": 3,
                                                                            "tool_arithmetic_direct": 1}
    assert TASKS["tool_arithmetic"].stream == TASKS["tool_arithmetic_direct"].stream


def _digest(examples: list[Example]) -> str:
    fields = [[e.question, e.answer, e.domain, e.solution, e.prompt, e.instruction, e.metadata] for e in examples]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def test_the_single_turn_tasks_are_unchanged(tmp_path):
    """Recorded with the code before the tool tasks: the same Examples, mixtures, tokenizer corpus and files."""
    recorded = {
        "arithmetic_mcqa": {"heldout": "fa97c444b878fe74", "rl": "12b8b84516acda77", "sft": "fa49abe262a983c4"},
        "arithmetic_json": {"heldout": "68732f393f4f920f", "rl": "54b69e50b68a9426", "sft": "40cf945fb5a8b2bd"},
        "arithmetic_if": {"heldout": "cb92132e1b5f5cac", "rl": "44c72030d083ab08", "sft": "7307231920d1102e"},
        "cascade": {"heldout": "b4d1c26664ce0166", "rl": "19433f5e4f0d9c5e", "sft": "64046f3800fe0566"},
    }
    for name, digests in recorded.items():
        splits = load_task(name, {"heldout": 64, "rl": 400, "sft": 800})
        assert {sp: _digest(exs) for sp, exs in splits.items()} == digests, name
        assert all(ex.turns == () and ex.env == "" for exs in splits.values() for ex in exs)
    multi = load_task("multi_domain", {"heldout": 64, "rl": 400, "sft": 800}, seed=1)
    assert {sp: _digest(exs) for sp, exs in multi.items()} == {
        "heldout": "70a3b2b286ddeb64", "rl": "3a970dbdd629cf5c", "sft": "98bdd68a4186941a"}
    corpus_digest = hashlib.sha256(json.dumps(corpus("cascade", 2000), sort_keys=True).encode()).hexdigest()[:16]
    assert corpus_digest == "117c514db053153e"
    files = write_task_files("cascade", tmp_path, {"heldout": 16, "rl": 300, "sft": 32})
    assert {t: hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for t, p in files["sft"].items()} == {
        "arithmetic": "f7e1d49af4032d82", "arithmetic_mcqa": "38d7235f01853b91",
        "arithmetic_json": "9508f529a5cffcfa", "arithmetic_if": "dbfe219ff3e57ec9"}
    assert hashlib.sha256(Path(files["rl"]["arithmetic_if"]).read_bytes()).hexdigest()[:16] == "12edc7b8a1189c2d"


def test_make_data_tools_writes_env_and_traces(tools_data):
    assert set(tools_data) == {"heldout", "rl", "sft"}
    for by_task in tools_data.values():
        assert set(by_task) == {"tool_arithmetic", "tool_arithmetic_direct"}
        tool = [json.loads(line) for line in Path(by_task["tool_arithmetic"]).read_text().splitlines()]
        direct = [json.loads(line) for line in Path(by_task["tool_arithmetic_direct"]).read_text().splitlines()]
        assert [r["prompt"].split(". ")[0] for r in tool] == [r["prompt"].split(". ")[0] for r in direct]
        for r in tool:
            assert list(r) == ["id", "prompt", "domain", "answer", "metadata", "env", "response"]
            assert (r["domain"], r["env"], r["metadata"]) == ("tool_use", "python", {})
            assert [m["role"] for m in r["response"]] == ["assistant", "tool", "assistant"]
            row = parse_row(r)
            assert (row.env, row.domain) == ("python", "tool_use") and check_row(row.domain, row.answer, {}) == ""
        for r in direct:
            assert list(r) == ["id", "prompt", "domain", "answer", "metadata", "response"]
            assert r["domain"] == "math" and isinstance(r["response"], str)
    manifest = json.loads((Path(tools_data["sft"]["tool_arithmetic"]).parents[1] / "manifest.json").read_text())
    assert manifest["name"] == "tools"


def test_the_tokenizer_keeps_tool_call_tags_and_covers_the_traces(tools_model):
    tok = AutoTokenizer.from_pretrained(tools_model)
    ex = load_task("tool_arithmetic", {"heldout": 1})["heldout"][0]
    ids = tok(ex.turns[0]["content"], add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces.count("<tool_call>") == pieces.count("</tool_call>") == 1  # one added token each
    assert tok.decode(ids, skip_special_tokens=True) == ex.turns[0]["content"]
    assert len(ids) <= 48  # a call fits the tiny model's ~64-token turn
    text = "".join(corpus("tools", 100))
    assert "<|im_start|>tool\n" in text and '"arguments": {"code": "print(' in text and TOOL_INSTRUCTION in text


def _conversation(ex: Example) -> list[dict]:
    return [{"role": "user", "content": ex.prompt}, *ex.turns]


def test_sft_ids_are_the_templates_and_the_mask_the_generated_turns(tools_model):
    tok = AutoTokenizer.from_pretrained(tools_model)
    render = PromptRenderer(tok, thinking=True)
    eos = tok.eos_token_id
    for ex in load_task("tool_arithmetic", {"sft": 100}, seed=4)["sft"]:
        ids, mask = encode_trace(render, ({"role": "user", "content": ex.prompt},), ex.turns)
        full = tok.apply_chat_template(_conversation(ex), tokenize=True, enable_thinking=True)["input_ids"]
        # the whole conversation tokenised at once, up to the last end-of-turn (the template closes it with "\n")
        assert ids == full[: len(ids)] and tok.decode(full[len(ids):]) == "\n" and ids[-1] == eos
        # the prompt's ids are the sampler's: the first turn continues them
        prompt_ids = render.ids([{"role": "user", "content": ex.prompt}])
        assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
        # the mask: exactly each assistant turn's generated text (after "<think>\n") and its <|im_end|>
        runs, run = [], []
        for i, m in zip(ids, mask):
            if m:
                run.append(i)
            elif run:
                runs.append(run)
                run = []
        runs.append(run)
        wanted = [m["content"].removeprefix(render.prefix) for m in ex.turns if m["role"] == "assistant"]
        assert [tok.decode(r[:-1]) for r in runs] == wanted and all(r[-1] == eos for r in runs)
        assert [r[:-1] for r in runs] == [tok(w, add_special_tokens=False)["input_ids"] for w in wanted]
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert f"<|im_start|>tool\n{ex.answer}\n<|im_end|>" in unmasked  # the tool turn is never learned


def test_single_turn_rows_encode_as_before(tools_model):
    tok = AutoTokenizer.from_pretrained(tools_model)
    render = PromptRenderer(tok, thinking=True)
    prompt = ({"role": "user", "content": "Calculate 1 + 2. Put the final answer in \\boxed{}."},)
    response = "1 + 2 = 3\n</think>\n\n\\boxed{3}"
    ((ids, mask),) = encode_examples(tok, [(prompt, response)])
    p_ids = render.ids(prompt)
    assert ids == p_ids + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mask == [False] * len(p_ids) + [True] * (len(ids) - len(p_ids))


def _write(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_bad_traces_are_reported_as_file_line_reason(tools_model, tmp_path):
    fields = SFTConfig().fields
    ok = example_row(load_task("tool_arithmetic", {"sft": 1})["sft"][0], "x")
    call, result, answer = ok["response"]
    bad = _write(tmp_path / "bad.jsonl", [
        ok,
        {**ok, "response": []},
        {**ok, "response": [call, result]},
        {**ok, "response": [result, answer]},
        {**ok, "response": [call, answer]},
        {**ok, "response": [call, {"role": "user", "content": "hi"}, answer]},
        {**ok, "response": [call, {"role": "tool"}, answer]},
        {**ok, "response": [call, result, {"role": "assistant", "content": " "}]},
    ])
    with pytest.raises(DataError) as e:
        read_sft_rows([bad], fields)
    lines = str(e.value).splitlines()[1:]
    assert [line.split(": ")[0] for line in lines] == [f"{bad}:{n}" for n in range(2, 9)]
    assert "empty list of messages" in lines[0]
    assert "starts and ends with an assistant turn" in lines[1] and "starts and ends" in lines[2]
    assert "two assistant turns in a row" in lines[3]
    assert "role 'user' is not one of assistant, tool" in lines[4]
    assert "string 'role' and 'content'" in lines[5] and "the assistant turn is empty" in lines[6]
    # a content without the generation prompt's "<think>\n" is not what the model's turn renders as: found when
    # the rows are encoded with the model's template, still as FILE:LINE
    stripped = {**ok, "response": [{**call, "content": call["content"].removeprefix(TURN_PREFIX)}, result, answer]}
    rows = read_sft_rows([_write(tmp_path / "prefix.jsonl", [ok, stripped])], fields)
    assert [len(r) for r in rows] == [3, 3] and isinstance(rows[0], SFTRow) and rows[0].response == tuple(ok["response"])
    tok = AutoTokenizer.from_pretrained(tools_model)
    with pytest.raises(DataError, match=rf"{tmp_path / 'prefix.jsonl'}:2: response message 0: the assistant content "
                                        r"must be the whole turn, from the generation prompt's '<think>\\n' on"):
        encode_examples(tok, rows)


def test_sft_runs_on_the_tool_files(tools_model, tools_data, tmp_path):
    files = list(tools_data["sft"].values())
    out = run_sft(SFTConfig(model=tools_model, out=str(tmp_path / "sft"), files=files, steps=3, batch_size=8))
    assert out["steps"] == 3 and out["final_loss"] > 0 and (tmp_path / "sft" / "config.json").is_file()

"""Task data: real reasoning-gym problems, disjoint splits, correct worked solutions, mixtures, the tiny model's
tokenizer. Every task's solutions are scored by its domain's real verifier."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import pytest
from transformers import AutoConfig, AutoTokenizer

from cascade_rl.data.arithmetic import IF_INSTRUCTIONS, MCQA_LETTERS
from cascade_rl.data.tasks import (
    MIXES,
    TASKS,
    Example,
    domains,
    held_out_questions,
    load_mixture,
    load_task,
    shares,
)
from cascade_rl.learner.tiny_model import corpus
from cascade_rl.verifiers.math import score_math
from cascade_rl.verifiers.registry import VERIFIERS

NEW_TASKS = ("arithmetic_mcqa", "arithmetic_json", "arithmetic_if")
SIZES = {"heldout": 64, "rl": 400, "sft": 800}


def test_splits_are_question_disjoint_and_sized():
    splits = load_task("arithmetic", {"heldout": 100, "rl": 300, "sft": 500}, seed=3)
    questions = {name: {ex.question for ex in exs} for name, exs in splits.items()}
    assert {k: len(v) for k, v in questions.items()} == {"heldout": 100, "rl": 300, "sft": 500}
    assert not questions["heldout"] & questions["rl"]
    assert not questions["heldout"] & questions["sft"]
    assert not questions["rl"] & questions["sft"]


def test_splits_are_stable_prefixes():
    """A smaller held-out/RL request keeps the same questions, so SFT never sees a later RL prompt."""
    big = load_task("arithmetic", {"heldout": 200, "rl": 2000, "sft": 100})
    small = load_task("arithmetic", {"heldout": 16, "rl": 500})
    assert [e.question for e in small["heldout"]] == [e.question for e in big["heldout"][:16]]


def test_worked_solutions_are_correct_and_score_one():
    for ex in load_task("arithmetic", {"sft": 200})["sft"]:
        expression = re.fullmatch(r"Calculate (.*)\.", ex.question).group(1)
        assert str(eval(expression)) == ex.answer  # the question is plain +/- integer arithmetic
        for step in ex.solution.split("\n</think>")[0].splitlines():
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)
        assert score_math("<think>\n" + ex.solution, ex.answer) == 1.0
        assert ex.prompt.endswith("\\boxed{}.") and ex.domain == "math"


def test_unknown_task_and_impossible_sizes_are_refused():
    with pytest.raises(KeyError):
        load_task("nope", {"rl": 1})
    with pytest.raises(ValueError, match="too few distinct questions"):
        load_task("arithmetic", {"rl": 10_000}, min_terms=2, max_terms=2)  # only 242 distinct 2-term questions


def test_tiny_model_directory(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.vocab_size >= len(tok)
    # thinking mode: the generation prompt ends with "<think>\n"; non-thinking emits an empty block
    think = tok.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True, tokenize=False)
    assert think.endswith("<|im_start|>assistant\n<think>\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True, tokenize=False,
                                    enable_thinking=False)
    assert plain.endswith("<think>\n\n</think>\n\n")
    # digits are one token each; </think> survives decoding without special tokens
    ids = tok("12345 </think>", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids[:5]] == list("12345")
    assert "</think>" in tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_token == "<|im_end|>"


def _score(ex: Example, response: str) -> float:
    """The reward the orchestrator asks for: the domain's verifier on the whole turn, with the example's metadata."""
    return VERIFIERS[ex.domain]("<think>\n" + response, ex.answer, {"question": ex.question, **ex.metadata})


def test_arithmetic_is_unchanged():
    """Recorded before Example grew instructions and metadata: the same questions, prompts and solutions."""
    splits = load_task("arithmetic", {"heldout": 50, "rl": 100, "sft": 200}, seed=1)
    ex = splits["heldout"][0]
    assert (ex.question, ex.answer, ex.domain, ex.metadata) == ("Calculate 8 + 2 - 7 + 9.", "12", "math", {})
    assert ex.prompt == "Calculate 8 + 2 - 7 + 9. Put the final answer in \\boxed{}."
    assert ex.solution == "8 + 2 = 10\n10 - 7 = 3\n3 + 9 = 12\n</think>\n\n\\boxed{12}"
    assert [e.question for e in splits["heldout"][1:3]] == ["Calculate 2 - 5 - 3 - 0.", "Calculate 1 - 7 - 8 + 9."]
    assert splits["sft"][0].solution == "7 - 10 = -3\n-3 + 10 = 7\n7 - 3 = 4\n</think>\n\n\\boxed{4}"
    default = load_task("arithmetic", {"heldout": 400, "rl": 2000, "sft": 4000})
    digest = {sp: hashlib.sha256(json.dumps([[e.question, e.answer, e.domain, e.solution, e.prompt] for e in exs])
                                 .encode()).hexdigest()[:16] for sp, exs in default.items()}
    assert digest == {"heldout": "a4dfffd87cd0496e", "rl": "0203cbbff13281fd", "sft": "9e118ef849e9fad5"}


def _corruptions(ex: Example) -> list[str]:
    """Responses that must score 0: the worked solution with a wrong final answer or the instruction missing."""
    reasoning, final = ex.solution.split("\n</think>\n\n")
    head = reasoning + "\n</think>\n\n"
    if ex.domain == "mcqa":
        return [head + f"\\boxed{{{letter}}}" for letter in MCQA_LETTERS if letter != ex.answer]
    if ex.domain == "structured_output":
        key, value = next(iter(json.loads(final).items()))
        other_key = next(k for k in ("result", "value") if k != key)
        return [head + json.dumps({key: value + 1}), head + json.dumps({other_key: value}),
                head + json.dumps({key: value, "unit": "none"}), head + f"\\boxed{{{value}}}"]
    assert ex.domain == "instruction_following"
    return [head + f"\\boxed{{{ex.answer}}}", reasoning]  # the instruction not followed; no answer at all


@pytest.mark.parametrize("name", NEW_TASKS)
def test_solutions_score_one_and_corruptions_zero(name):
    examples = load_task(name, {"sft": 300}, seed=5)["sft"]
    for ex in examples:
        assert ex.domain == TASKS[name].domain and ex.prompt.startswith(ex.question + " ")
        assert _score(ex, ex.solution) == 1.0, ex
        for bad in _corruptions(ex):
            assert _score(ex, bad) == 0.0, (ex, bad)
        steps = ex.solution.split("\n</think>")[0].splitlines()
        expression = re.fullmatch(r"Calculate (.*)\.", ex.question).group(1)
        assert steps[0].split(" = ")[0] == " ".join(expression.split()[:3])  # the worked steps of this question


def test_mcqa_options_are_consecutive_with_the_answer_at_a_uniform_place():
    examples = load_task("arithmetic_mcqa", {"sft": 2000})["sft"]
    for ex in examples[:300]:
        value = int(ex.solution.split("\n</think>")[0].splitlines()[-2].split(" = ")[1])
        options = {letter: int(v) for letter, v in re.findall(r"\(([A-D])\) (-?\d+)", ex.instruction)}
        assert list(options) == list(MCQA_LETTERS) and list(options.values()) == [options["A"] + i for i in range(4)]
        assert options[ex.answer] == value and ex.metadata == {"options": list(MCQA_LETTERS)}
    counts = Counter(ex.answer for ex in examples)
    assert set(counts) == set(MCQA_LETTERS) and min(counts.values()) > 0.2 * len(examples)


def test_json_and_if_draw_every_key_and_instruction():
    keys = Counter(next(iter(ex.metadata["schema"]["properties"])) for ex in load_task("arithmetic_json", {"sft": 500})["sft"])
    assert len(keys) == 5
    ifs = load_task("arithmetic_if", {"sft": 500})["sft"]
    assert Counter(ex.metadata["instruction_id_list"][0] for ex in ifs).keys() == IF_INSTRUCTIONS.keys()
    assert all(len(ex.metadata["kwargs"]) == 1 and f"\\boxed{{{ex.answer}}}" in ex.solution for ex in ifs)


def test_tasks_draw_different_streams_and_are_deterministic():
    first = {name: [ex.question for ex in load_task(name, {"heldout": 64})["heldout"]] for name in TASKS}
    pairs = [(a, b) for a in TASKS for b in TASKS if a < b]
    assert all(len(set(first[a]) & set(first[b])) < 8 for a, b in pairs if TASKS[a].stream != TASKS[b].stream)
    assert all(first[a] == first[b] for a, b in pairs if TASKS[a].stream == TASKS[b].stream)  # the tool tasks
    again = load_task("arithmetic_if", {"heldout": 64})["heldout"]
    assert again == load_task("arithmetic_if", {"heldout": 64})["heldout"]
    assert [ex.question for ex in again] == first["arithmetic_if"]
    other_seed = [ex.question for ex in load_task("arithmetic_if", {"heldout": 64}, seed=1)["heldout"]]
    assert other_seed != first["arithmetic_if"]


def test_examples_stay_hashable():
    ex = load_task("arithmetic_json", {"heldout": 1})["heldout"][0]
    assert ex.metadata and hash(ex) == hash(Example(ex.question, ex.answer, ex.domain, ex.solution, ex.instruction,
                                                   dict(ex.metadata)))


def test_domains_of_tasks_and_mixtures():
    assert domains("arithmetic") == ["math"]
    assert domains("cascade") == ["math", "mcqa", "structured_output", "instruction_following"]
    assert domains("multi_domain") == ["math", "mcqa", "structured_output"]
    assert domains("tools") == ["tool_use", "math"]
    with pytest.raises(KeyError):
        domains("nope")


def test_shares_sum_to_the_total_by_largest_remainder():
    assert shares({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}
    assert shares({"a": 3, "b": 1}, 10) == {"a": 8, "b": 2}  # 7.5 / 2.5: the tie goes to the first member
    assert shares({"a": 0.2, "b": 0.3, "c": 0.5}, 7) == {"a": 1, "b": 2, "c": 4}


def test_mixture_heldout_is_each_tasks_own_whatever_the_mixture():
    cascade = load_task("cascade", SIZES)
    multi = load_task("multi_domain", {"heldout": 64, "rl": 100})
    for name in MIXES["cascade"]:
        own = load_task(name, SIZES)["heldout"]
        assert [ex for ex in cascade["heldout"] if ex.domain == TASKS[name].domain] == own
        if name in MIXES["multi_domain"]:
            assert [ex for ex in multi["heldout"] if ex.domain == TASKS[name].domain] == own
    assert len(cascade["heldout"]) == 4 * SIZES["heldout"]


def test_mixture_splits_are_disjoint_sized_and_proportional():
    mix = load_task("cascade", SIZES)
    assert {sp: len(exs) for sp, exs in mix.items()} == {**SIZES, "heldout": 4 * SIZES["heldout"]}
    for split in ("rl", "sft"):
        counts = Counter(ex.domain for ex in mix[split])
        assert counts == Counter({TASKS[t].domain: n for t, n in shares(MIXES["cascade"], SIZES[split]).items()})
    for name in MIXES["cascade"]:
        own = load_task(name, SIZES)
        per_split = {sp: [ex for ex in exs if ex.domain == TASKS[name].domain] for sp, exs in mix.items()}
        for split in ("rl", "sft"):  # drawn from the task's own split: its guarantees carry over
            assert set(per_split[split]) <= set(own[split])
        questions = {sp: {ex.question for ex in exs} for sp, exs in per_split.items()}
        assert not questions["rl"] & questions["sft"]
    # no question held out by any task (in any format) is trained on
    held_out = {ex.question for ex in mix["heldout"]}
    assert held_out == held_out_questions(SIZES["heldout"]) - {  # the other families ask other questions
        ex.question for name in TASKS if name not in MIXES["cascade"]
        for ex in load_task(name, {"heldout": SIZES["heldout"]})["heldout"]}
    assert not held_out & {ex.question for ex in mix["rl"] + mix["sft"]}
    assert not held_out & {ex.question for ex in load_task("multi_domain", SIZES)["sft"]}


def test_mixture_weights_and_seed():
    weighted = load_mixture({"arithmetic": 3, "arithmetic_json": 1}, {"rl": 200})["rl"]
    assert Counter(ex.domain for ex in weighted) == {"math": 150, "structured_output": 50}
    assert [ex.domain for ex in weighted[:50]].count("math") < 50  # interleaved, not concatenated
    again = load_mixture({"arithmetic": 3, "arithmetic_json": 1}, {"rl": 200})["rl"]
    assert again == weighted
    assert load_mixture({"arithmetic": 3, "arithmetic_json": 1}, {"rl": 200}, seed=1)["rl"] != weighted
    with pytest.raises(KeyError):
        load_mixture({"cascade": 1}, {"rl": 10})  # members are tasks, not mixtures
    with pytest.raises(ValueError):
        load_mixture({"arithmetic": 1, "arithmetic_if": 0}, {"rl": 10})
    with pytest.raises(ValueError, match="no task holds out"):  # nearly all of its own split, minus held-out ones
        load_mixture({"arithmetic": 99, "arithmetic_json": 1}, {"heldout": 400, "rl": 500})


def test_tokenizer_corpus_of_a_mixture_covers_every_domain():
    text = "".join(corpus("cascade", 200))
    assert "Options: (A)" in text and '</think>\n\n{"' in text and "Put the final answer in" in text


def test_sft_trains_on_the_files_of_every_domain(tiny_model, tiny_data, tmp_path):
    from cascade_rl.data.sources import DataError
    from cascade_rl.learner.sft import SFTConfig, read_sft_rows, run_sft

    files = list(tiny_data["sft"].values())
    out = run_sft(SFTConfig(model=tiny_model, out=str(tmp_path / "sft"), files=files, steps=2, batch_size=8))
    assert out["steps"] == 2 and (tmp_path / "sft" / "config.json").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "response": "a"}\n{"prompt": "q"}\n')
    with pytest.raises(DataError, match=f"{bad}:2: SFT needs field 'response'"):
        read_sft_rows([str(bad)], SFTConfig().fields)


def test_inline_mixture_weights_set_the_proportions():
    from cascade_rl.data.tasks import domains, load_task

    split = load_task("arithmetic:3+arithmetic_if", {"heldout": 4, "rl": 40}, seed=0)
    assert [ex.domain for ex in split["rl"]].count("math") == 30
    assert [ex.domain for ex in split["rl"]].count("instruction_following") == 10
    assert domains("arithmetic:3+arithmetic_if") == ["math", "instruction_following"]
    with pytest.raises(KeyError, match="not tasks"):
        domains("arithmetic+nonsense:2")
    with pytest.raises(ValueError, match="not a number"):
        load_task("arithmetic:x", {"rl": 4})

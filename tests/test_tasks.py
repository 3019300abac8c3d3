"""Task data: real reasoning-gym problems, disjoint splits, correct worked solutions, the tiny model's tokenizer."""

from __future__ import annotations

import re

import pytest
from transformers import AutoConfig, AutoTokenizer

from cascade_rl.learner.tasks import load_task
from cascade_rl.verifiers.math import score_math


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

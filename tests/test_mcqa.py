"""The multiple-choice reward in verifiers/mcqa.py: letter extraction, precedence and ambiguity."""

import pytest

from cascade_rl.verifiers.mcqa import boxed_contents, extract_choice, score_mcqa, valid_options

ABCD = {"options": ["A", "B", "C", "D"]}

# --- tier 1: \boxed{} ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Therefore the answer is \\boxed{C}.", "C"),
        ("$\\boxed{\\text{B}}$", "B"),
        ("\\boxed{(D)}", "D"),
        ("\\boxed{\\textbf{(A)}}", "A"),
        ("\\boxed{\\text{\\textbf{C}}}", "C"),
        ("\\boxed{b}", "B"),  # a boxed lower-case letter is unambiguous
        ("\\boxed{B) 9.8 m/s^2}", "B"),  # letter followed by the option text
        ("\\boxed{C. Mitochondria}", "C"),
        ("first \\boxed{A}, checking again... \\boxed{A}", "A"),  # the same letter twice
        ("\\boxed{A} or \\boxed{B}", None),  # hedging between letters
        ("\\boxed{42}", None),  # a box without a letter: no fallback to prose
        ("The answer is (B) so \\boxed{42}", None),  # the box decides, even over an answer phrase
        ("\\boxed{B} and \\boxed{42}", None),
        ("\\boxed{Paris}", None),  # a word, not a letter
    ],
)
def test_boxed(text, expected):
    assert extract_choice(text) == expected


def test_boxed_contents_match_nested_braces_and_skip_unclosed():
    assert boxed_contents("\\boxed{\\text{A}} x \\boxed{\\{1\\}} \\boxed{open") == ["\\text{A}", "\\{1\\}"]


# --- tier 2: answer phrases ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: C", "C"),
        ("The answer is (B).", "B"),
        ("**Final Answer:** D", "D"),
        ("Final answer: **C**", "C"),
        ("The correct option is E.", "E"),
        ("So the best choice is option H", "H"),
        ("The correct answer is: C) 42 kJ/mol", "C"),
        ("I think (B) looks right at first... but final answer: C", "C"),  # last phrase, not first letter
        ("The answer is A because the enthalpy is negative.", "A"),
        ("answer: (c)", "C"),  # lower case in brackets
        ("Answer: c.", "C"),  # lower case ending the sentence
        ("The answer is a bit subtle. Looking again, (D) fits.", "D"),  # "a bit": not an answer
        ("Answer: I believe it is G", "G"),  # "I" as pronoun, then fallback to the last letter
        ("The answer is not A. It is C.", "C"),  # "answer is not" is no phrase: fallback
    ],
)
def test_answer_phrases(text, expected):
    assert extract_choice(text) == expected


# --- tier 3: last standalone capital letter ---------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Option A fails the boundary condition, so it must be\n\nB", "B"),
        ("**(C)**", "C"),
        ("Apples and Bananas: Dogs eat neither.", None),  # A, B, D inside words
        ("I think it is D", "D"),  # the pronoun I is skipped
        ("We get D. A good check confirms it.", "D"),  # the article A is skipped
        ("A is correct.", "A"),  # "A is" names the option
        ("The U.S. uses X-rays. I'm sure.", None),  # abbreviations, hyphenated words, I'm
        ("Comparing F and G, G has the lower energy.", "G"),  # options beyond D
        ("the last one, b", None),  # lower case alone is not a letter
        ("", None),
    ],
)
def test_last_standalone_letter(text, expected):
    assert extract_choice(text) == expected


# --- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, expected",
    [
        ({}, "ABCDEFGHIJ"),
        ({"options": ["A", "B", "C", "D"]}, "ABCD"),
        ({"options": "abcde"}, "ABCDE"),
        ({"options": {"A": "Paris", "B": "Rome"}}, "AB"),
        ({"options": ["Paris", "Rome", "Oslo"]}, "ABC"),  # option texts: letters by position
        ({"options": 4}, "ABCD"),
    ],
)
def test_valid_options(metadata, expected):
    assert valid_options(metadata) == expected


def test_letter_outside_the_options_scores_zero():
    assert score_mcqa("\\boxed{E}", "D", ABCD) == 0.0
    assert score_mcqa("Answer: E", "D", ABCD) == 0.0
    assert score_mcqa("So E... the right one is D", "D", ABCD) == 1.0  # fallback skips non-options
    assert score_mcqa("\\boxed{E}", "E", {}) == 1.0  # A-J by default


def test_bad_reference_raises():
    with pytest.raises(ValueError):
        score_mcqa("\\boxed{A}", "E", ABCD)
    with pytest.raises(ValueError):
        score_mcqa("\\boxed{A}", "AB", {})


@pytest.mark.parametrize("reference", ["C", "c", "(C)", " C "])
def test_reference_forms(reference):
    assert score_mcqa("\\boxed{C}", reference, ABCD) == 1.0


# --- realistic responses and the think block ----------------------------------------------

GPQA_STYLE = """<think>
The reaction is an SN2 at a secondary carbon with a strong nucleophile. Option A would need
a carbocation, which is unlikely here. I'd say B or C... B ignores inversion. So C.
</think>

The nucleophile attacks from the back side, inverting the stereocenter, which gives the (S) product.

**Answer: C**"""

MMLU_PRO_STYLE = """Let's evaluate each option:
(A) Incorrect: the Treaty of Versailles was signed in 1919.
(B) Incorrect.
...
(I) Correct: the League of Nations was founded in 1920.
(J) Incorrect.

The answer is (I)."""


def test_realistic_responses():
    assert score_mcqa(GPQA_STYLE, "C", ABCD) == 1.0
    assert score_mcqa(GPQA_STYLE, "B", ABCD) == 0.0
    assert score_mcqa(MMLU_PRO_STYLE, "I", {}) == 1.0


def test_only_text_after_think_counts():
    assert score_mcqa("<think>\\boxed{B}</think>\n\nThe answer is C.", "C", ABCD) == 1.0
    assert score_mcqa("<think>\\boxed{C}</think>\n\nThe answer is B.", "C", ABCD) == 0.0
    assert score_mcqa("it is C</think>Answer: C", "C", ABCD) == 1.0  # template put <think> in the prompt


def test_unclosed_think_scores_zero():
    assert score_mcqa("<think>\nThe answer is C", "C", ABCD) == 0.0

"""The IFEval instruction-following reward in verifiers/instruction_following.py.

Prompts and kwargs below are written in IFEval's format (google/IFEval: instruction_id_list
and kwargs with every unused key null); the responses are written here.
"""

import pytest

from cascade_rl.verifiers.instruction_following import (
    INSTRUCTIONS,
    check_instructions,
    count_sentences,
    count_words,
    detect_language,
    score_instruction_following,
    word_tokenize,
)

# The 25 ids of IFEval's registry (lm_eval/tasks/ifeval/instructions_registry.py).
IFEVAL_IDS = {
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words", "keywords:letter_frequency",
    "language:response_language", "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript",
    "detectable_format:number_bullet_lists", "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections", "detectable_format:multiple_sections",
    "detectable_format:json_format", "detectable_format:title", "combination:two_responses",
    "combination:repeat_prompt", "startend:end_checker", "change_case:capital_word_frequency",
    "change_case:english_capital", "change_case:english_lowercase", "punctuation:no_comma", "startend:quotation",
}  # fmt: skip


def test_registry_has_ifevals_ids():
    assert set(INSTRUCTIONS) == IFEVAL_IDS


def follows(iid: str, text: str, **kwargs) -> bool:
    return check_instructions(text, [iid], [kwargs]).strict[0]


# --- one passing and one failing response per instruction ------------------------------------

CASES = [
    ("keywords:existence", {"keywords": ["hammock", "sleep"]}, "Sleep well in a hammock.", "Sleep well in a bed."),
    ("keywords:frequency", {"keyword": "dog", "frequency": 2, "relation": "at least"}, "Dog days. A dog.", "A dog."),
    ("keywords:frequency", {"keyword": "dog", "frequency": 2, "relation": "less than"}, "A dog.", "Dog days. A dog."),
    ("keywords:forbidden_words", {"forbidden_words": ["taxes", "irs"]}, "My tax-free life.", "I pay the IRS."),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 3, "let_relation": "at least"},
        "Zany jazz.",
        "Zany.",
    ),
    (
        "language:response_language",
        {"language": "fr"},
        "Je voudrais un café au lait, s'il vous plaît.",
        "I would like a coffee with milk, please.",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "Mr. Smith went to Washington. He stayed.",
        "One. Two. Three.",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 3},
        "One.\n***\nTwo.\n***\nThree.",
        "One.\n***\n\n***\nThree.",
    ),  # an empty paragraph between dividers fails
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", "one two"),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "president"},
        'The election was close.\n\n"President Lincoln won," they said.',
        "The election.\n\nLincoln won.",
    ),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].", "Dear [name]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Bye.\n\nP.S. I love you.", "Bye. PS love."),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Bye.\nP.P.S. Call me.", "Bye.\nP.S. Call me."),
    (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 2},
        "* First point\n* Second point",
        "* First\n* Second\n- Third",
    ),
    ("detectable_format:constrained_response", {}, "My answer is maybe.", "Maybe."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*Intro* and **Body**", "*Intro* only"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\nHammocks.\nSECTION 2\nSleep.",
        "SECTION 1\nHammocks.",
    ),
    ("detectable_format:json_format", {}, '```json\n{"name": "Dave", "age": 7}\n```', "name: Dave"),
    ("detectable_format:title", {}, "<<Ode to Joy>>\nJoy is here.", "Ode to Joy\nJoy is here. <<>>"),
    ("combination:two_responses", {}, "Answer one.\n******\nAnswer two.", "Same.\n******\nSame."),
    (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Write a haiku about rain."},
        "Write a haiku about rain.\nSoft rain on the roof...",
        "Here is a haiku about rain.",
    ),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        "It works.\nAny other questions?",
        "Any other questions? Bye.",
    ),
    ("startend:quotation", {}, '"Wrapped in quotes."', '"Half wrapped.'),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": "at least"},
        "This is VERY VERY IMPORTANT.",
        "This is VERY important.",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "OK then.",
        "DON'T panic.",
    ),  # Treebank splits contractions: DO N'T is two capital words
    ("change_case:english_capital", {}, "THIS IS A SONG ABOUT REGRETS AND TIME.", "This is a song about regrets."),
    ("change_case:english_lowercase", {}, "this is a story about a cat and a dog.", "this is a story about Tom."),
    ("punctuation:no_comma", {}, "No commas here.", "Well, a comma."),
]


@pytest.mark.parametrize("iid, kwargs, good, bad", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_instruction(iid, kwargs, good, bad):
    assert follows(iid, good, **kwargs)
    assert not follows(iid, bad, **kwargs)


def test_every_instruction_is_exercised():
    assert {c[0] for c in CASES} == IFEVAL_IDS


def test_empty_response_follows_nothing():
    assert not follows("punctuation:no_comma", "   ")


# --- the counting helpers match IFEval's nltk-based ones -----------------------------------


def test_counts():
    assert count_words("It's a state-of-the-art tool, isn't it?") == 11  # \w+ tokens, as nltk's RegexpTokenizer
    assert count_sentences("Dr. Smith arrived at 5 p.m. on Monday. He left. Did he?") == 3  # Punkt knows "Dr."
    assert word_tokenize("I'M SO HAPPY, DON'T YOU THINK?") == [
        "I", "'M", "SO", "HAPPY", ",", "DO", "N'T", "YOU", "THINK", "?",
    ]  # fmt: skip


def test_language_detection_is_deterministic():
    # Unseeded langdetect can flip between languages on short texts; here it never does.
    assert len({detect_language("go now") for _ in range(10)}) == 1
    assert detect_language("12345 !!!") is None  # nothing to detect: IFEval counts it as followed


# --- full IFEval-style prompts ---------------------------------------------------------------


def ifeval_kwargs(**used):
    """A kwargs dict as the IFEval dataset stores it: every key present, unused ones null."""
    keys = ["num_highlights", "relation", "num_words", "num_placeholders", "prompt_to_repeat", "num_bullets",
            "section_spliter", "num_sections", "capital_relation", "capital_frequency", "keywords", "num_paragraphs",
            "language", "let_relation", "letter", "let_frequency", "end_phrase", "forbidden_words", "keyword",
            "frequency", "num_sentences", "postscript_marker", "first_word", "nth_paragraph"]  # fmt: skip
    return {k: used.get(k) for k in keys}


SUMMARY_META = {  # "Write a 300+ word summary of the wikipedia page ... Do not use any commas and highlight at
    # least 3 sections that has titles in markdown format, for example *highlighted section part 1* ..."
    "instruction_id_list": [
        "punctuation:no_comma",
        "detectable_format:number_highlighted_sections",
        "length_constraints:number_words",
    ],
    "kwargs": [ifeval_kwargs(), ifeval_kwargs(num_highlights=3), ifeval_kwargs(relation="at least", num_words=300)],
}
SUMMARY_BODY = (
    "Raymond III was Count of Tripoli from 1152 to 1187 and a central figure of the Latin East. "
    "He inherited the county as a boy after his father was murdered and spent years as a captive of Nur ad-Din. "
)


def summary(comma: bool = False, highlights: int = 3, bodies: int = 3) -> str:
    """``highlights`` highlighted titles, each over ``bodies`` x 40 words."""
    parts = [f"*Part {i + 1} of his life*\n\n" + SUMMARY_BODY * bodies for i in range(highlights)]
    text = "\n\n".join(parts)
    return text.replace("Latin East.", "Latin East, indeed.") if comma else text


def test_ifeval_summary_prompt():
    assert score_instruction_following(summary(), "", SUMMARY_META) == 1.0
    assert score_instruction_following(summary(comma=True), "", SUMMARY_META) == 0.0  # one comma
    assert score_instruction_following(summary(highlights=2), "", SUMMARY_META) == 0.0
    assert score_instruction_following(summary(bodies=2), "", SUMMARY_META) == 0.0  # 252 words: under 300
    result = check_instructions(summary(comma=True), SUMMARY_META["instruction_id_list"], SUMMARY_META["kwargs"])
    assert result.strict == [False, True, True] and not result.strict_all


EMAIL_PROMPT = (
    "Write an email to my boss telling him that I am quitting. The email must contain a title wrapped in "
    "double angular brackets, i.e. <<title>>."
)
EMAIL_META = {
    "instruction_id_list": ["detectable_format:title", "combination:repeat_prompt"],
    "kwargs": [ifeval_kwargs(), ifeval_kwargs(prompt_to_repeat=EMAIL_PROMPT)],
}


def test_ifeval_repeat_prompt_and_title():
    good = EMAIL_PROMPT + "\n\n<<My Resignation>>\n\nDear Mr. [Boss],\nI am resigning effective [date].\nBest,\nSam"
    assert score_instruction_following(good, "", EMAIL_META) == 1.0
    assert score_instruction_following("Sure! " + good, "", EMAIL_META) == 0.0  # words before the repeat
    # As in IFEval, the "<<title>>" inside the repeated prompt counts as a title.
    assert score_instruction_following(good.replace("<<My Resignation>>", "My Resignation"), "", EMAIL_META) == 1.0
    no_title = {"instruction_id_list": ["detectable_format:title"], "kwargs": [ifeval_kwargs()]}
    assert score_instruction_following(good.replace("<<", "").replace(">>", ""), "", no_title) == 0.0


def test_ifeval_sections_bullets_postscript():
    meta = {
        "instruction_id_list": [
            "detectable_format:multiple_sections",
            "detectable_format:number_bullet_lists",
            "detectable_content:postscript",
        ],
        "kwargs": [
            ifeval_kwargs(section_spliter="Section", num_sections=2),
            ifeval_kwargs(num_bullets=3),
            ifeval_kwargs(postscript_marker="P.S."),
        ],
    }
    good = (
        "Section 1\nWhy hammocks help you sleep:\n* They rock you gently\n* They relieve pressure points\n\n"
        "Section 2\nWhat to buy:\n* A double-width nylon hammock\n\nP.S. Use tree straps."
    )
    assert score_instruction_following(good, "", meta) == 1.0
    assert score_instruction_following(good.replace("* A double", "A double"), "", meta) == 0.0
    assert score_instruction_following(good.replace("P.S. Use", "Use"), "", meta) == 0.0


# --- strict is the reward; loose is reported ---------------------------------------------------


def test_loose_forgives_preamble_and_markdown_strict_does_not():
    meta = {
        "instruction_id_list": ["punctuation:no_comma", "startend:end_checker"],
        "kwargs": [{}, {"end_phrase": "Is there anything else I can help with?"}],
    }
    text = "Sure, here it is:\nHammocks are great for naps.\n**Is there anything else I can help with?**"
    result = check_instructions(text, meta["instruction_id_list"], meta["kwargs"])
    assert result.strict == [False, False]
    assert result.loose == [True, True] and result.loose_all
    assert score_instruction_following(text, "", meta) == 0.0


# --- which part of the response is checked ----------------------------------------------------


def test_only_the_answer_after_think_is_checked():
    meta = {"instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"], "kwargs": [{}, {}]}
    answer = "hammocks are lovely for an afternoon nap in the garden."
    assert score_instruction_following(f"<think>\nOk, no commas, All lowercase.\n</think>\n\n{answer}", "", meta) == 1.0
    assert score_instruction_following(f"<think>\nno commas, lowercase... {answer}", "", meta) == 0.0  # unfinished
    assert score_instruction_following(answer + " Bye, then.", "", meta) == 0.0


def test_nth_paragraph_ignores_whitespace_after_think():
    meta = {
        "instruction_id_list": ["length_constraints:nth_paragraph_first_word"],
        "kwargs": [{"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "hammocks"}],
    }
    assert (
        score_instruction_following("plan</think>\n\nHammocks are old.\n\nThey came from Central America.", "", meta)
        == 1.0
    )


# --- malformed metadata raises (the worker reports the rollout as not scored) -------------------


@pytest.mark.parametrize(
    "ids, kwargs, error",
    [
        (["keywords:unknown"], [{}], KeyError),
        (["punctuation:no_comma"], [{}, {}], ValueError),  # lengths differ
        (["length_constraints:number_words"], [{"num_words": 5}], TypeError),  # relation missing
        (["punctuation:no_comma"], [{"num_words": 5}], TypeError),  # an argument it does not take
        (["length_constraints:number_words"], [{"num_words": 5, "relation": "at most"}], ValueError),
        (["keywords:letter_frequency"], [{"letter": "ab", "let_frequency": 1, "let_relation": "at least"}], ValueError),
    ],
)
def test_malformed_metadata_raises(ids, kwargs, error):
    with pytest.raises(error):
        score_instruction_following("Some answer text.", "", {"instruction_id_list": ids, "kwargs": kwargs})


def test_scores_from_a_thread_pool():
    from concurrent.futures import ThreadPoolExecutor

    meta = {
        "instruction_id_list": ["language:response_language", "length_constraints:number_sentences"],
        "kwargs": [{"language": "en"}, {"num_sentences": 2, "relation": "at least"}],
    }
    cases = ["Hammocks are great. They help you sleep.", "Les hamacs sont formidables. Ils aident à dormir."] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda text: score_instruction_following(text, "", meta), cases))
    assert scores == [1.0, 0.0] * 4

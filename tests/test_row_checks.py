"""Row checks (verifiers/registry.py ``CHECKS``, ``check_row``): a data row whose metadata its domain's verifier would
reject is reported with a reason, before any process starts; plugins load by module name or by file path."""

from __future__ import annotations

import sys
import time

import pytest

from cascade_rl.protocol.messages import ScoreRequest, WorkKey
from cascade_rl.verifiers.registry import (
    CHECKS,
    GROUP_VERIFIERS,
    VERIFIERS,
    PluginError,
    check_row,
    load_plugins,
    register_group_verifier,
    register_verifier,
)

ABCD = {"options": ["A", "B", "C", "D"]}
IF_OK = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
         "kwargs": [{}, {"relation": "at least", "num_words": 3}]}
HUMANEVAL = {"humaneval": {"test": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

GOOD = [
    ("math", "\\frac{1}{2}", {}),
    ("mcqa", "C", ABCD),
    ("mcqa", "(b)", {"options": ["Paris", "Rome", "Oslo"]}),
    ("mcqa", "J", {}),  # A-J by default
    ("structured_output", "", {"schema": {"type": "object", "required": ["a"]}}),
    ("structured_output", '{"type": "array"}', {}),  # the schema as the answer
    ("instruction_following", "", IF_OK),
    ("code", "", {"tests": [{"input": "1 2\n", "output": "3\n"}], "timeout_s": 2}),
    ("code", "", HUMANEVAL),
    ("tool_call", CALL, {}),
    ("tool_call", f"[{CALL}, {CALL}]", {}),
    ("llm_judge", "Paris", {}),
    ("genrm", "", {}),  # no check: only the shape of the row
]


@pytest.mark.parametrize("domain, answer, metadata", GOOD)
def test_good_rows_pass(domain, answer, metadata):
    assert check_row(domain, answer, metadata) == ""


# (domain, answer, metadata, words the reason must hold)
BAD = [
    ("math", "  ", {}, ["answer", "empty"]),
    ("mcqa", "E", ABCD, ["'E'", "not one of the options A-D"]),
    ("mcqa", "AB", {}, ["'AB'", "not one of the options A-J"]),
    ("mcqa", "A", {"options": ["Paris", None]}, ["metadata.options", "None"]),
    ("mcqa", "A", {"options": []}, ["metadata.options", "empty"]),
    ("mcqa", "A", {"options": ["A", "B", "a"]}, ["repeats a letter"]),
    ("mcqa", "A", {"options": 2.5}, ["metadata.options", "float"]),
    ("mcqa", "A", {"options": "A, B, C"}, ["string", "option letters"]),
    ("structured_output", "", {"schema": {"type": "objekt"}}, ["metadata.schema", "not a valid JSON Schema", "objekt"]),
    ("structured_output", "", {"schema": 5}, ["not a valid JSON Schema", "object or a boolean"]),
    ("structured_output", "not json", {}, ["needs metadata['schema']"]),
    ("instruction_following", "", {"instruction_id_list": ["foo:bar"], "kwargs": [{}]},
     ["unknown instruction id 'foo:bar'"]),
    ("instruction_following", "", {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]},
     ["1 instruction ids but 2 kwargs"]),
    ("instruction_following", "", {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"num_words": 5}]},
     ["punctuation:no_comma", "unexpected keyword argument 'num_words'"]),
    ("instruction_following", "", {"instruction_id_list": ["length_constraints:number_words"],
                                   "kwargs": [{"num_words": 5}]}, ["missing", "relation"]),
    ("instruction_following", "", {"instruction_id_list": ["length_constraints:number_words"],
                                   "kwargs": [{"num_words": 5, "relation": "at most"}]}, ["relation", "'at most'"]),
    ("instruction_following", "", {"instruction_id_list": "punctuation:no_comma", "kwargs": [{}]},
     ["instruction_id_list", "list"]),
    ("instruction_following", "", {}, ["instruction_id_list"]),
    ("code", "", {}, ["needs 'tests'", "humaneval"]),
    ("code", "", {"tests": []}, ["tests", "non-empty list"]),
    ("code", "", {"tests": [{"input": "1"}]}, ["tests", "'output': str"]),
    ("code", "", {"humaneval": {"test": "def check(f):\n    pass\n"}}, ["entry_point"]),
    ("code", "", {"humaneval": {"test": "def check(f) assert f", "entry_point": "add"}}, ["test", "not valid Python"]),
    ("code", "", {"humaneval": {"test": "x = 1", "entry_point": "add(1)"}}, ["entry_point", "function name"]),
    ("code", "", {**HUMANEVAL, "timeout_s": "soon"}, ["timeout_s", "'soon'"]),
    ("tool_call", "get_weather(city='Paris')", {}, ["tool_call reference", "not a JSON call"]),
    ("tool_call", "[]", {}, ["empty list"]),
    ("tool_call", '{"arguments": {}}', {}, ["string 'name'"]),
    ("llm_judge", "", {}, ["answer", "empty"]),
]


@pytest.mark.parametrize("domain, answer, metadata, words", BAD)
def test_bad_rows_give_the_reason(domain, answer, metadata, words):
    reason = check_row(domain, answer, metadata)
    assert reason, "a bad row passed"
    assert "\n" not in reason
    for word in words:
        assert word in reason, f"{word!r} not in {reason!r}"


@pytest.mark.parametrize("domain, answer, metadata, words",
                         [b for b in BAD if b[0] in ("mcqa", "structured_output", "instruction_following", "code",
                                                     "tool_call")])
def test_the_verifier_rejects_what_the_check_rejects(domain, answer, metadata, words):
    """Checks and verifiers share their validation: a row the check rejects fails scoring (raises), it is no 0."""
    with pytest.raises(Exception):  # noqa: B017 (ValueError, TypeError, KeyError or jsonschema's SchemaError)
        VERIFIERS[domain]("<think>\n</think>\n\nanswer", answer, {"question": "q", **metadata})


def test_row_shape_and_unknown_domain():
    reason = check_row("maths", "4", {})
    assert "unknown domain 'maths'" in reason
    assert "math" in reason.split("registered:")[1] and "genrm" in reason  # names the registered domains
    assert "answer must be a string" in check_row("math", 4, {})
    assert "metadata must be a dict" in check_row("mcqa", "A", ["A", "B"])
    assert "unknown domain" in check_row(["not", "hashable"], "A", {})  # type: ignore[arg-type]


@pytest.fixture
def scratch_domains():
    """Names registered by a test, removed after it (the registries are process-wide)."""
    names: list[str] = []
    yield names
    for name in names:
        for reg in (VERIFIERS, GROUP_VERIFIERS, CHECKS):
            reg.pop(name, None)


def test_register_verifier_with_a_check(scratch_domains):
    def check(answer: str, metadata: dict) -> None:
        if answer != "yes":
            raise ValueError(f"answer {answer!r} is not 'yes'")

    scratch_domains += ["test_rc_yes", "test_rc_bare", "test_rc_group"]

    @register_verifier("test_rc_yes", check=check)
    def yes(response: str, reference: str, metadata: dict) -> float:
        return float(response == reference)

    @register_verifier("test_rc_bare")  # the bare decorator, as before: no check
    def bare(response: str, reference: str, metadata: dict) -> float:
        return 1.0

    @register_group_verifier("test_rc_group", check=check)
    def group(prompt: str, responses: list[str], reference: str, metadata: dict) -> list[float]:
        return [1.0] * len(responses)

    assert VERIFIERS["test_rc_yes"] is yes and CHECKS["test_rc_yes"] is check
    assert yes("yes", "yes", {}) == 1.0  # the decorator returns the function itself
    assert VERIFIERS["test_rc_bare"] is bare and "test_rc_bare" not in CHECKS
    assert GROUP_VERIFIERS["test_rc_group"] is group and CHECKS["test_rc_group"] is check
    assert check_row("test_rc_yes", "yes", {}) == ""
    assert check_row("test_rc_yes", "no", {}) == "answer 'no' is not 'yes'"
    assert check_row("test_rc_group", "no", {}) == "answer 'no' is not 'yes'"
    assert check_row("test_rc_bare", "anything", {}) == ""  # a domain without a check
    with pytest.raises(ValueError, match="registered twice"):
        register_verifier("test_rc_yes")(bare)
    with pytest.raises(ValueError, match="row check 'test_rc_yes' registered twice"):
        register_group_verifier("test_rc_yes", check=check)(group)
    assert "test_rc_yes" not in GROUP_VERIFIERS  # refused before anything was registered


def test_check_row_never_raises(scratch_domains):
    def crashes(answer: str, metadata: dict) -> None:
        return metadata["n"] + answer  # TypeError for an int n

    def silent(answer: str, metadata: dict) -> None:
        raise ValueError()

    def multiline(answer: str, metadata: dict) -> None:
        raise KeyError("first line\nsecond line")

    for name, check in (("test_rc_crash", crashes), ("test_rc_silent", silent), ("test_rc_lines", multiline)):
        scratch_domains.append(name)
        register_verifier(name, check=check)(lambda response, reference, metadata: 0.0)
    reason = check_row("test_rc_crash", "a", {"n": 1})
    assert reason.startswith("TypeError: ") and "int" in reason
    assert check_row("test_rc_crash", "a", {}) == "KeyError: 'n'"
    assert check_row("test_rc_silent", "a", {}) == "ValueError"  # a rejection without a message is still one
    assert check_row("test_rc_lines", "a", {}) == "KeyError: 'first line\\nsecond line'"


PLUGIN = '''
from cascade_rl.verifiers.registry import register_verifier

def check(answer: str, metadata: dict) -> None:
    if not answer.isdigit():
        raise ValueError(f"answer {answer!r} is not a word count")

@register_verifier("test_rc_word_count", check=check)
def word_count(response: str, reference: str, metadata: dict) -> float:
    return float(len(response.split()) == int(reference))
'''


@pytest.fixture
def plugin_file(tmp_path, scratch_domains):
    path = tmp_path / "rewards.py"
    path.write_text(PLUGIN)
    scratch_domains.append("test_rc_word_count")
    before = set(sys.modules)
    yield path
    for name in set(sys.modules) - before:
        if name.startswith("cascade_rl_plugin_"):
            del sys.modules[name]


def test_plugin_by_file_path(plugin_file, monkeypatch):
    assert "test_rc_word_count" not in VERIFIERS
    (module,) = load_plugins([str(plugin_file)])
    assert VERIFIERS["test_rc_word_count"] is module.word_count
    assert CHECKS["test_rc_word_count"] is module.check
    assert sys.modules[module.__name__] is module  # importable by name: pickled references resolve
    assert VERIFIERS["test_rc_word_count"]("one two three", "3", {}) == 1.0
    assert check_row("test_rc_word_count", "3", {}) == ""
    assert check_row("test_rc_word_count", "three", {}) == "answer 'three' is not a word count"
    # loading again is harmless, also by a relative path from the file's folder (what scoring processes do)
    assert load_plugins([str(plugin_file)]) == [module]
    monkeypatch.chdir(plugin_file.parent)
    assert load_plugins(["rewards.py", "./rewards.py"]) == [module, module]
    assert VERIFIERS["test_rc_word_count"] is module.word_count


def test_plugin_by_path_in_spawned_scoring_processes(plugin_file):
    from cascade_rl.verifiers.worker import Pool

    pool = Pool(1, {}, [str(plugin_file)])
    try:
        reqs = [ScoreRequest(WorkKey.score("k", 0, 0), "test_rc_word_count", "a b c", "3", {}, 20.0),
                ScoreRequest(WorkKey.score("k", 1, 0), "test_rc_word_count", "a b", "3", {}, 20.0)]
        for r in reqs:
            pool.submit(r)
        scores, t_end = {}, time.monotonic() + 30
        while len(scores) < 2 and time.monotonic() < t_end:
            scores.update((s.key.index, s) for s in pool.collect(0.05))
    finally:
        pool.close()
    assert scores[0].ok and scores[0].reward == 1.0, scores[0].reason
    assert scores[1].ok and scores[1].reward == 0.0


def test_plugin_errors_name_the_entry_and_cause(tmp_path):
    missing = tmp_path / "nowhere" / "rewards.py"
    with pytest.raises(PluginError, match=rf"^verifier\.plugins: {missing}: no such file$"):
        load_plugins([str(missing)])
    with pytest.raises(PluginError, match=r"^verifier\.plugins: no_such_pkg\.rewards: ModuleNotFoundError: "):
        load_plugins(["no_such_pkg.rewards"])
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_for_cascade_rl\n")
    with pytest.raises(PluginError, match=rf"{broken}: ModuleNotFoundError: No module named 'no_such_module_for"):
        load_plugins([str(broken)])
    assert not [m for m in sys.modules if m.startswith("cascade_rl_plugin_broken_")]  # a failed import leaves none
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(PluginError, match="not a .py file"):
        load_plugins([str(tmp_path / "notes.txt")])

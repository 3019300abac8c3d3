"""The coding tasks (data/coding.py): for 200 items of each, across splits, the reference passes its hidden tests in
the real sandbox and every corruption fails them; the swe_agent trace replayed through the real environment; the
splits, the rows' checks, ``make-data coding`` files read back through the data path, and the token budgets of the
tiny model.

Most sandbox checks run many cases in one sandbox program (the harness below: each case in fresh namespaces, the
repository's modules put in ``sys.modules``, as the brief of the swe verifier says), so 200 items cost a few runs;
a sample of each goes through the verifiers and the environment themselves."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from omegaconf import OmegaConf

from cascade_rl.data.coding import AGENT_INSTRUCTION, CODE_INSTRUCTION, PATCH_INSTRUCTION
from cascade_rl.data.prepare import prepare
from cascade_rl.data.promptset import PromptSet
from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.swe_repos import CATALOG, bugs
from cascade_rl.data.tasks import MIXES, TASKS, TURN_PREFIX, Example, domains, load_task, think
from cascade_rl.environments.registry import build_environment
from cascade_rl.environments.tool_calls import ToolCall, parse_tool_calls
from cascade_rl.learner.sft import encode_examples, encode_trace, read_sft_rows
from cascade_rl.learner.tiny_model import corpus, train_tokenizer
from cascade_rl.verifiers.code import extract_program, score_code
from cascade_rl.verifiers.registry import VERIFIERS, check_row
from cascade_rl.verifiers.sandbox import isolation_available, run_python
from cascade_rl.verifiers.swe import apply_edits, evaluate, parse_edits, replace_once

needs_sandbox = pytest.mark.skipif(not isolation_available(), reason="the sandbox needs root on Linux")
TASK_NAMES = ("code_fn", "swe_patch", "swe_agent")
SIZES = {"heldout": 40, "rl": 80, "sft": 80}  # 200 items per task
SAMPLE = 8  # items per task that also go through the verifier / the environment themselves


@pytest.fixture(scope="module")
def splits() -> dict[str, dict[str, list[Example]]]:
    return {name: load_task(name, SIZES, seed=1) for name in TASK_NAMES}


def every(splits, name: str) -> list[Example]:
    return [ex for split in splits[name].values() for ex in split]


# --- the harness: many cases in one sandbox run ---------------------------------------------------------

_HARNESS = """
import json, sys, types
cases = json.loads(sys.stdin.read())
results = []
for files, program in cases:
    made = []
    try:
        for path in files:  # every module exists before any runs: they may import each other
            made.append(path[:-3])
            sys.modules[path[:-3]] = types.ModuleType(path[:-3])
        for path, source in files.items():
            exec(compile(source, path, "exec"), sys.modules[path[:-3]].__dict__)
        exec(compile(program, "<case>", "exec"), {"__name__": "__main__"})
        results.append(True)
    except BaseException:
        results.append(False)
    finally:
        for name in made:
            sys.modules.pop(name, None)
print(json.dumps(results))
"""


def passes(cases: list[tuple[dict[str, str], str]]) -> list[bool]:
    """Whether each (files, program) runs to its end in the sandbox: the program after the files' modules."""
    out = []
    for i in range(0, len(cases), 500):
        r = run_python(_HARNESS, json.dumps(cases[i:i + 500]))
        assert r.ok, r.stderr[-2000:]
        out += json.loads(r.stdout)
    return out


# --- code_fn ------------------------------------------------------------------------------------------------


def code_corruptions(ex: Example) -> dict[str, str]:
    """Programs one slip away from the reference (``ex.answer``), by kind."""
    program = ex.answer
    header, body = program.split("\n", 1)
    name, params = re.fullmatch(r"def (\w+)\((.*)\):", header).groups()
    params = params.split(", ")
    expr = body.removeprefix("    return ").rstrip("\n")
    op = re.search(r" ([-+*]) ", expr)
    number = re.search(r"\d+", expr)
    exprs = {"wrong operator": f"{expr[:op.start()]} {'+' if op.group(1) != '+' else '-'} {expr[op.end():]}",
             "wrong constant": f"{expr[:number.start()]}{int(number.group()) + 1}{expr[number.end():]}"}
    if len(params) == 2:
        exprs["wrong argument"] = re.sub(rf"\b{params[0]}\b", params[1], expr, count=1)
    out = {kind: f"{header}\n    return {e}\n" for kind, e in exprs.items()}
    out["missing return"] = program.replace("    return ", "    ")
    out["syntax error"] = program.replace("):\n", ")\n", 1)
    out["wrong function name"] = program.replace(f"def {name}(", f"def {name}_v2(", 1)
    out["wrong parameter name"] = program.replace(f"({', '.join(params)})", f"({', '.join(p + 'q' for p in params)})", 1)
    assert all(p != program for p in out.values())
    return out


def humaneval_program(code: str, ex: Example) -> str:
    """The program verifiers/code.py runs (less its end marker)."""
    spec = ex.metadata["humaneval"]
    return f"{code}\n\n{spec['test']}\n\ncheck({spec['entry_point']})\n"


def test_code_fn_examples_look_as_documented(splits):
    for ex in every(splits, "code_fn"):
        spec = ex.metadata["humaneval"]
        assert (ex.domain, ex.env, ex.turns, ex.instruction) == ("code", "", (), CODE_INSTRUCTION)
        assert re.fullmatch(r"Write a Python function `\w+\(\w+(, \w+)?\)` that returns [^`]+\.", ex.question)
        assert ex.solution == think([f"returns {ex.answer.split('return ')[1].strip()}"], f"```python\n{ex.answer}```")
        assert extract_program(TURN_PREFIX + ex.solution) == ex.answer
        assert spec["entry_point"] == re.match(r"def (\w+)", ex.answer).group(1)
        assert 3 <= spec["test"].count("assert candidate(") <= 5
        assert check_row("code", ex.answer, ex.metadata) == ""


@needs_sandbox
def test_code_fn_references_pass_and_every_corruption_fails(splits):
    examples = every(splits, "code_fn")
    assert len(examples) == 200
    cases, kinds = [], []
    for ex in examples:
        cases.append(({}, humaneval_program(extract_program(TURN_PREFIX + ex.solution), ex)))
        kinds.append("reference")
        for kind, program in code_corruptions(ex).items():
            cases.append(({}, humaneval_program(program, ex)))
            kinds.append(kind)
    results = passes(cases)
    assert [k for k, ok in zip(kinds, results) if (k == "reference") != ok] == []
    assert {k for k in kinds} >= {"wrong operator", "wrong constant", "wrong argument", "missing return",
                                  "syntax error", "wrong function name", "wrong parameter name"}


@needs_sandbox
def test_code_fn_through_the_code_verifier(splits):
    """The verifier itself (verifiers/code.py, one sandbox run each) on a sample: 1.0 for the worked solution, 0.0
    for corruptions and for a <think> never closed."""
    score = VERIFIERS["code"]
    jobs = []
    for ex in every(splits, "code_fn")[:SAMPLE]:
        jobs.append((TURN_PREFIX + ex.solution, ex, 1.0))
        for kind in ("wrong operator", "wrong constant", "wrong function name"):
            program = code_corruptions(ex)[kind]
            jobs.append((TURN_PREFIX + think(["returns it"], f"```python\n{program}```"), ex, 0.0))
        unclosed = TURN_PREFIX + ex.solution.replace("</think>", "")
        assert score(unclosed, ex.answer, ex.metadata) == 0.0  # no answer: nothing is run
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda j: score_code(j[0], j[1].answer, j[1].metadata), jobs))
    assert got == [want for _, _, want in jobs]


# --- swe_patch ----------------------------------------------------------------------------------------------


def patch(path: str, old: str, new: str) -> str:
    return f"{path}\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE"


def functions(source: str) -> dict[str, str]:
    """name -> its return line, in a generated module."""
    return dict(re.findall(r"def (\w+)\(.*\):\n(    return .*)", source))


def wrong_patches(ex: Example, rng: random.Random) -> dict[str, str]:
    """Final answers that must score 0, by kind."""
    (edit,) = parse_edits(ex.answer)
    source = ex.metadata["files"][edit.path]
    lines = functions(source)
    buggy = next(n for n, line in lines.items() if line == edit.search)
    other_bug = rng.choice(sorted(set(bugs(buggy)) - {edit.search.removeprefix("    return ")}))
    other = rng.choice([n for n in lines if n != buggy])
    other_mutant = rng.choice(sorted(bugs(other)))
    return {
        "wrong replacement": patch(edit.path, edit.search, f"    return {other_bug}"),
        "replacement that keeps the bug": patch(edit.path, edit.search, edit.search),
        "edit of another function": patch(edit.path, lines[other], f"    return {other_mutant}"),
        "search that does not occur": patch(edit.path, edit.search + " + 0", edit.replace),
        "edit of a file that does not exist": patch("nothing.py", edit.search, edit.replace),
        "no edit block": f"{buggy} has a bug.",
    }


def test_swe_patch_examples_look_as_documented(splits):
    for ex in every(splits, "swe_patch"):
        (path, source), = ex.metadata["files"].items()
        assert (ex.domain, ex.env, ex.turns, ex.instruction) == ("swe", "", (), PATCH_INSTRUCTION)
        assert ex.question.startswith(f"{path}:\n{source}\nIssue: ") and ex.prompt.endswith(PATCH_INSTRUCTION)
        (edit,) = parse_edits(ex.answer)
        assert edit.path == path and source.count(edit.search) == 1
        assert ex.solution.endswith(f"</think>\n\n{ex.answer}") and ex.solution.split(" has ")[0] in CATALOG
        assert 2 <= len(functions(source)) <= 4 and ex.metadata["tests"].startswith(f"from {path[:-3]} import ")
        assert check_row("swe", ex.answer, ex.metadata) == ""


@needs_sandbox
def test_swe_patch_reference_passes_the_bug_and_every_wrong_patch_fail(splits):
    rng = random.Random(0)
    cases, kinds = [], []
    for ex in every(splits, "swe_patch"):
        files, tests = ex.metadata["files"], ex.metadata["tests"]
        cases += [(apply_edits(files, parse_edits(ex.answer)), tests), (files, tests)]
        kinds += ["reference", "unpatched"]
        for kind, answer in wrong_patches(ex, rng).items():
            verdict = evaluate(TURN_PREFIX + think(["fix"], answer), ex.metadata) if kind in (
                "search that does not occur", "edit of a file that does not exist", "no edit block") else None
            if verdict is not None:  # refused before anything runs
                assert verdict.reward == 0.0 and verdict.reason, kind
                continue
            cases.append((apply_edits(files, parse_edits(answer)), tests))
            kinds.append(kind)
    assert len(kinds) == 200 * 5
    results = passes(cases)
    assert [k for k, ok in zip(kinds, results) if (k == "reference") != ok] == []


@needs_sandbox
def test_swe_patch_through_the_swe_verifier(splits):
    rng = random.Random(1)
    jobs = []
    for ex in every(splits, "swe_patch")[:SAMPLE]:
        jobs.append((TURN_PREFIX + ex.solution, ex.metadata, 1.0))
        wrong = wrong_patches(ex, rng)
        for kind in ("wrong replacement", "edit of another function"):
            jobs.append((TURN_PREFIX + think([kind], wrong[kind]), ex.metadata, 0.0))
    with ThreadPoolExecutor(4) as pool:
        verdicts = list(pool.map(lambda j: evaluate(j[0], j[1]), jobs))
    assert [v.reward for v in verdicts] == [want for _, _, want in jobs]
    assert all("AssertionError" in v.reason for v in verdicts if not v.reward)
    ex = every(splits, "swe_patch")[0]
    assert VERIFIERS["swe"](TURN_PREFIX + ex.solution.replace("</think>", ""), ex.answer, ex.metadata) == 0.0


# --- swe_agent ----------------------------------------------------------------------------------------------


def test_swe_agent_traces_look_as_documented(splits):
    for ex in every(splits, "swe_agent"):
        path, test_path = ex.metadata["files"]
        assert (ex.domain, ex.env, ex.instruction) == ("swe_agent", "swe", AGENT_INSTRUCTION)
        assert test_path == f"test_{path}" and f"The repository has {path} (" in ex.question
        assert [m["role"] for m in ex.turns] == ["assistant", "tool"] * 3 + ["assistant"]
        calls = [parse_tool_calls(m["content"]) for m in ex.turns[::2]]
        (edit,) = parse_edits(ex.answer)
        assert calls[:3] == [[ToolCall("read_file", {"path": path})],
                             [ToolCall("edit_file", {"path": path, "search": edit.search.removeprefix("    return "),
                                                     "replace": edit.replace.removeprefix("    return ")})],
                             [ToolCall("run_tests", {})]]
        assert calls[3] == [] and ex.turns[-1]["content"] == TURN_PREFIX + ex.solution
        assert re.fullmatch(r"\n</think>\n\nFixed \w+: it had (.+ instead of .+|if and else swapped)\.", ex.solution)
        assert all(m["content"].startswith(TURN_PREFIX) for m in ex.turns[::2])
        assert check_row("swe", ex.answer, ex.metadata) == ""


def visible_test_program(files: dict[str, str], test_path: str) -> str:
    """The visible test file's text, then a call of each of its test functions."""
    names = re.findall(r"^def (test_\w+)\(", files[test_path], re.M)
    return files[test_path] + "".join(f"{n}()\n" for n in names)


@needs_sandbox
def test_swe_agent_trace_edits_fix_the_bug_for_every_item(splits):
    cases, kinds = [], []
    for ex in every(splits, "swe_agent"):
        files, tests = ex.metadata["files"], ex.metadata["tests"]
        path, test_path = files
        (call,) = parse_tool_calls(ex.turns[2]["content"])
        fixed = {**files, path: replace_once(files[path], call.arguments["search"], call.arguments["replace"], path)}
        repo_only = {p: s for p, s in fixed.items() if p != test_path}
        cases += [(repo_only, tests), ({path: files[path]}, tests), (repo_only, visible_test_program(fixed, test_path)),
                  ({path: files[path]}, visible_test_program(files, test_path))]
        kinds += ["fixed hidden", "initial hidden", "fixed visible", "initial visible"]
    results = passes(cases)
    assert [k for k, ok in zip(kinds, results) if k.startswith("fixed") != ok] == []


@needs_sandbox
def test_swe_agent_trace_replayed_through_the_environment(splits):
    """Each assistant turn of the trace, stepped through the real ``swe`` environment: its observations are the
    trace's tool turns, the last turn ends the episode, and the state it leaves scores 1.0 (the initial files 0.0)."""
    env = build_environment("swe")
    score = VERIFIERS["swe"]

    def replay(ex: Example) -> tuple[float, float]:
        conversation, state = [{"role": "user", "content": ex.prompt}], {}
        for i, turn in enumerate(ex.turns):
            conversation.append(turn)
            if turn["role"] != "assistant":
                continue
            step = env.step(conversation, state, ex.metadata)
            state = step.state
            if i == len(ex.turns) - 1:
                assert step.done and step.tool_messages == []
            else:
                assert not step.done and step.tool_messages == [ex.turns[i + 1]] and step.tool_errors == 0
        final = ex.turns[-1]["content"]
        initial = {"files": dict(ex.metadata["files"])}
        return (score(final, ex.answer, {**ex.metadata, "env_state": state}),
                score(final, ex.answer, {**ex.metadata, "env_state": initial}))

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(replay, every(splits, "swe_agent")[:2 * SAMPLE])) == [(1.0, 0.0)] * 2 * SAMPLE


# --- splits, mixture, files ---------------------------------------------------------------------------------


def test_splits_are_question_disjoint_sized_and_prefix_stable(splits):
    for name in TASK_NAMES:
        got = splits[name]
        assert {sp: len(exs) for sp, exs in got.items()} == SIZES
        questions = {sp: {ex.question for ex in exs} for sp, exs in got.items()}
        assert sum(len(q) for q in questions.values()) == 200  # distinct, and no question in two splits
        assert [ex.question for ex in load_task(name, {"heldout": 10}, seed=1)["heldout"]] == \
            [ex.question for ex in got["heldout"][:10]]  # held out whatever the other sizes
        assert TASKS[name].domain == got["sft"][0].domain
    assert [TASKS[n].stream for n in TASK_NAMES] == [5 << 40, 6 << 40, 7 << 40]
    assert MIXES["coding"] == {"code_fn": 1, "swe_patch": 1, "swe_agent": 1} and domains("coding") == ["code", "swe", "swe_agent"]
    mix = load_task("coding", {"heldout": 8, "rl": 30, "sft": 30})
    assert len(mix["heldout"]) == 24 and len(mix["rl"]) == 30
    assert not {ex.question for ex in mix["heldout"]} & {ex.question for ex in mix["rl"] + mix["sft"]}


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's tokenizer, trained on the coding tasks' text (as ``make-tiny-model --task coding``)."""
    return train_tokenizer(corpus("coding", 2000), 512)


def test_token_lengths_fit_the_tiny_model(splits, tokenizer):
    render = PromptRenderer(tokenizer, thinking=True)

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    lengths = {}
    for name in TASK_NAMES:
        examples = every(splits, name)
        prompts = [len(render.ids([{"role": "user", "content": ex.prompt}])) for ex in examples]
        turns = [n_tokens(m["content"].removeprefix(render.prefix)) + 1 for ex in examples
                 for m in (ex.turns or [{"content": TURN_PREFIX + ex.solution}])[::2]]  # + the end of turn
        lengths[name] = (int(np.median(prompts)), max(prompts), int(np.median(turns)), max(turns))
        assert max(prompts) <= 160 and max(turns) <= 70, (name, lengths[name])
    trajectories = [len(encode_trace(render, ({"role": "user", "content": ex.prompt},), ex.turns)[0])
                    for ex in every(splits, "swe_agent")]
    assert max(trajectories) <= 440, max(trajectories)
    print(lengths, "swe_agent trajectory p50/max", int(np.median(trajectories)), max(trajectories))


def test_make_data_coding_reads_back_through_the_data_path(tmp_path, tokenizer):
    from cascade_rl.supervisor.cli import main
    from cascade_rl.supervisor.run_data import registered_domains
    from cascade_rl.supervisor.schema import DataConfig

    out = tmp_path / "coding"
    assert main(["make-data", "coding", "--out", str(out), "--heldout", "4", "--rl", "12", "--sft", "12"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["name"] == "coding" and set(manifest["files"]["rl"]) == set(TASK_NAMES)
    rows = {t: [json.loads(line) for line in (out / "sft" / f"{t}.jsonl").read_text().splitlines()] for t in TASK_NAMES}
    assert [r.get("env", "") for r in rows["swe_agent"]] == ["swe"] * len(rows["swe_agent"])
    assert all(isinstance(r["response"], str) for t in ("code_fn", "swe_patch") for r in rows[t])
    assert all([m["role"] for m in r["response"]] == ["assistant", "tool"] * 3 + ["assistant"] for r in rows["swe_agent"])
    # the launch's path: every row parsed and checked by its domain's row check, prompts rendered
    data = OmegaConf.structured(DataConfig(files=[str(p) for p in sorted((out / "rl").glob("*.jsonl"))],
                                           eval_files=[str(p) for p in sorted((out / "heldout").glob("*.jsonl"))]))
    report = prepare(data, tokenizer, tmp_path / "prepared", registered_domains([]))
    assert report.bad_lines == [] and not report.bad
    assert report.domains["eval"] == {"code": 4, "swe": 4, "swe_agent": 4} and report.envs["swe"] > 0
    train = PromptSet(tmp_path / "prepared" / "train.arrow").rows()
    assert {(r.domain, r.env) for r in train} == {("code", ""), ("swe", ""), ("swe_agent", "swe")}
    # SFT: the multi-turn rows encode token-exactly as the chat template renders the whole conversation
    sft_files = [str(out / "sft" / f"{t}.jsonl") for t in TASK_NAMES]
    sft_rows = read_sft_rows(sft_files, DataConfig().fields)
    encoded = encode_examples(tokenizer, sft_rows)
    assert len(encoded) == len(sft_rows) == sum(len(r) for r in rows.values())
    render = PromptRenderer(tokenizer, thinking=True)
    for r in rows["swe_agent"]:
        prompt = ({"role": "user", "content": r["prompt"]},)
        ids, mask = encode_trace(render, prompt, tuple(r["response"]))
        full = tokenizer.apply_chat_template([*prompt, *r["response"]], tokenize=True, enable_thinking=True)["input_ids"]
        assert ids == full[: len(ids)] and tokenizer.decode(full[len(ids):]) == "\n"
        learned = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert learned.count(tokenizer.eos_token) == 4 and "def " not in learned  # tool turns are never learned


def test_params_of_a_mixture_do_not_reach_the_coding_tasks():
    """held_out_questions hands every task a mixture's arithmetic settings: the coding generators ignore them."""
    for name in TASK_NAMES:
        assert [ex.question for ex in load_task(name, {"heldout": 3}, min_terms=2)["heldout"]] == \
            [ex.question for ex in load_task(name, {"heldout": 3})["heldout"]]


def test_the_catalog_bugs_are_real_and_equivalent_mutants_never_injected():
    assert "a if a >= b else b" not in bugs("max_of")  # equal when a == b: no test could tell it apart
    for name, (_, body) in CATALOG.items():
        assert bugs(name) and body not in bugs(name), name


def test_the_swe_rows_of_a_file_are_what_the_example_says(splits):
    ex = every(splits, "swe_agent")[0]
    from cascade_rl.data.builtin import example_row

    row = example_row(ex, "x")
    assert row["env"] == "swe" and row["response"] == [dict(m) for m in ex.turns] and row["answer"] == ex.answer

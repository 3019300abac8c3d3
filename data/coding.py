"""The coding tasks (Nemotron-Cascade 2 §4.7-4.8 in miniature): code RL, agentless SWE RL and execution-based
agentic SWE RL, procedurally generated and small enough for the tiny model.

    from cascade_rl.data.tasks import load_task
    load_task("coding", {"heldout": 64, "rl": 2000, "sft": 1000})  # the mixture: the three tasks, equally weighted
    # cascade-rl make-data coding --out DIR  writes them as data files (data/builtin.py)

| task | domain | the prompt asks for | reference | metadata |
| --- | --- | --- | --- | --- |
| code_fn | code | a function from a spec in words, in a python code block | the function | ``{"humaneval": {"test", "entry_point"}}`` |
| swe_patch | swe | one SEARCH/REPLACE edit fixing the issue in the file shown | the patch | ``{"files", "tests"}`` |
| swe_agent | swe_agent | tool calls (env ``swe``) that fix the issue, then what was wrong | the patch | ``{"files", "tests"}`` |

``code_fn`` (HumanEval form, verifiers/code.py): "Write a Python function `calc(x)` that returns x times 3 plus 2.
Reply with the function in a ```python block." A spec is one of ``FAMILIES`` (1-2 arguments; arithmetic with
constants, ``max``/``min``, a conditional, a sum over a range) under a name of ``FUNCTION_NAMES``. The worked
solution restates the words as the expression (``returns x * 3 + 2``), then writes the function. The hidden tests
are 3-5 asserts on inputs chosen so that every single-point mutant of the expression (an operator, comparison,
constant or argument changed: data/mutants.py) fails one; a spec that some mutant would survive is not asked.

``swe_patch`` and ``swe_agent`` (repositories of data/swe_repos.py, verifiers/swe.py) are a module of 2-4 one-line
functions of ``CATALOG`` (``double``, ``add``, ``is_even``, ``clamp``, ...), one with an injected bug, and an
issue: "is_between(10, 3, 6) returns True, expected False." ``swe_patch`` shows the file and the issue; its worked
solution names the function and what it has instead of what ("is_between has x instead of hi."), then the edit.
``swe_agent`` shows the issue and the file names; its SFT trace (``Example.turns``, a rollout of
environments/swe.py) reads the file, replaces the buggy expression (``edit_file``), runs the visible tests
(``test_<module>.py``: "3 passed") and answers "Fixed is_between: it had x instead of hi."; its reward is the
hidden tests on the files the episode left (``metadata["env_state"]``). The hidden tests assert over every
function, on inputs that tell each from every one of its mutants, so the bug, a wrong fix and an edit of another
function fail them.

Token lengths with the tiny model's tokenizer trained on this mixture (512 tokens; tests/test_coding_tasks.py
checks them), p50 / max over 1200 items:

| task | prompt (chat template) | model turn (``</think>`` and EOS included) |
| --- | --- | --- |
| code_fn | 50 / 69 | 40 / 58 |
| swe_patch | 103 / 149 | 44 / 58 |
| swe_agent | 117 / 140 | read 28, edit 46 / 66, run 21, answer 21 / 26; a whole trajectory 338 / 396 |
"""

from __future__ import annotations

import dataclasses
import functools
import random

from .mutants import cover, function, kill_sets, told_apart
from .swe_repos import Repo, agent_problems, patch_problems
from .task_base import TURN_PREFIX, Example, Task, register_mix, register_task, think, tool_call

CODE_INSTRUCTION = "Reply with the function in a ```python block."
PATCH_INSTRUCTION = "Reply with one SEARCH/REPLACE edit that fixes it."
AGENT_INSTRUCTION = ("Tools: list_files {}, read_file {path}, edit_file {path, search, replace}, run_tests {}. "
                     "Fix the bug, run the tests, then say what you fixed.")
SWE_ENV = "swe"  # the environment of swe_agent's rows (environments/swe.py)
FUNCTION_NAMES = ("compute", "calc", "score", "combine", "convert", "step", "scale", "mix")
ONE_PARAM = ("x", "n", "v")
TWO_PARAMS = (("a", "b"), ("x", "y"), ("m", "n"))

# (the spec in words, the expression), over {x} or {a}, {b}, with constants {K} (2-9), {C} (1-9), {T} (0-9).
FAMILIES = (
    ("{x} times {K} plus {C}", "{x} * {K} + {C}"),
    ("{x} times {K} minus {C}", "{x} * {K} - {C}"),
    ("{x} plus {C}, times {K}", "({x} + {C}) * {K}"),
    ("{x} minus {C}, times {K}", "({x} - {C}) * {K}"),
    ("{x} times {K} if {x} is greater than {T}, else {x} plus {C}", "{x} * {K} if {x} > {T} else {x} + {C}"),
    ("{x} minus {C} if {x} is less than {T}, else {x} times {K}", "{x} - {C} if {x} < {T} else {x} * {K}"),
    ("the sum of the numbers from 0 to {x}, times {K}", "sum(range({x} + 1)) * {K}"),
    ("the larger of {a} and {b}, plus {C}", "max({a}, {b}) + {C}"),
    ("the smaller of {a} and {b}, times {K}", "min({a}, {b}) * {K}"),
    ("{a} plus {b}, times {K}", "({a} + {b}) * {K}"),
    ("{a} times {K} minus {b}", "{a} * {K} - {b}"),
    ("{a} times {b} plus {C}", "{a} * {b} + {C}"),
    ("{a} minus {b} if {a} is greater than {b}, else {b} times {K}", "{a} - {b} if {a} > {b} else {b} * {K}"),
)
# The inputs hidden tests are chosen from: small, so a threshold's neighbours and equal arguments are among them.
INPUTS = {1: [(x,) for x in range(-5, 16)], 2: [(a, b) for a in range(-2, 6) for b in range(-2, 6)]}


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """One ``code_fn`` item: the question, the function's name, parameters and expression, its hidden tests."""

    question: str
    name: str
    params: tuple[str, ...]
    expression: str
    tests: tuple[tuple[tuple[int, ...], int], ...]
    """(arguments, value) of each assert."""

    @property
    def program(self) -> str:
        return f"def {self.name}({', '.join(self.params)}):\n    return {self.expression}\n"

    @property
    def check(self) -> str:
        """The HumanEval ``check(candidate)`` of the hidden tests."""
        asserts = "".join(f"    assert candidate({', '.join(map(str, args))}) == {value!r}\n"
                          for args, value in self.tests)
        return f"def check(candidate):\n{asserts}"


@functools.cache  # a few thousand (family, parameters, constants) in all
def _told(symbolic: str, params: tuple[str, ...], constants: tuple[tuple[str, int], ...]) -> tuple[list[int], int] | None:
    """The mutants each input tells apart (mutants.py ``told_apart``) and how many there are; None when one is
    equivalent to the expression on every input."""
    kills = kill_sets(symbolic, params, INPUTS[len(params)], dict(constants))
    return (told_apart(kills, len(INPUTS[len(params)])), len(kills)) if all(kills.values()) else None


def _spec(rng: random.Random) -> FunctionSpec | None:
    """A random spec, or None when some mutant of its expression agrees with it on every input (no tests could
    tell the two apart) or takes more than 5 asserts to catch."""
    words, expression = rng.choice(FAMILIES)
    arity = 2 if "{a}" in expression else 1
    params = rng.choice(TWO_PARAMS) if arity == 2 else (rng.choice(ONE_PARAM),)
    names = dict(zip(("a", "b"), params)) if arity == 2 else {"x": params[0]}
    drawn = {"K": rng.randint(2, 9), "C": rng.randint(1, 9), "T": rng.randint(0, 9)}
    constants = {name: value for name, value in drawn.items() if f"{{{name}}}" in expression}
    # a family compiles once per parameter names: its constants are arguments of the functions (mutants.py)
    symbolic = expression.format(**names, K="K", C="C", T="T")
    expression, words = expression.format(**names, **drawn), words.format(**names, **drawn)
    inputs = INPUTS[arity]
    told = _told(symbolic, params, tuple(constants.items()))
    chosen = None if told is None else cover(*told, rng)
    if chosen is None:
        return None
    fn = function(expression, params)
    tests = tuple((inputs[i], fn(*inputs[i])) for i in chosen)
    name = rng.choice(FUNCTION_NAMES)
    question = f"Write a Python function `{name}({', '.join(params)})` that returns {words}."
    return FunctionSpec(question, name, params, expression, tests)


def function_specs(size: int, seed: int, **params) -> list[FunctionSpec]:
    """The stream's first ``size`` specs. ``params`` are ignored: a mixture hands every task the arithmetic
    settings (data/tasks.py ``held_out_questions``), which do not apply here."""
    rng, out = random.Random(seed), []
    while len(out) < size:
        spec = _spec(rng)
        if spec is not None:
            out.append(spec)
    return out


def _code_fn(spec: FunctionSpec, seed: int) -> Example:
    solution = think([f"returns {spec.expression}"], f"```python\n{spec.program}```")
    metadata = {"humaneval": {"test": spec.check, "entry_point": spec.name}}
    return Example(spec.question, spec.program, "code", solution, CODE_INSTRUCTION, metadata)


def _swe_patch(repo: Repo, seed: int) -> Example:
    metadata = {"files": {repo.path: repo.source}, "tests": repo.hidden_tests}
    return Example(repo.question, repo.patch, "swe", think([repo.diagnosis], repo.patch), PATCH_INSTRUCTION,
                   metadata)


def _swe_agent(repo: Repo, seed: int) -> Example:
    # the trace of a rollout of environments/swe.py: read the file, replace the buggy expression (a search text the
    # file holds once), run the visible tests, say what was wrong. The edit's turn thinks nothing and searches the
    # expression, not the line: its JSON alone is ~35 tokens of the tiny tokenizer, and a turn has ~64.
    final = think([], f"Fixed {repo.buggy}: it had {repo.slip}.")
    calls = [think([], tool_call("read_file", {"path": repo.path})),
             think([], tool_call("edit_file", {"path": repo.path, "search": repo.bug, "replace": repo.fix})),
             think([], tool_call("run_tests", {})),
             final]
    observations = [repo.source, f"Edited {repo.path}.", f"{len(repo.names)} passed"]
    turns = []
    for i, call in enumerate(calls):
        turns.append({"role": "assistant", "content": TURN_PREFIX + call})
        if i < len(observations):
            turns.append({"role": "tool", "content": observations[i]})
    metadata = {"files": {repo.path: repo.source, repo.test_path: repo.visible_tests}, "tests": repo.hidden_tests}
    return Example(repo.question, repo.patch, "swe_agent", final, AGENT_INSTRUCTION, metadata, tuple(turns), SWE_ENV)


for _name, _task in {
    "code_fn": Task(_code_fn, "code", 5 << 40, function_specs),
    "swe_patch": Task(_swe_patch, "swe", 6 << 40, patch_problems),
    "swe_agent": Task(_swe_agent, "swe_agent", 7 << 40, agent_problems),
}.items():
    register_task(_name, _task)

# code RL, agentless SWE and agentic SWE, equally weighted
register_mix("coding", {"code_fn": 1, "swe_patch": 1, "swe_agent": 1})

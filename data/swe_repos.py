"""Buggy miniature repositories of the SWE tasks of data/coding.py (``swe_patch``, ``swe_agent``).

    from cascade_rl.data.swe_repos import patch_problems
    repo = patch_problems(1, seed=0)[0]
    repo.source        # "def add(a, b):\n    return a + b\n\ndef is_between(x, lo, hi):\n    return lo <= x <= x\n..."
    repo.issue         # "is_between(10, 3, 6) returns True, expected False."
    repo.diagnosis     # "is_between has x instead of hi."
    repo.patch         # "mathops.py\n<<<<<<< SEARCH\n    return lo <= x <= x\n=======\n    return lo <= x <= hi\n..."
    repo.hidden_tests  # "from mathops import add, is_between, square\nassert add(6, -2) == 4\n..."

A repository is one module (a name of ``FILE_NAMES``) of 2-4 one-line functions of ``CATALOG`` whose names say
what they do; one has a bug, a single-point mutant of its body (data/mutants.py: an operator swapped, a constant
off by one, a comparison flipped, a wrong variable, ``min`` for ``max``, the branches swapped) that changes its
value somewhere, and whose text occurs once in the file. Each function's hidden asserts (2-5) tell it from every
mutant of its body that is not equivalent to it on ``INPUTS`` (equivalent ones, such as ``a if a >= b else b``
for ``max_of``, are never injected), so the bug and any one-slip fix fail them; the buggy function's first assert
is the issue's example. The visible tests (``test_<module>.py``, for ``swe_agent``) hold one ``test_<function>``
per function: its first hidden assert.
"""

from __future__ import annotations

import dataclasses
import functools
import random

from .mutants import cover, function, kill_sets, mutants, told_apart

# name -> (parameters, the body's expression): what the name says it does
CATALOG: dict[str, tuple[tuple[str, ...], str]] = {
    "double": (("x",), "x * 2"),
    "triple": (("x",), "x * 3"),
    "square": (("x",), "x * x"),
    "inc": (("x",), "x + 1"),
    "dec": (("x",), "x - 1"),
    "half": (("x",), "x // 2"),
    "add": (("a", "b"), "a + b"),
    "sub": (("a", "b"), "a - b"),
    "mul": (("a", "b"), "a * b"),
    "avg": (("a", "b"), "(a + b) // 2"),
    "is_even": (("x",), "x % 2 == 0"),
    "is_odd": (("x",), "x % 2 == 1"),
    "is_positive": (("x",), "x > 0"),
    "is_negative": (("x",), "x < 0"),
    "max_of": (("a", "b"), "a if a > b else b"),
    "min_of": (("a", "b"), "a if a < b else b"),
    "abs_diff": (("a", "b"), "abs(a - b)"),
    "clamp": (("x", "lo", "hi"), "max(lo, min(x, hi))"),
    "is_between": (("x", "lo", "hi"), "lo <= x <= hi"),
    "sum_to": (("n",), "sum(range(n + 1))"),
}
FILE_NAMES = ("utils.py", "helpers.py", "calc.py", "mathops.py")
# The inputs asserts are chosen from, by arity (``clamp``'s and ``is_between``'s bounds in order).
INPUTS = {1: [(x,) for x in range(-4, 13)], 2: [(a, b) for a in range(-3, 8) for b in range(-3, 8)],
          3: [(x, lo, hi) for x in range(-2, 11) for lo in range(0, 5) for hi in range(lo + 1, lo + 6)]}


@functools.cache
def bugs(name: str) -> dict[str, frozenset[int]]:
    """The mutants of a catalog function's body that differ from it somewhere -> the inputs where they do."""
    params, body = CATALOG[name]
    return {m: k for m, k in kill_sets(body, params, INPUTS[len(params)]).items() if k}


@functools.cache
def _told(name: str) -> list[int]:
    return told_apart(bugs(name), len(INPUTS[len(CATALOG[name][0])]))


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(str, args))})"


@dataclasses.dataclass(frozen=True)
class Repo:
    """One buggy repository (the module docstring), and its question in one prompt form."""

    question: str
    path: str
    names: tuple[str, ...]
    buggy: str
    bug: str
    issue: str
    tests: tuple[tuple[str, tuple[tuple, object]], ...]
    """(function, (arguments, value)) of each hidden assert, the functions in file order."""

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py")

    @property
    def test_path(self) -> str:
        return f"test_{self.path}"

    @property
    def fix(self) -> str:
        """The buggy function's right body."""
        return CATALOG[self.buggy][1]

    def body(self, name: str) -> str:
        return self.bug if name == self.buggy else CATALOG[name][1]

    @property
    def source(self) -> str:
        return "\n".join(f"def {n}({', '.join(CATALOG[n][0])}):\n    return {self.body(n)}\n" for n in self.names)

    @property
    def hidden_tests(self) -> str:
        asserts = "".join(f"assert {_call(n, args)} == {value!r}\n" for n, (args, value) in self.tests)
        return f"from {self.module} import {', '.join(self.names)}\n{asserts}"

    @property
    def visible_tests(self) -> str:
        first = {}
        for n, case in self.tests:
            first.setdefault(n, case)
        cases = "".join(f"\ndef test_{n}():\n    assert {_call(n, args)} == {value!r}\n" for n, (args, value) in first.items())
        return f"from {self.module} import {', '.join(self.names)}\n{cases}"

    @property
    def lines(self) -> tuple[str, str]:
        """The buggy line and the fixed one."""
        return f"    return {self.bug}", f"    return {self.fix}"

    @property
    def patch(self) -> str:
        old, new = self.lines
        return f"{self.path}\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE"

    @property
    def slip(self) -> str:
        """What the buggy body has instead of what: "+ instead of *"."""
        params, body = CATALOG[self.buggy]
        return mutants(body, params)[self.bug]

    @property
    def diagnosis(self) -> str:
        return f"{self.buggy} has {self.slip}."


def _repo(rng: random.Random, agent: bool) -> Repo | None:
    """A random repository, or None when its buggy line is not unique in the file or asserts cannot be chosen."""
    path = rng.choice(FILE_NAMES)
    names = tuple(rng.sample(sorted(CATALOG), rng.randint(2, 4)))
    buggy = rng.choice(names)
    bug = rng.choice(sorted(bugs(buggy)))
    params, body = CATALOG[buggy]
    inputs = INPUTS[len(params)]
    shown = rng.choice(sorted(bugs(buggy)[bug]))  # the issue's example: where the bug shows
    try:
        right, wrong = function(body, params)(*inputs[shown]), function(bug, params)(*inputs[shown])
    except Exception:  # the bug raises there: an issue says what it returns
        return None
    issue = f"{_call(buggy, inputs[shown])} returns {wrong!r}, expected {right!r}."
    tests = []
    for n in names:
        ps, b = CATALOG[n]
        candidates = INPUTS[len(ps)]
        chosen = cover(_told(n), len(bugs(n)), rng, low=2, high=5, must=[shown] if n == buggy else ())
        if chosen is None:
            return None
        fn = function(b, ps)
        tests += [(n, (candidates[i], fn(*candidates[i]))) for i in chosen]
    repo = Repo("", path, names, buggy, bug, issue, tuple(tests))
    if repo.source.count(repo.bug) != 1:  # the search text must name one place (another body may hold it)
        return None
    if agent:
        question = f"Issue: {issue} The repository has {path} ({', '.join(names)}) and {repo.test_path}."
    else:
        question = f"{path}:\n{repo.source}\nIssue: {issue}"
    return dataclasses.replace(repo, question=question)


def _problems(size: int, seed: int, agent: bool) -> list[Repo]:
    rng, out = random.Random(seed), []
    while len(out) < size:
        repo = _repo(rng, agent)
        if repo is not None:
            out.append(repo)
    return out


def patch_problems(size: int, seed: int, **params) -> list[Repo]:
    """The stream's first ``size`` repositories, asked as ``swe_patch`` questions (``params`` ignored, as
    data/coding.py ``function_specs`` does)."""
    return _problems(size, seed, agent=False)


def agent_problems(size: int, seed: int, **params) -> list[Repo]:
    """The stream's first ``size`` repositories, asked as ``swe_agent`` questions."""
    return _problems(size, seed, agent=True)

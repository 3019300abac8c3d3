"""The arithmetic tasks: the four single-turn domains of the miniature cascade and the tool tasks.

A miniature of the paper's cascade for the tiny model: every task is small
+/- arithmetic (reasoning-gym basic_arithmetic, 3-4 terms of 0-10), asked in
the format of one reward domain. Each task draws its own expression stream.
The tool tasks are the miniature of tool-integrated reasoning: 3-term
arithmetic of 2-3 digits with multiplication, which the tiny model cannot do in
its head, asked with a python tool (``tool_arithmetic``) and without one
(``tool_arithmetic_direct``), on the same questions.

| task | domain | the prompt asks for | reference | metadata |
| --- | --- | --- | --- | --- |
| arithmetic | math | the value in ``\\boxed{}`` | the value | — |
| arithmetic_mcqa | mcqa | the letter of (A)-(D) in ``\\boxed{}`` | the letter | ``{"options": ["A", "B", "C", "D"]}`` |
| arithmetic_json | structured_output | ``{"KEY": N}``, KEY of ``JSON_KEYS`` | the schema | ``{"schema": ...}`` |
| arithmetic_if | instruction_following | ``\\boxed{}`` + one IFEval instruction | the value | IFEval ids, kwargs |
| tool_arithmetic | tool_use | a python tool call, then the value in ``\\boxed{}`` | the value | — |
| tool_arithmetic_direct | math | the value in ``\\boxed{}`` (no tool) | the value | — |

The MCQA options are four consecutive values in order, the answer's place
uniform. The JSON schema admits exactly ``{KEY: value}`` (``const``), so a
wrong value, key or extra key scores 0; the reference holds it too (JSON
text), so a caller that drops the metadata still scores correctly.
``arithmetic_if`` draws one instruction of ``IF_INSTRUCTIONS``; as in IFEval
the reward checks the instruction only, not the value. Worked solutions need
at most ~60 tokens of the tiny tokenizer (``</think>`` and EOS included).

``tool_arithmetic`` is multi-turn (rows of environment ``"python"``, the
row's ``env``): its SFT trace (``Example.turns``) is the model's tool call
(an empty think, then ``<tool_call>{"name": "python", "arguments": {"code":
"print(EXPR)"}}</tool_call>``, Hermes/Qwen3 style), the tool's turn (the
program's stdout, ``"4116\\n"``) and the model's final answer (an empty think,
then ``\\boxed{4116}``), which the strict math check scores. Its value is
Python's (the usual precedence, as the tool computes it). ``tool_arithmetic_direct``
asks the same questions (the same stream: the same held-out questions)
without the tool, and answers at once: the same model is evaluated with and
without tools on the same questions. Tasks sharing a stream ask the same
questions in every split, so a mixture of both trains on some questions in
both forms.

Mixtures (``MIXES``) combine tasks by weight: ``cascade`` is every domain of
the single-turn cascade (the SFT warm start and the held-out set evaluated
after every stage), ``multi_domain`` the paper's multi-domain RL stage (MCQA
and structured output) plus math, ``tools`` the tool task with its direct
twin. See ``load_mixture`` for how a mixture's splits are drawn.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import random
import re
from collections.abc import Callable

import reasoning_gym

from .task_base import BOXED_INSTRUCTION, TURN_PREFIX, Example, Task, register_mix, register_task, think, tool_call

MCQA_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}."
MCQA_LETTERS = ("A", "B", "C", "D")
JSON_KEYS = ("result", "value", "answer", "total", "sum")
END_PHRASES = ("That is all.", "Any other questions?", "Hope this helps.")
TITLE = "<<Result>>"
# The tool tasks: the prompt names the tool (the tiny model learns the call's form from SFT), and the environment
# of their rows (the ``env`` field; environments/) runs the code and answers with its stdout.
TOOL_INSTRUCTION = "Use the python tool. Put the final answer in \\boxed{}."
PYTHON_ENV = "python"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One arithmetic item: its question, left-to-right worked steps (none for the tool tasks) and value."""

    question: str
    expression: str
    steps: tuple[str, ...]
    value: int

    def rng(self, seed: int) -> random.Random:
        """Random choices (options, key, instruction) per question: independent of its place in the stream."""
        return random.Random(f"{seed}/{self.expression}")


_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _arithmetic_steps(expression: str) -> list[str]:
    """Left-to-right worked steps for an expression: '7 + 5 - 3' -> ['7 + 5 = 12', '12 - 3 = 9'] (for +/- the
    value; with * reasoning-gym's left-to-right answer, not the usual precedence)."""
    tokens = expression.split()
    acc = int(tokens[0])
    steps = []
    for op, term in zip(tokens[1::2], tokens[2::2]):
        value = _OPERATORS[op](acc, int(term))
        steps.append(f"{acc} {op} {term} = {value}")
        acc = value
    return steps


def worked_solution(reasoning: list[str], answer: str) -> str:
    return think(reasoning, f"\\boxed{{{answer}}}")


def _problems(size: int, seed: int, **params) -> list[Problem]:
    cfg = dict(min_terms=3, max_terms=4, min_digits=1, max_digits=1, operators=("+", "-"))
    cfg.update(params)
    cfg.update(allow_parentheses=False, allow_negation=False, format_style="simple", whitespace="single")
    if set(cfg["operators"]) - {"+", "-"}:
        raise ValueError("the arithmetic tasks' worked solutions cover + and - only")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, **cfg)
    out = []
    for item in ds:
        expression = item["metadata"]["expression"]
        if not re.fullmatch(r"\d+( [+-] \d+)+", expression):
            raise ValueError(f"unexpected expression form {expression!r}")
        steps = _arithmetic_steps(expression)
        if steps[-1].split(" = ")[1] != str(item["answer"]):
            raise ValueError(f"worked steps disagree with reasoning-gym on {expression!r}")
        out.append(Problem(item["question"], expression, tuple(steps), int(item["answer"])))
    return out


def _tool_problems(size: int, seed: int, **params) -> list[Problem]:
    """``size`` problems of the tool tasks: 3 terms of up to 2-3 digits (0-100 or 0-1000) with at least one ``*``
    (an item without one is skipped), no worked steps.

    reasoning-gym's simple expressions fold left to right (its answer to '47 + 83 * 2' is 260); the question means
    the usual precedence, which is what the python tool prints (213). So the value is Python's, and reasoning-gym's
    answer is checked against a left-to-right fold: an expression read otherwise than it was built is refused."""
    cfg = dict(min_terms=3, max_terms=3, min_digits=2, max_digits=3, operators=("+", "-", "*"))
    cfg.update(params)
    cfg.update(allow_parentheses=False, allow_negation=False, format_style="simple", whitespace="single")
    if "*" not in cfg["operators"] or set(cfg["operators"]) - set(_OPERATORS):
        raise ValueError(f"the tool tasks ask for multiplication: operators must include '*' and be of "
                         f"{sorted(_OPERATORS)}, got {cfg['operators']}")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=4 * size + 64, seed=seed, **cfg)
    out = []
    for item in ds:
        if len(out) == size:
            break
        expression = item["metadata"]["expression"]
        if not re.fullmatch(r"\d+( [-+*] \d+)+", expression):
            raise ValueError(f"unexpected expression form {expression!r}")
        if "*" not in expression:
            continue
        if _arithmetic_steps(expression)[-1].split(" = ")[1] != str(item["answer"]):
            raise ValueError(f"a left-to-right fold disagrees with reasoning-gym on {expression!r}")
        value = eval(expression, {"__builtins__": {}})  # digits, spaces, + - * only (matched above)
        out.append(Problem(item["question"], expression, (), value))
    if len(out) < size:
        raise ValueError(f"only {len(out)} of {len(ds)} expressions have a '*', {size} wanted")
    return out


# --- tasks: one Problem -> one Example per domain ----------------------------------------------------


def _arithmetic(p: Problem, seed: int) -> Example:
    return Example(p.question, str(p.value), "math", worked_solution(p.steps, str(p.value)))


def _arithmetic_mcqa(p: Problem, seed: int) -> Example:
    # Four consecutive values in order, the answer's place uniform: the distractors are off-by-one-to-three
    # slips. The worked solution finds the place as an offset from (A), one more step of the arithmetic the
    # model already does; the letter then follows from that digit. (Matching the value against unordered
    # options, or copying a letter from the reasoning, stayed at chance after SFT.)
    place = p.rng(seed).randrange(len(MCQA_LETTERS))
    letter, first = MCQA_LETTERS[place], p.value - place
    options = " ".join(f"({ch}) {first + i}" for i, ch in enumerate(MCQA_LETTERS))
    offset = f"{p.value} - {first} = {place}" if first >= 0 else f"{p.value} + {-first} = {place}"
    solution = think([*p.steps, offset], f"\\boxed{{{letter}}}")
    return Example(p.question, letter, "mcqa", solution, f"Options: {options}. {MCQA_INSTRUCTION}",
                   {"options": list(MCQA_LETTERS)})


def _arithmetic_json(p: Problem, seed: int) -> Example:
    key = p.rng(seed).choice(JSON_KEYS)
    # the schema holds the correct value: valid JSON with the wrong value, key or an extra key scores 0
    schema = {"type": "object", "properties": {key: {"const": p.value}}, "required": [key],
              "additionalProperties": False}
    # the prompt shows the object's form, as structured-output prompts show a schema; copying the key is
    # the skill the tiny model learns last (still at chance after 600 SFT steps): what RL has to teach
    instruction = f'Reply with a JSON object of the form {{"{key}": N}}, where N is the result as an integer.'
    return Example(p.question, json.dumps(schema), "structured_output", think(p.steps, json.dumps({key: p.value})),
                   instruction, {"schema": schema})


# IFEval instructions a short boxed answer can follow and a tiny model can learn, none of them followed
# by the bare "\boxed{v}": id -> (kwargs, prompt text, final answer), given the problem, its boxed value
# and the question's rng. Their checks are the ports in verifiers/instruction_following.py.
IfInstruction = Callable[[Problem, str, random.Random], tuple[dict, str, str]]


def _quotation(p: Problem, boxed: str, rng: random.Random) -> tuple[dict, str, str]:
    return {}, "Wrap your entire response with double quotation marks.", f'"{boxed}"'


def _end_checker(p: Problem, boxed: str, rng: random.Random) -> tuple[dict, str, str]:
    phrase = rng.choice(END_PHRASES)
    text = f'Finish your response with this exact phrase "{phrase}". No other words should follow this phrase.'
    return {"end_phrase": phrase}, text, f"{boxed} {phrase}"


def _postscript(p: Problem, boxed: str, rng: random.Random) -> tuple[dict, str, str]:
    marker = rng.choice(("P.S.", "P.P.S"))
    text = f"At the end of your response, please explicitly add a postscript starting with {marker}"
    return {"postscript_marker": marker}, text, f"{boxed}\n{marker} All done."


def _title(p: Problem, boxed: str, rng: random.Random) -> tuple[dict, str, str]:
    text = "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."
    return {}, text, f"{TITLE}\n{boxed}"


def _repeat_prompt(p: Problem, boxed: str, rng: random.Random) -> tuple[dict, str, str]:
    text = "First repeat the question word for word without change, then give your answer."
    return {"prompt_to_repeat": p.question}, text, f"{p.question} {boxed}"


IF_INSTRUCTIONS: dict[str, IfInstruction] = {
    "startend:quotation": _quotation,
    "startend:end_checker": _end_checker,
    "detectable_content:postscript": _postscript,
    "detectable_format:title": _title,
    "combination:repeat_prompt": _repeat_prompt,
}


def _arithmetic_if(p: Problem, seed: int) -> Example:
    rng = p.rng(seed)
    iid = rng.choice(sorted(IF_INSTRUCTIONS))
    kwargs, text, final = IF_INSTRUCTIONS[iid](p, f"\\boxed{{{p.value}}}", rng)
    metadata = {"instruction_id_list": [iid], "kwargs": [kwargs]}
    return Example(p.question, str(p.value), "instruction_following", think(p.steps, final),
                   f"{BOXED_INSTRUCTION} {text}", metadata)


def _tool_arithmetic(p: Problem, seed: int) -> Example:
    # the trace a rollout has: the model's call (the code prints the question's expression as written), the
    # tool's turn (what the program prints) and the model's answer, each model turn after an empty think
    call = think([], tool_call("python", {"code": f"print({p.expression})"}))
    final = worked_solution([], str(p.value))
    turns = ({"role": "assistant", "content": TURN_PREFIX + call},
             {"role": "tool", "content": f"{p.value}\n"},
             {"role": "assistant", "content": TURN_PREFIX + final})
    return Example(p.question, str(p.value), "tool_use", final, TOOL_INSTRUCTION, turns=turns, env=PYTHON_ENV)


def _tool_arithmetic_direct(p: Problem, seed: int) -> Example:
    return Example(p.question, str(p.value), "math", worked_solution([], str(p.value)))


for _name, _task in {
    "arithmetic": Task(_arithmetic, "math", 0, _problems),
    "arithmetic_mcqa": Task(_arithmetic_mcqa, "mcqa", 1 << 40, _problems),
    "arithmetic_json": Task(_arithmetic_json, "structured_output", 2 << 40, _problems),
    "arithmetic_if": Task(_arithmetic_if, "instruction_following", 3 << 40, _problems),
    # one stream: the same questions with the tool and without
    "tool_arithmetic": Task(_tool_arithmetic, "tool_use", 4 << 40, _tool_problems),
    "tool_arithmetic_direct": Task(_tool_arithmetic_direct, "math", 4 << 40, _tool_problems),
}.items():
    register_task(_name, _task)

# every domain of the miniature cascade: the SFT warm start, and the held-out set of every stage
register_mix("cascade", {"arithmetic": 1, "arithmetic_mcqa": 1, "arithmetic_json": 1, "arithmetic_if": 1})
# the paper's multi-domain RL stage (STEM MCQA, structured output), plus math, which has no RL stage of its own in
# the miniature
register_mix("multi_domain", {"arithmetic": 1, "arithmetic_mcqa": 1, "arithmetic_json": 1})
# tool-integrated reasoning: mostly with the python tool, some answered at once (the same questions)
register_mix("tools", {"tool_arithmetic": 3, "tool_arithmetic_direct": 1})

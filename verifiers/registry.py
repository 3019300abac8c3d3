"""Reward functions by domain, registered by name, and the checks of data rows.

A row's ``domain`` names the verifier that scores its rollouts. Built in: math, mcqa,
instruction_following, structured_output, code, tool_call, tool_use, swe and swe_agent (verifiers/swe.py:
SEARCH/REPLACE edits, then hidden tests in the sandbox), chat_quality (the miniature chat task's gold,
verifiers/chat.py), llm_judge, genrm (group).
Add your own in a module listed in ``verifier.plugins``, by module name
(``mypkg.rewards``: importable by the verifier workers, which do not have the cwd on
``sys.path``) or by path to a ``.py`` file (``/data/rewards.py``, or relative to the
directory you launch from). Verifier workers and each of their scoring processes import
the plugins before scoring (``load_plugins``); a file is imported on its own, so import
its helpers from an installed package, not from the file's folder.

**Verifier** ``fn(response: str, reference: str, metadata: dict) -> float``, the reward:

- ``response``: the whole assistant turn as generated, reasoning included:
  ``"<think>\\n...</think>\\n\\nThe answer is 4."``. ``verifiers.text.final_answer_text``
  gives the text after the last ``</think>`` (None when a ``<think>`` never closed).
- ``reference``: the row's ``answer``.
- ``metadata``: the row's ``metadata`` plus ``"question"``, the last user message
  (a ``question`` key of the row's own metadata wins).

It runs in a scoring process, one response at a time, killed past the request's
deadline. Raise only for bad data or a bug, not for a wrong answer: the worker reports
the rollout as not scored (``Score(ok=False)``, reward 0) with the exception as reason.

**Group verifier** ``fn(prompt: str, responses: list[str], reference: str, metadata: dict)
-> list[float]``: scores all responses to one prompt together (pairwise GenRM judging),
one reward per response, in order; ``prompt`` is the prompt's user text.

**Row check** ``check(answer: str, metadata: dict) -> None``: raises (ValueError, with a
short reason) when the domain's verifier would reject a row with this answer and
metadata. Every row is checked before the run starts (``check_row``), so a bad row is
reported as ``FILE:LINE: reason`` instead of failing rollouts later. A check is cheap
and local: no network, no subprocess; a domain need not have one. Register it with its
verifier (``register_verifier(name, check=check)``), or alone (``@register_check(name)``).

Example plugin, ``rewards.py`` (``verifier.plugins=[rewards.py]``; rows of domain
``word_count`` in the data are then scored by it)::

    from cascade_rl.verifiers.registry import register_verifier
    from cascade_rl.verifiers.text import final_answer_text

    def check(answer: str, metadata: dict) -> None:
        if not answer.isdigit():
            raise ValueError(f"answer {answer!r} is not a word count")

    @register_verifier("word_count", check=check)
    def word_count(response: str, reference: str, metadata: dict) -> float:
        text = final_answer_text(response)
        return float(text is not None and len(text.split()) == int(reference))
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from cascade_rl.protocol.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])

Verifier = Callable[[str, str, dict[str, Any]], float]
VERIFIERS = Registry("verifier domain")  # domain -> Verifier

# Group verifiers score all responses of one prompt together (pairwise GenRM judging):
# ``fn(prompt, responses, reference, metadata) -> list[float]``, one reward per response.
GroupVerifier = Callable[[str, list[str], str, dict[str, Any]], list[float]]
GROUP_VERIFIERS = Registry("group verifier")

# Row checks: ``check(answer, metadata) -> None``, raising with the reason a row's verifier would reject it.
Check = Callable[[str, dict[str, Any]], None]
CHECKS = Registry("row check")  # domain -> Check
register_check = CHECKS.register


def _register(registry: Registry, name: str, check: Check | None) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        if check is not None and name in CHECKS:
            raise ValueError(f"row check {name!r} registered twice")
        registry.register(name)(fn)
        if check is not None:
            CHECKS[name] = check
        return fn

    return wrap


def register_verifier(name: str, *, check: Check | None = None) -> Callable[[F], F]:
    """Decorator: ``fn`` scores domain ``name`` (``fn(response, reference, metadata) -> float``); ``check``, if
    given, is the domain's row check (``check(answer, metadata)``, raising with the reason). A second
    registration of either under the same name raises ValueError."""
    return _register(VERIFIERS, name, check)


def register_group_verifier(name: str, *, check: Check | None = None) -> Callable[[F], F]:
    """Decorator: ``fn`` scores the groups of domain ``name`` (``fn(prompt, responses, reference, metadata) ->
    list[float]``); ``check`` as for ``register_verifier``."""
    return _register(GROUP_VERIFIERS, name, check)


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + "..."


def check_row(domain: str, answer: str, metadata: dict[str, Any]) -> str:
    """Why the verifier of ``domain`` would reject a row with this answer and metadata: one line, or "" when the
    row is fine (or its domain has no check). Never raises: a check that fails with ValueError gives its message,
    with another exception (a bug in the check) the exception's type and message. Load the plugins first
    (``load_plugins``): a domain they register is unknown until then."""
    try:
        if not isinstance(domain, str) or (domain not in VERIFIERS and domain not in GROUP_VERIFIERS):
            known = ", ".join(sorted(set(VERIFIERS) | set(GROUP_VERIFIERS)))
            return f"unknown domain {domain!r}; registered: {known}"
        if not isinstance(answer, str):
            return f"answer must be a string, got {type(answer).__name__}"
        if not isinstance(metadata, dict):
            return f"metadata must be a dict (a JSON object), got {type(metadata).__name__}"
        check = CHECKS.get(domain)
        if check is not None:
            check(answer, metadata)
    except ValueError as e:
        return _one_line(str(e)) or "ValueError"
    except Exception as e:
        return _one_line(f"{type(e).__name__}: {e}")
    return ""


class PluginError(RuntimeError):
    """A ``verifier.plugins`` entry could not be loaded; the message names the entry and the cause."""


def _plugin_module_name(path: Path) -> str:
    """The module name a plugin file is imported under: the same for the same file in every process."""
    stem = re.sub(r"\W", "_", path.stem)
    return f"cascade_rl_plugin_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"


def load_plugin(entry: str, setting: str = "verifier.plugins") -> ModuleType:
    """Import one plugin: a dotted module name, or a path to a ``.py`` file (absolute or relative to the cwd;
    imported as ``_plugin_module_name(path)`` and put in ``sys.modules``, so pickled references to it resolve and
    a second load is a no-op). Raises PluginError naming the entry and the cause."""
    where = f"{setting}: {entry}"
    if not isinstance(entry, str) or not entry.strip():
        raise PluginError(f"{setting}: {entry!r} is neither a module name nor a path to a .py file")
    if not (entry.endswith(".py") or "/" in entry or os.sep in entry):
        try:
            return importlib.import_module(entry)
        except Exception as e:
            raise PluginError(f"{where}: {type(e).__name__}: {e}") from e
    path = Path(os.path.abspath(os.path.expanduser(entry)))
    if not path.exists():
        raise PluginError(f"{where}: no such file" + (f" ({path})" if str(path) != entry else ""))
    if not path.is_file() or path.suffix != ".py":
        raise PluginError(f"{where}: not a .py file")
    name = _plugin_module_name(path.resolve())
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{where}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # during its import too: dataclasses and pickle look the module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"{where}: {type(e).__name__}: {e}") from e
    return module


def load_plugins(entries: Iterable[str], setting: str = "verifier.plugins") -> list[ModuleType]:
    """Import each entry with ``load_plugin`` (their ``@register_verifier``s run): every process that scores,
    or checks rows, calls this with the same list. Loading again is harmless."""
    return [load_plugin(entry, setting) for entry in entries]

# Settings the worker hands its scoring processes (``verifier.judge``: endpoint, model, key variable ...).
SETTINGS: dict[str, Any] = {}


def is_group_domain(name: str) -> bool:
    return name in GROUP_VERIFIERS


# Domains scored by the judge model of ``verifier.judge`` (``judge_endpoint``): a launch whose data holds one needs
# ``verifier.judge.model`` (supervisor/run_data.py refuses it before any process starts). A plugin whose verifier
# calls ``judge_endpoint`` adds its domain here.
JUDGED_DOMAINS: set[str] = {"genrm", "llm_judge"}


# --- built-in domains: each check reuses its verifier's own validation (imported lazily, as the verifier is)


def _nonempty_answer(domain: str) -> Check:
    def check(answer: str, metadata: dict[str, Any]) -> None:
        if not answer.strip():
            raise ValueError(f"answer is empty: {domain} compares the response with the reference answer")

    return check


def _check_mcqa(answer: str, metadata: dict[str, Any]) -> None:
    from .mcqa import normalize_reference, valid_options

    normalize_reference(answer, valid_options(metadata))


def _check_instruction_following(answer: str, metadata: dict[str, Any]) -> None:
    from .instruction_following import validate_metadata

    validate_metadata(metadata)


def _check_structured_output(answer: str, metadata: dict[str, Any]) -> None:
    import jsonschema

    from .structured_output import valid_schema

    try:
        valid_schema(answer, metadata)
    except jsonschema.SchemaError as e:
        raise ValueError(e.message) from None


def _check_code(answer: str, metadata: dict[str, Any]) -> None:
    from .code import check_metadata

    check_metadata(metadata)


def _check_tool_call(answer: str, metadata: dict[str, Any]) -> None:
    from .tool_call import parse_reference

    parse_reference(answer)


@register_verifier("math", check=_nonempty_answer("math"))
def _math(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .math import score_math  # math-verify imports sympy: pay for it only where math is scored

    return score_math(response, reference)


# Tool-integrated reasoning (data/tasks.py ``tool_arithmetic``): the trajectory's final assistant turn, after the
# python tool's turns, is scored by the strict math check, as math is.
register_verifier("tool_use", check=_nonempty_answer("tool_use"))(_math)

# Each domain's module is imported when that domain is first scored (nltk, jsonschema ... only where used).


@register_verifier("mcqa", check=_check_mcqa)
def _mcqa(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .mcqa import score_mcqa

    return score_mcqa(response, reference, metadata)


@register_verifier("instruction_following", check=_check_instruction_following)
def _instruction_following(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .instruction_following import score_instruction_following

    return score_instruction_following(response, reference, metadata)


@register_verifier("structured_output", check=_check_structured_output)
def _structured_output(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .structured_output import score_structured_output

    return score_structured_output(response, reference, metadata)


@register_verifier("code", check=_check_code)
def _code(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Strict binary: the program passes every test, run in verifiers/sandbox.py (needs root for namespaces)."""
    from .code import score_code

    return score_code(response, reference, metadata)


@register_verifier("tool_call", check=_check_tool_call)
def _tool_call(response: str, reference: str, metadata: dict[str, Any]) -> float:
    from .tool_call import score_tool_call

    return score_tool_call(response, reference, metadata)


def _check_swe(answer: str, metadata: dict[str, Any]) -> None:
    from .swe import check_metadata

    check_metadata(metadata)


@register_verifier("swe", check=_check_swe)
def _swe(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Agentless and agentic SWE (verifiers/swe.py): the final answer's SEARCH/REPLACE edits applied to the
    repository (``metadata["env_state"]["files"]``, what an agent's environment left, else ``metadata["files"]``),
    then the hidden tests in the sandbox; strict binary."""
    from .swe import score_swe

    return score_swe(response, reference, metadata)


# Agentic SWE (data/coding.py ``swe_agent``, environment swe): the same verifier on the files the episode left; a
# domain of its own, so held-out accuracy and MOPD's teacher are the agentic task's, apart from agentless repair.
register_verifier("swe_agent", check=_check_swe)(_swe)


def _check_chat_quality(answer: str, metadata: dict[str, Any]) -> None:
    from .chat import NAMES

    if metadata.get("kind") not in ("good", "bad") or metadata.get("name") not in NAMES:
        raise ValueError("chat_quality needs metadata {name: one of verifiers/chat.py NAMES, kind: good | bad}")


@register_verifier("chat_quality", check=_check_chat_quality)
def _chat_quality(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """The miniature chat task's gold (verifiers/chat.py): 1.0 for a right, addressed, one-short-sentence reply."""
    from .chat import chat_quality
    from .text import final_answer_text

    return float(chat_quality(metadata, final_answer_text(response)) == 5)


def judge_endpoint():
    """The judge endpoint of ``verifier.judge`` (handed to scoring processes in ``SETTINGS``)."""
    from .llm_judge import JudgeEndpoint

    cfg = SETTINGS.get("judge") or {}
    if not cfg.get("model"):
        raise ValueError("verifier.judge.model is not set: model-judged domains need a judge endpoint")
    return JudgeEndpoint(base_url=cfg["base_url"], model=cfg["model"], api_key_env=cfg.get("api_key_env", ""),
                         concurrency=cfg.get("concurrency", 8), timeout_s=cfg.get("timeout_s", 60.0),
                         max_tokens=cfg.get("max_tokens", 4096), retries=cfg.get("retries", 3))


def genrm_config():
    """RLHF's GenRM settings of ``verifier.judge.genrm`` (handed to scoring processes in ``SETTINGS``)."""
    from .genrm import GenRMConfig

    return GenRMConfig(**(SETTINGS.get("judge") or {}).get("genrm", {}))


@register_group_verifier("genrm")
def _genrm(prompt: str, responses: list[str], reference: str, metadata: dict[str, Any]) -> list[float]:
    """RLHF: pairwise GenRM judging of the whole group (verifiers/genrm.py: win rate, length terms)."""
    from .genrm import score_group
    from .llm_judge import on_judge

    async def run(client) -> list[float]:
        return list((await score_group(client, prompt, responses, genrm_config())).rewards)

    return on_judge(judge_endpoint(), run)


# Held-out verifiers of domains whose training verifier is relative: a group verifier's rewards average 0.5 in
# every group (GenRM's win rates), so they cannot show progress; held-out evaluation scores such a domain's
# responses one at a time against the row's reference instead (ArenaHard-style: the judge's preference for the
# response over a baseline answer). ``fn(response, reference, metadata) -> float``, as a verifier.
EVAL_VERIFIERS = Registry("held-out verifier")
register_eval_verifier = EVAL_VERIFIERS.register


@register_eval_verifier("genrm")
def _genrm_against_baseline(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Held-out RLHF: the judge's preference, in both orders, for the response over the row's baseline answer
    (verifiers/genrm.py ``judge_against_reference``), the conversation being ``metadata["question"]`` (the last user
    message: a chat row's whole prompt). Raises ``JudgeError`` when the judge fails, ValueError for a row
    without a baseline."""
    from .genrm import judge_against_reference
    from .llm_judge import on_judge

    if not reference.strip():
        raise ValueError("genrm held-out evaluation needs the row's answer: a baseline reply to judge against")

    async def run(client) -> float:
        return await judge_against_reference(client, metadata.get("question", ""), response, reference,
                                             genrm_config())

    return on_judge(judge_endpoint(), run)


@register_verifier("exact_answer", check=_nonempty_answer("exact_answer"))
def _exact_answer(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """1.0 when the final answer is the reference itself (verifiers/llm_judge.py ``same_answer``): the gold of
    long-context QA (``long_context_gold``), next to the judge's verdict on the same questions."""
    from .llm_judge import same_answer
    from .text import final_answer_text

    return float(same_answer(final_answer_text(response) or "", reference))


@register_verifier("llm_judge", check=_nonempty_answer("llm_judge"))
def _llm_judge(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Long-context QA: a judge model decides whether the answer matches the reference (verifiers/llm_judge.py)."""
    from .llm_judge import judge_answer, on_judge

    exact_match = (SETTINGS.get("judge") or {}).get("exact_match", True)

    async def run(client) -> float:
        reward, reason = await judge_answer(client, metadata.get("question", ""), response, reference, exact_match)
        if reason.startswith("unparseable"):
            raise ValueError(reason)  # ok=false with the reason: a judge failure, not a wrong answer
        return reward

    return on_judge(judge_endpoint(), run)


@register_verifier("verifiers")
def _verifiers_env(response: str, reference: str, metadata: dict[str, Any]) -> float:
    """Rows of a PrimeIntellect ``verifiers`` environment (``data.verifiers_env``): their environment's rubric scores
    them in the agent runner (environments/verifiers_rollout.py); a request here is an error, never a reward."""
    raise ValueError("rows of data.verifiers_env are scored by their environment's rubric in the agent runner")

"""What an environment is, and ``ToolEnvironment``: the environment of tools called in the model's text.

An **environment** acts on one assistant turn of a multi-turn trajectory::

    env.step(messages, state, metadata) -> StepResult

- ``messages``: the conversation so far, ``{"role", "content"}`` dicts, the new assistant turn last;
- ``state``: what this environment returned for the trajectory's previous step (``{}`` on the first). It
  travels with the trajectory, not with the worker, so any environment worker can serve any step and a
  killed worker loses nothing: keep everything a later step needs in it (JSON-like values only);
- ``metadata``: the data row's.

It answers ``StepResult(done=True)`` when the episode is over (the turn called no tool; the orchestrator then
scores the final turn with the row's verifier), else the tool turns to append, one per call, in order. The
model's mistakes (a bad call, a tool that fails, crashes or hangs) are observations it sees and the counters
count, never exceptions. An exception from ``step`` fails the trajectory (``EnvReply(ok=False)``): keep it for
what is not the model's fault (``ToolUnavailable``: the sandbox cannot start, a service is down).

``ToolEnvironment(settings, tools)`` is the usual one: ``tools`` maps a tool name to
``tool(arguments: dict, state: dict) -> ToolOutcome``; a tool may update ``state`` in place (the step hands a
copy of the incoming state to its tools and returns it). Argument checks raise ``BadArguments`` (use
``string_argument``), which becomes an error observation naming the tool and the problem.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .tool_calls import CallError, parse_tool_calls


@dataclass
class EnvSettings:
    """The limits of environments and their tools, from the run config's ``environment`` section."""

    tool_timeout_s: float = 5.0
    """Wall-clock limit of one tool call; past it the call is killed and answered with an error observation."""
    memory_mb: int = 512
    """Memory limit of one python tool call (RLIMIT_AS of its sandbox)."""
    max_processes: int = 32
    """Processes and threads one python tool call may have (a fork bomb hits it and fails)."""
    max_output_chars: int = 2000
    """A tool's output beyond this is cut, with a marker saying how much was cut (its start and end are kept)."""
    max_calls_per_turn: int = 4
    """Tool calls run per assistant turn; the rest are answered with an error observation, not run."""

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> EnvSettings:
        """From the ``environment`` section of the run config (a DictConfig or dict; missing keys: the defaults,
        keys that are not settings, such as ``slots``, ignored)."""
        section, values = section or {}, {}
        for f in dataclasses.fields(EnvSettings):
            value = section.get(f.name)
            if value is None:
                continue
            try:
                values[f.name] = type(f.default)(value)
            except (TypeError, ValueError):
                raise ValueError(f"environment.{f.name}: {value!r} is not a {type(f.default).__name__}") from None
        return cls(**values)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(EnvSettings):  # its own fields (the launch schema's section extends it)
            if not getattr(self, f.name) > 0:
                raise ValueError(f"environment.{f.name} must be > 0, got {getattr(self, f.name)!r}")


@dataclass
class ToolOutcome:
    """What one tool call gave: the observation the model sees, and whether the call failed."""

    content: str
    error_kind: Literal["", "error", "timeout"] = ""
    """"": the call worked; "error": it failed (a bad call, an exception, a crash); "timeout": killed at its
    deadline."""


@dataclass
class StepResult:
    """An environment's answer to one assistant turn (becomes an ``EnvReply``)."""

    done: bool
    """The episode is over (the turn called no tool): its final turn is scored."""
    tool_messages: list[dict[str, Any]] = field(default_factory=list)
    """``{"role": "tool", "content": ...}``, one per call, in the order of the calls."""
    state: dict[str, Any] = field(default_factory=dict)
    """Handed back with the trajectory's next step."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that failed: a bad call, an exception, a crash, a timeout."""
    timeouts: int = 0
    """Calls killed at their deadline (counted in ``tool_errors`` too)."""


class Environment(Protocol):
    def step(self, messages: list[dict[str, Any]], state: dict[str, Any], metadata: dict[str, Any]) -> StepResult:
        """Act on the last (assistant) message; see the module docstring."""


Tool = Callable[[dict[str, Any], dict[str, Any]], ToolOutcome]


class BadArguments(ValueError):
    """A tool call's arguments are wrong (missing, of the wrong type); the message is shown to the model."""


class ToolUnavailable(RuntimeError):
    """A tool cannot run at all, through no fault of the call (the sandbox cannot start): the step raises, and
    the trajectory fails instead of teaching the model that its call was wrong."""


def string_argument(arguments: dict[str, Any], key: str) -> str:
    """``arguments[key]``, which must be a string; raises BadArguments saying what is missing or wrong."""
    if key not in arguments:
        raise BadArguments(f"missing argument {key!r} (a string); got {sorted(arguments) or 'no arguments'}")
    value = arguments[key]
    if not isinstance(value, str):
        raise BadArguments(f"argument {key!r} must be a string, got {type(value).__name__}")
    return value


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and a marker saying how many were cut: its first two thirds and last
    third are kept, since the end is where a traceback or an error message is."""
    if len(text) <= limit:
        return text
    head = (2 * limit) // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - tail:] if tail else ''}"


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last message, which the orchestrator guarantees is the assistant turn to act on."""
    content = messages[-1].get("content", "") if messages else ""
    return content if isinstance(content, str) else ""


class ToolEnvironment:
    """Runs the tool calls of the last assistant turn with ``tools`` (see the module docstring)."""

    def __init__(self, settings: EnvSettings, tools: dict[str, Tool]) -> None:
        self.settings, self.tools = settings, tools

    def _offer(self) -> str:
        return f"tools on offer: {', '.join(sorted(self.tools))}"

    def call(self, name: str, arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
        """Run one call; never raises but for ``ToolUnavailable``."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolOutcome(f"error: unknown tool {name!r}; {self._offer()}", "error")
        try:
            return tool(arguments, state)
        except BadArguments as e:
            return ToolOutcome(f"error: {name}: {e}", "error")
        except ToolUnavailable:
            raise
        except Exception as e:  # a bug in the tool, triggered by this call: an observation, the episode goes on
            return ToolOutcome(f"error: {name} failed: {type(e).__name__}: {e}", "error")

    def step(self, messages: list[dict[str, Any]], state: dict[str, Any], metadata: dict[str, Any]) -> StepResult:
        calls = parse_tool_calls(last_assistant_text(messages))
        state = copy.deepcopy(state)
        if not calls:
            return StepResult(done=True, state=state)
        out = StepResult(done=False, state=state, tool_calls=len(calls))
        limit = self.settings.max_calls_per_turn
        for i, call in enumerate(calls):
            if i >= limit:
                outcome = ToolOutcome(f"error: at most {limit} tool calls are run per turn; this one was not", "error")
            elif isinstance(call, CallError):
                outcome = ToolOutcome(f"error: {call.reason}; {self._offer()}", "error")
            else:
                outcome = self.call(call.name, call.arguments, state)
            out.tool_messages.append({"role": "tool", "content": truncate(outcome.content,
                                                                          self.settings.max_output_chars)})
            out.tool_errors += outcome.error_kind != ""
            out.timeouts += outcome.error_kind == "timeout"
        return out

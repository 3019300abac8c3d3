"""The messages of users' agents (docs/ARCHITECTURE.md §14): an agent program drives a trajectory through the run's
OpenAI-compatible gateway, and every model call it makes is sampled, versioned and booked like any turn.

    orchestrator --AgentRequest(row, base_url, api_key)--> environment worker (runs agent.fn / agent.command)
    agent --HTTP /v1/chat/completions--> gateway --GatewayGenerate(prompt ids, segment)--> orchestrator
    orchestrator --PromptRequest(gen)--> sampler --Rollout--> orchestrator --Rollout--> gateway --HTTP reply--> agent
    environment worker --AgentDone(reward | None)--> orchestrator   (None: the domain's verifier scores)

Keys (protocol/messages.py ``WorkKey``): the agent's run of row i is ``{group}/{i}:agent0/{attempt}``; its model
call t is ``{group}/{i}:gen{t}/{attempt}`` (t counts from 0).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import field
from typing import Any

import numpy as np

from .codec import array, message
from .messages import WorkKey


@message("agent_request")
class AgentRequest:
    """orchestrator → environment worker: run the user's agent on row ``key.index`` of a group, against the
    gateway at ``base_url`` with the session's ``api_key`` (it names this trajectory and no other)."""

    key: WorkKey  # kind "agent"
    domain: str
    row: dict[str, Any]  # the row as the agent sees it: id, domain, messages, question, answer, metadata
    base_url: str  # the gateway's OpenAI base URL (http://host:port/v1)
    api_key: str
    deadline_s: float = 600.0  # the whole trajectory (agent.timeout_s)

    def validate(self) -> str:
        if self.key.kind != "agent":
            return f"a {self.key.kind} key runs no agent"
        if not self.api_key or not self.base_url:
            return "an agent request needs the gateway's base_url and the session's api_key"
        return "" if math.isfinite(self.deadline_s) and self.deadline_s > 0 else f"deadline_s {self.deadline_s}"


@message("agent_done")
class AgentDone:
    """environment worker → orchestrator: the agent of ``key`` ended. ``reward`` None: the row's domain verifier
    scores the trajectory's last assistant turn; ``ok`` False: the agent raised, hung past its deadline, exited
    non-zero, or printed no reward: its trajectory ends with ``error`` (the group is filtered with it)."""

    key: WorkKey
    ok: bool = True
    reward: float | None = None
    error: str = ""
    t_agent: float = 0.0
    worker_id: str = ""

    def validate(self) -> str:
        if self.key.kind != "agent":
            return f"a {self.key.kind} key answers no agent"
        if self.reward is not None and not math.isfinite(self.reward):
            return f"reward {self.reward} is not a finite number"
        return ""


@message("gateway_generate")
class GatewayGenerate:
    """gateway → orchestrator: model call ``key.turn`` of the trajectory ``key`` names: sample one turn after
    ``prompt_ids``. ``segment`` is the trajectory's current segment (the ids extend its tokens: the model's earlier
    turns reused as sampled) or the next one (the agent rewrote its history: the ids start afresh)."""

    key: WorkKey  # kind "gen"
    prompt_ids: np.ndarray = array("int32")
    segment: int = 0
    max_tokens: int = 0  # the client's max_tokens (0: the run's sampling.max_tokens); never more than the run's
    stop: list[str] = field(default_factory=list)  # the client's stop strings, with the run's

    def validate(self) -> str:
        if self.key.kind != "gen":
            return f"a {self.key.kind} key asks for no model call"
        if not len(self.prompt_ids):
            return "an empty prompt"
        return "" if self.segment >= 0 and self.max_tokens >= 0 else "negative segment or max_tokens"


@message("gateway_refused")
class GatewayRefused:
    """orchestrator → gateway: model call ``key`` is not served; ``status`` is the HTTP status the agent gets
    (400: a limit of the run, such as orchestrator.max_turns; 404: no such live trajectory; 409: a call while
    another of the same session is in flight) and ``error`` says why."""

    key: WorkKey
    status: int
    error: str


@message("gateway_ended")
class GatewayEnded:
    """orchestrator → gateway: model call ``key`` finds its trajectory at a limit of the run (``orchestrator.max_turns``
    calls, or no tokens left under ``orchestrator.max_total_tokens`` or the context): answered with no tokens and
    ``finish_reason`` "length", as the built-in path ends a trajectory there, so an agent's loop ends and its
    trajectory is scored. A call after this one is refused (400)."""

    key: WorkKey
    reason: str


@message("gateway_reward")
class GatewayReward:
    """gateway → orchestrator: an external agent's ``POST /rl/reward`` for its session's trajectory (used when the
    agent ends without a reward of its own)."""

    key: WorkKey  # the session's agent key (kind "agent")
    reward: float

    def validate(self) -> str:
        return "" if math.isfinite(self.reward) else f"reward {self.reward} is not a finite number"


SESSION_PREFIX = "cr-"


def session_key(secret: bytes, key: WorkKey) -> str:
    """The API key of the trajectory ``key`` (any kind: its group, row and attempt) names: the session's id, signed
    with the run's gateway secret, so the gateway authenticates it without shared state."""
    name = f"{key.group}.{key.index}.{key.attempt}"
    return f"{SESSION_PREFIX}{name}.{hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]}"


def session_of(secret: bytes, api_key: str) -> WorkKey | None:
    """The agent key an API key was made for (``session_key``), or None when it is not one of this run's."""
    if not api_key.startswith(SESSION_PREFIX):
        return None
    name, _, mac = api_key[len(SESSION_PREFIX):].rpartition(".")
    group, _, rest = name.partition(".")
    index, _, attempt = rest.partition(".")
    good = hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]
    if not (group and index.isdigit() and attempt.isdigit() and hmac.compare_digest(mac, good)):
        return None
    return WorkKey(group, "agent", int(index), 0, int(attempt))


def read_secret(path) -> bytes:
    """The run's gateway secret (``gateway.secret_file``: 32 random bytes as hex, written by the supervisor)."""
    with open(path) as f:
        return bytes.fromhex(f.read().strip())

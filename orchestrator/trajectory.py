"""Multi-turn trajectories: one row of a group, turn by turn, from its first model turn to the rollout trained on.

A row whose data names an environment (``Row.env``, or ``environment.defaults`` for its domain) is a
trajectory (docs/ARCHITECTURE.md §12): the sampler samples a model turn, an environment runs the turn's tool
calls, the observation is appended as the token ids the chat template gives the tool turn, and the sampler
continues the whole trajectory, until a turn calls no tool, ``orchestrator.max_turns`` or the token budget.
The finished trajectory is one ``Rollout`` whose ``loss_mask`` is True on the model's tokens only: GRPO,
MOPD's teacher log-probs and the mismatch metrics see those, never the observations. Pure state, no IO.

Keys of the work a trajectory hands out (``WorkKey.step``, protocol/messages.py): kind "env" (the environment
step after model turn t, ``{group}/{i}:env{t}/{attempt}`` as text) and "gen" (the sampler's turn t + 1,
``{group}/{i}:gen{t}/{attempt}``). The component that hands them out is orchestrator/trajectories.py.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

import numpy as np

from cascade_rl.protocol.messages import EnvReply, Rollout, WorkKey


class Phase(StrEnum):
    gen = "gen"  # a sampler holds its next turn (or it waits for one)
    env = "env"  # an environment runs the last turn's tool calls (or it waits for one)
    agent = "agent"  # a user's agent holds it: its next model call, or its end (orchestrator/agents.py)
    done = "done"  # ended: no tool call, max_turns, the token budget, or a truncated turn


@dataclasses.dataclass
class Trajectory:
    """Row i of a multi-turn group after its prompt: model and observation segments, the conversation as text."""

    segments: list[np.ndarray] = dataclasses.field(default_factory=list)  # token ids, model and observation
    model: list[bool] = dataclasses.field(default_factory=list)  # per segment: sampled by the model?
    logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)  # per segment (0 for observations)
    messages: list[dict] = dataclasses.field(default_factory=list)  # assistant and tool turns, as text
    state: dict = dataclasses.field(default_factory=dict)  # the environment's, handed back at its next step
    versions: list[int] = dataclasses.field(default_factory=list)  # policy version of each model turn
    routes: np.ndarray | None = None  # the last turn's rollout's: its prompt is every earlier turn (R3)
    token_versions: list[np.ndarray] = dataclasses.field(default_factory=list)  # per segment (observations: their
    # turn's newest); sent only when some turn carried its own (in-flight updates)
    spans_versions: bool = False
    turn: int = 0  # model turns so far
    phase: Phase = Phase.gen
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    first: Rollout | None = None  # the first turn's rollout (its key, domain, sampler)
    sampler: bytes | None = None  # the sampler of its last turn: its next turn goes there first (prefix reuse)
    # an agent's trajectory (orchestrator/agents.py): no prompt of its own (its first segment's prompt is its first
    # piece); the pieces where later segments start (a rewritten history); the call in flight's own limits
    agent: bool = False
    segment_starts: list[int] = dataclasses.field(default_factory=list)
    call_max_tokens: int = 0
    call_stop: list[str] = dataclasses.field(default_factory=list)
    posted_reward: float | None = None  # POST /rl/reward, for an agent that ends without one
    reward: float | None = None  # the agent's own reward (None: the domain's verifier scores)
    gateway: bytes | None = None  # the gateway that asked for the call in flight (its reply goes there)
    ended: str = ""  # an agent's trajectory at a limit of the run (its calls are answered empty, then refused)
    queued_at: float = 0.0  # when its next turn was queued (the turn's wait: queued to sampled, ``Core.turn_waits``)

    def tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def after_prompts(self) -> int:
        """Tokens after its prompt(s), what ``orchestrator.max_total_tokens`` bounds: an agent's segments' prompts (the
        first piece of each) are context, as a row's prompt is."""
        if not self.agent:
            return self.tokens()
        firsts = {0, *self.segment_starts} if self.segments else set()
        return sum(len(s) for k, s in enumerate(self.segments) if k not in firsts)

    def context(self, prompt_ids: np.ndarray) -> np.ndarray:
        """The ids its next model turn continues: the prompt and every piece, or an agent's current segment."""
        if self.agent:
            start = self.segment_starts[-1] if self.segment_starts else 0
            return np.concatenate(self.segments[start:]).astype(np.int32) if self.segments else np.zeros(0, np.int32)
        return np.concatenate([prompt_ids, self.ids()]).astype(np.int32)

    def open_segment(self, prompt_ids: np.ndarray) -> None:
        """An agent's call whose rendering does not extend its tokens (the agent rewrote its history): a new segment,
        its prompt the whole rendering, its own sequence in training (``Rollout.segment_starts``)."""
        if self.segments:
            self.segment_starts.append(len(self.segments))
        self.add_piece(prompt_ids)

    def add_piece(self, ids: np.ndarray) -> None:
        """Context tokens of an agent's call (what its rendering adds after the tokens so far): no loss."""
        if not len(ids):
            return
        self.segments.append(np.asarray(ids, np.int32))
        self.logprobs.append(np.zeros(len(ids), np.float32))
        self.model.append(False)
        last = self.token_versions[-1] if self.token_versions else np.zeros(0, np.int32)
        self.token_versions.append(np.full(len(ids), int(last.max()) if len(last) else -1, np.int32))  # -1: its oldest

    def observation_tokens(self) -> int:
        """Tokens after its prompt(s) the model did not sample (an agent's segment prompts are its prompts)."""
        firsts = {0, *self.segment_starts} if self.agent and self.segments else set()
        return sum(len(s) for k, (s, m) in enumerate(zip(self.segments, self.model)) if not m and k not in firsts)

    def ids(self) -> np.ndarray:
        return np.concatenate(self.segments).astype(np.int32) if self.segments else np.zeros(0, np.int32)

    def add_turn(self, r: Rollout, text: str) -> None:
        """Model turn ``turn + 1``: its tokens (EOS included), log-probs and text (the assistant message)."""
        self.first = self.first or r
        self.segments.append(np.asarray(r.response_ids, np.int32))
        self.logprobs.append(np.asarray(r.inf_logprobs, np.float32))
        self.model.append(True)
        self.messages.append({"role": "assistant", "content": text})
        self.versions.append(r.policy_version)
        own = r.token_versions is not None
        self.spans_versions |= own
        self.token_versions.append(np.asarray(r.token_versions, np.int32) if own
                                   else np.full(len(r.response_ids), r.policy_version, np.int32))
        self.routes = r.routes  # the last turn's cover its whole prompt (every earlier turn) and its response
        self.finish_reason = r.finish_reason
        self.turn += 1

    def add_observation(self, ids: list[int], reply: EnvReply) -> None:
        """The tool turn(s) answering the last model turn, as the template's token ids."""
        self.segments.append(np.asarray(ids, np.int32))
        self.logprobs.append(np.zeros(len(ids), np.float32))
        self.model.append(False)
        last = self.token_versions[-1] if self.token_versions else np.zeros(0, np.int32)
        self.token_versions.append(np.full(len(ids), int(last.max()) if len(last) else min(self.versions), np.int32))
        self.messages.extend(reply.tool_messages)
        self.state = dict(reply.state)
        self.count(reply)

    def count(self, reply: EnvReply) -> None:
        self.tool_calls += reply.tool_calls
        self.tool_errors += reply.tool_errors
        self.timeouts += reply.timeouts

    def final_text(self) -> str:
        """What the domain's verifier scores: the last assistant turn."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "assistant")

    def rollout(self, prompt_ids: np.ndarray) -> Rollout:
        """The finished trajectory as one rollout: everything after the prompt, the loss on the model's tokens.
        Its policy version is its oldest turn's (staleness counts from there)."""
        r = self.first
        if self.agent:  # an agent's row is its pieces alone; each later segment starts a sequence of its own
            prompt_ids = np.zeros(0, np.int32)
        mask = np.concatenate([np.full(len(s), m, bool) for s, m in zip(self.segments, self.model)])
        ran = len(prompt_ids) + self.tokens() - 1
        routes = self.routes if self.routes is not None and len(self.routes) == ran else None  # else not this text's
        key = WorkKey.step(r.key.group, r.key.index, "gen", self.turn, r.key.attempt)  # turn: its model turns
        offsets = np.cumsum([0] + [len(s) for s in self.segments])
        starts = np.array([offsets[k] for k in self.segment_starts], np.int32) if self.segment_starts else None
        return Rollout(key, r.domain, prompt_ids, self.ids(), np.concatenate(self.logprobs).astype(np.float32),
                       self.finish_reason, min(self.versions), r.sampler_id, r.t_gen, loss_mask=mask, routes=routes,
                       token_versions=self._token_versions() if self.spans_versions else None,
                       segment_starts=starts)

    def _token_versions(self) -> np.ndarray:
        versions = np.concatenate(self.token_versions)
        versions[versions < 0] = min(self.versions)  # an agent's first prompt: as old as its oldest turn
        return versions


def next_phase(t: Trajectory, max_turns: int, budget: int) -> Phase:
    """After a model turn: the environment acts on it, or the trajectory ends. A turn cut at its token limit
    ends it (its tool call, if any, is incomplete); so do the last allowed turn and an exhausted budget."""
    if t.finish_reason != "stop" or t.turn >= max_turns or t.tokens() >= budget:
        return Phase.done
    return Phase.env


def budget(max_total_tokens: int, max_turns: int, max_tokens: int) -> int:
    """Tokens after the prompt a trajectory may have (``orchestrator.max_total_tokens``, 0: one full turn each)."""
    return max_total_tokens or max_turns * max_tokens


@dataclasses.dataclass
class Totals:
    """Counts of trained trajectories, summed: what a step's metrics and ``summary.json`` ``multi_turn`` report
    (kept as sums, not as trajectories, so a long run holds no token arrays for them)."""

    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    tokens: int = 0
    observation_tokens: int = 0
    segments: int = 0

    def add(self, trajectories) -> Totals:
        for t in trajectories:
            self.trajectories += 1
            self.segments += 1 + len(t.segment_starts)
            self.turns += t.turn
            self.tool_calls += t.tool_calls
            self.tool_errors += t.tool_errors
            self.timeouts += t.timeouts
            self.tokens += t.after_prompts()
            self.observation_tokens += t.observation_tokens()
        return self

    def summary(self) -> dict[str, float]:
        if not self.trajectories:
            return {}
        return {
            "turns_mean": self.turns / self.trajectories,
            "tool_calls_mean": self.tool_calls / self.trajectories,
            "tool_errors": self.tool_errors,
            "tool_timeouts": self.timeouts,
            "observation_token_frac": self.observation_tokens / max(1, self.tokens),
            "segments_mean": self.segments / self.trajectories,  # > 1: agents that rewrote their history (§14)
        }


def summary(trajectories) -> dict[str, float]:
    """Per-step multi-turn metrics of these trajectories."""
    return Totals().add(trajectories).summary()


@dataclasses.dataclass
class Mean:
    """A running count and sum (``Core.turn_waits``)."""

    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n, self.total = self.n + 1, self.total + x

    def summary(self) -> dict[str, float]:
        return {"turns": self.n, "mean_s": self.total / self.n} if self.n else {}

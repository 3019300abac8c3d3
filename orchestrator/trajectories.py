"""The multi-turn side of the orchestrator's state machine: a component the ``Core`` (orchestrator/core.py) owns.

    trajectories = Trajectories(rules, template, pool, clock)
    done = trajectories.start(g, ident, rollout)      # a row's first turn: its trajectory begins
    for ident, msg in trajectories.dispatch(groups): ...   # environment steps and next turns, to free workers
    done = trajectories.env_step(g, reply)            # a step's reply in: the next turn queued, or the end
    done = trajectories.next_turn(g, ident, rollout)  # a later model turn in: the next step queued, or the end

A row's model turn in, its environment step out; the step's reply in, its next turn out, until the trajectory
(orchestrator/trajectory.py) ends and comes back as one finished ``Rollout`` (``done``), which the core scores
like a single-turn rollout (docs/ARCHITECTURE.md §12). Its state is the queue of work waiting for a worker; the
trajectories themselves live in their ``Group``. It shares the core's ``WorkerPool`` (credit, deadlines) and
clock; no sockets, no tokenizer: the chat template's side is the ``TurnTemplate`` it is given.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from cascade_rl.protocol.messages import EnvReply, EnvRequest, PromptRequest, Rollout, SamplingParams, WorkKey

from .groups import AGENT, Group
from .pool import WorkerPool
from .rules import Rules
from .trajectory import Phase, Trajectory, budget, next_phase


class TurnTemplate(Protocol):
    """What multi-turn rows need of the tokenizer (data/render.py ``TurnRenderer``)."""

    def assistant_text(self, turn_ids: np.ndarray) -> str:
        """A model turn as the assistant message of the conversation (what the template re-renders)."""

    def observation_ids(self, trajectory_ids: np.ndarray, messages: list[dict]) -> list[int]:
        """The ids after a trajectory whose conversation, tool turns last, is ``messages``; raises ValueError
        when the template does not extend the trajectory."""


class Trajectories:
    """Handlers and dispatch of multi-turn work. Each handler returns the row's finished rollout when its
    trajectory ends (else None); a failure is written to the group's ``error``."""

    def __init__(self, rules: Rules, template: TurnTemplate | None, pool: WorkerPool,
                 clock: Callable[[], float]) -> None:
        self.rules, self.template, self.pool, self.clock = rules, template, pool, clock
        self.queue: deque[WorkKey] = deque()  # environment steps and next turns waiting for a worker

    def start(self, g: Group, ident: bytes, r: Rollout) -> Rollout | None:
        """Row ``r.key.index``'s first turn, sampled by ``ident`` (its next turn goes there first)."""
        g.trajectories[r.key.index] = Trajectory(sampler=ident)
        return self._took_turn(g, r.key.index, r)

    def next_turn(self, g: Group, ident: bytes, r: Rollout) -> Rollout | None:
        """A later turn of a multi-turn row (a ``PromptRequest`` of kind "gen"), sent by any sampler; ``g`` and
        the key ``awaits`` it."""
        if r.finish_reason == "error":
            g.error = f"sampler_error: {r.error or 'unknown sampler error'}"
            return None
        g.trajectories[r.key.index].sampler = ident
        return self._took_turn(g, r.key.index, r)

    def env_step(self, g: Group, reply: EnvReply) -> Rollout | None:
        """An environment's reply to row ``reply.key.index``'s step; ``g`` and the key ``awaits`` it."""
        i = reply.key.index
        t = g.trajectories[i]
        if not reply.ok:
            t.phase = Phase.done
            g.error = f"env_error: {reply.error}"
            return None
        if reply.done:
            t.count(reply)
            t.state = dict(reply.state)  # what the episode left, for its verifier (metadata["env_state"])
            t.phase = Phase.done
            return t.rollout(g.prompt_ids)
        messages = [*g.row.messages, *t.messages, *reply.tool_messages]
        try:
            ids = self.template.observation_ids(np.concatenate([g.prompt_ids, t.ids()]), messages)
        except ValueError as e:
            t.phase = Phase.done
            g.error = f"template_error: {e}"
            return None
        t.add_observation(ids, reply)
        if t.tokens() >= self.budget(g):  # no room for another turn: the trajectory ends on the observation
            t.phase = Phase.done
            return t.rollout(g.prompt_ids)
        t.phase, t.queued_at = Phase.gen, self.clock()
        self.queue.append(g.turn_key(i, "gen", t.turn))
        return None

    def awaits(self, g: Group | None, key: WorkKey, kind: str) -> bool:
        """Whether ``key`` answers the ``kind`` step ("env" or "gen") that its trajectory in ``g`` waits for: not a
        reply to a step sent again, nor to an attempt already re-dispatched, nor to a failed group."""
        t = g.trajectories.get(key.index) if g is not None else None
        return not (t is None or key.kind != kind or key.attempt != g.attempt or t.turn != key.turn
                    or t.phase != kind or g.error)

    def requeue(self, key: WorkKey) -> None:
        """A step or next turn that will not come back (deadline, worker gone): asked again with the same key (it
        carries its trajectory's state: any worker can serve it); skipped at dispatch if no longer awaited."""
        self.queue.append(key)

    def room(self, g: Group, t: Trajectory) -> int:
        """Tokens its next model turn may sample: what the trajectory's budget leaves, and (an agent's) what the
        context leaves after its current segment."""
        room = self.budget(g) - t.after_prompts()
        if t.agent and self.rules.context:
            room = min(room, self.rules.context - len(t.context(g.prompt_ids)))
        return room

    def turn_sampling(self, g: Group, t: Trajectory) -> SamplingParams:
        """The group's sampling for its next turn: at most what is left (and an agent's call: its own max_tokens,
        never over the run's, and its stop strings besides the run's)."""
        cap = min(g.sampling.max_tokens, t.call_max_tokens or g.sampling.max_tokens, self.room(g, t))
        return dataclasses.replace(g.sampling, max_tokens=cap, stop=[*g.sampling.stop, *t.call_stop])

    def budget(self, g: Group) -> int:
        """Tokens after the prompt a trajectory of ``g`` may have: ``orchestrator.max_total_tokens`` (or a full turn
        each), and never past the model's context (``Rules.context``)."""
        limit = budget(self.rules.max_total_tokens, self.rules.max_turns, g.sampling.max_tokens)
        if g.env == AGENT:  # an agent's rows hold their prompts: its segments' contexts are bounded in ``room``
            return limit
        return min(limit, self.rules.context - len(g.prompt_ids)) if self.rules.context else limit

    def dispatch(self, groups: Mapping[str, Group]) -> list[tuple[bytes, EnvRequest | PromptRequest]]:
        """Queued work to free workers, assigned in the pool: environment steps to an environment worker serving
        the row's environment, next turns to any sampler (the whole trajectory as the prompt; the engine reuses its
        cached prefix, so the row's last sampler first). The messages to send, in order."""
        out: list[tuple[bytes, EnvRequest | PromptRequest]] = []
        while self.queue:
            key = self.queue[0]
            i, kind, turn = key.index, key.kind, key.turn
            g = groups.get(key.group)
            t = g.trajectories.get(i) if g is not None and g.attempt == key.attempt and not g.error else None
            if t is None or t.turn != turn or t.phase != kind:
                self.queue.popleft()
                continue
            role, need = ("environment", 1) if kind == "env" else ("sampler", 1)
            picked = self.pool.pick(role, need, g.env if kind == "env" else None,
                                    prefer=t.sampler if kind == "gen" else None)  # its KV prefix lives there
            if picked is None:
                break
            ident, _ = picked
            self.queue.popleft()
            if kind == "env":
                timeout_s = self.rules.env_timeout_s
                msg = EnvRequest(key, g.env, g.row.domain, [*g.row.messages, *t.messages], t.state, g.row.metadata,
                                 timeout_s)
            else:
                timeout_s = self.rules.sampler_timeout_s
                sampling = self.turn_sampling(g, t)
                msg = PromptRequest(key, g.row.domain, t.context(g.prompt_ids), 1, sampling, g.min_version, keep=True)
            self.pool.assign(ident, key, need, self.clock(), timeout_s)
            out.append((ident, msg))
        return out

    def _took_turn(self, g: Group, i: int, r: Rollout) -> Rollout | None:
        """Model turn of row i in: the environment acts on it next, or the trajectory is done."""
        t = g.trajectories[i]
        t.add_turn(r, self.template.assistant_text(r.response_ids))
        t.phase = next_phase(t, self.rules.max_turns, self.budget(g))
        if t.phase == Phase.env:
            self.queue.append(g.turn_key(i, "env", t.turn))
            return None
        return t.rollout(g.prompt_ids)

"""The orchestrator's rules for multi-turn rows, part of the state machine of orchestrator/core.py (``Core``
mixes them in): a row's model turn in, its environment step out; the step's reply in, its next turn out, until
the trajectory ends and is scored like a single-turn rollout (docs/ARCHITECTURE.md §12). No sockets, no tokenizer:
the chat template's side is the ``Turns`` the core is given.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from cascade_rl.protocol.messages import EnvReply, EnvRequest, PromptRequest, Rollout, WorkKey

from . import turns
from .groups import Group
from .turns import Phase, Trajectory


class Turns(Protocol):
    """What the core needs of the tokenizer for multi-turn rows (data/render.py ``TurnRenderer``)."""

    def assistant_text(self, turn_ids: np.ndarray) -> str:
        """A model turn as the assistant message of the conversation (what the template re-renders)."""

    def observation_ids(self, trajectory_ids: np.ndarray, messages: list[dict]) -> list[int]:
        """The ids after a trajectory whose conversation, tool turns last, is ``messages``; raises ValueError
        when the template does not extend the trajectory."""


class TrajectoryRules:
    """Handlers and dispatch of multi-turn work; the state (groups, pool, queues, rules) is the ``Core``'s."""

    def _took_turn(self, g: Group, i: int, r: Rollout) -> None:
        """Model turn of row i in: the environment acts on it next, or the trajectory is done."""
        t = g.trajectories[i]
        t.add_turn(r, self.turns.assistant_text(r.response_ids))
        t.phase = turns.next_phase(t, self.rules.max_turns, self._budget(g))
        if t.phase == Phase.env:
            self.turn_queue.append(g.turn_key(i, "env", t.turn))
        else:
            self._rollout_done(g, t.rollout(g.prompt_ids))

    def _budget(self, g: Group) -> int:
        """Tokens after the prompt a trajectory of ``g`` may have: ``orchestrator.max_total_tokens`` (or a full turn
        each), and never past the model's context (``Rules.context``)."""
        limit = turns.budget(self.rules.max_total_tokens, self.rules.max_turns, g.sampling.max_tokens)
        return min(limit, self.rules.context - len(g.prompt_ids)) if self.rules.context else limit

    def _on_next_turn(self, ident: bytes, r: Rollout) -> None:
        """A later turn of a multi-turn row (``PromptRequest.index``), sent by any sampler."""
        key = WorkKey.step(r.group_id, r.index, "gen", r.turn, r.attempt)  # what its PromptRequest was assigned as
        g, t = self._turn_reply(ident, key, "gen")
        if g is None:
            return
        if r.finish_reason == "error":
            g.error = f"sampler_error: {r.error or 'unknown sampler error'}"
            return
        t.sampler = ident
        self._took_turn(g, r.index, r)

    def _on_env(self, ident: bytes, reply: EnvReply) -> None:
        g, t = self._turn_reply(ident, reply.key, "env")
        if g is None:
            return
        i = reply.key.index
        if not reply.ok:
            t.phase = Phase.done
            g.error = f"env_error: {reply.error}"
            return
        if reply.done:
            t.count(reply)
            t.state = dict(reply.state)  # what the episode left, for its verifier (metadata["env_state"])
            t.phase = Phase.done
            self._rollout_done(g, t.rollout(g.prompt_ids))
            return
        messages = [*g.row.messages, *t.messages, *reply.tool_messages]
        try:
            ids = self.turns.observation_ids(np.concatenate([g.prompt_ids, t.ids()]), messages)
        except ValueError as e:
            t.phase = Phase.done
            g.error = f"template_error: {e}"
            return
        t.add_observation(ids, reply)
        if t.tokens() >= self._budget(g):  # no room for another turn: the trajectory ends on the observation
            t.phase = Phase.done
            self._rollout_done(g, t.rollout(g.prompt_ids))
        else:
            t.phase = Phase.gen
            self.turn_queue.append(g.turn_key(i, "gen", t.turn))

    def _turn_reply(self, ident: bytes, key: WorkKey, kind: str) -> tuple[Group | None, Trajectory | None]:
        """The group and trajectory a multi-turn reply answers, if it is the one they wait for; else counted as
        a duplicate (a reply to a step sent again, or to an attempt already re-dispatched)."""
        self.pool.release(ident, key)
        g = self.groups.get(key.group)
        t = g.trajectories.get(key.index) if g is not None else None
        if t is None or key.kind != kind or key.attempt != g.attempt or t.turn != key.turn or t.phase != kind \
                or g.error:
            rid = key.rollout_id if key.kind in ("env", "gen") else ""  # a score or teacher key names no step
            self._dropped(rid, key.attempt, f"a second reply to {kind} step {key}")
            return None, None
        return g, t

    def _dispatch_turns(self) -> None:
        """Multi-turn work: environment steps to an environment worker serving the row's environment, next turns
        to any sampler (the whole trajectory as the prompt; the engine reuses its cached prefix)."""
        while self.turn_queue:
            key = self.turn_queue[0]
            i, kind, turn = key.index, key.kind, key.turn
            g = self.groups.get(key.group)
            t = g.trajectories.get(i) if g is not None and g.attempt == key.attempt and not g.error else None
            if t is None or t.turn != turn or t.phase != kind:
                self.turn_queue.popleft()
                continue
            role, need = ("environment", 1) if kind == "env" else ("sampler", 1)
            picked = self.pool.pick(role, need, g.env if kind == "env" else None,
                                    prefer=t.sampler if kind == "gen" else None)  # its KV prefix lives there
            if picked is None:
                return
            ident, _ = picked
            self.turn_queue.popleft()
            if kind == "env":
                timeout_s = self.rules.env_timeout_s
                msg = EnvRequest(key, g.env, g.row.domain, [*g.row.messages, *t.messages], t.state, g.row.metadata,
                                 timeout_s)
            else:
                timeout_s = self.rules.sampler_timeout_s
                limit = self._budget(g)
                sampling = dataclasses.replace(g.sampling, max_tokens=min(g.sampling.max_tokens, limit - t.tokens()))
                msg = PromptRequest(g.group_id, g.row.domain, np.concatenate([g.prompt_ids, t.ids()]), 1, sampling,
                                    g.min_version, g.attempt, index=i, turn=turn, keep=True)
            self.pool.assign(ident, key, need, self.clock(), timeout_s)
            self._send(ident, msg)

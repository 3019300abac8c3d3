"""Users' agents: the side of the orchestrator's state machine where an agent program drives a row's trajectory
(docs/ARCHITECTURE.md §14). A component the ``Core`` (orchestrator/core.py) owns, beside ``Trajectories``.

    agents = Agents(rules, trajectories, pool, clock)
    agents.start(g)                                  # each row: an AgentRequest queued for an environment worker
    for ident, msg in agents.dispatch(groups): ...   # the agent runs, to workers serving "agent"
    refused = agents.generate(g, ident, call)        # the gateway asks for model call t: queued as a "gen" turn
    agents.took_turn(g, r)                           # the turn sampled: forwarded to the gateway, the agent's reply
    done = agents.finished(g, msg)                   # AgentDone: the trajectory ends, as one finished Rollout

The agent decides the prompts; every model call still goes through here, so each token is sampled on a version
the group allows, deadline-watched and booked under the row's rollout id. The gateway renders each call and says
whether it continues the trajectory's tokens (the model's earlier turns reused as sampled, only the new part
tokenised: checked here again, token by token) or opens a new segment (the agent rewrote its history): each
segment is its own sequence in training, with the trajectory's reward (``Rollout.segment_starts``). Pure state: no
sockets, no tokenizer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import numpy as np

from cascade_rl.protocol.agents import (
    AgentDone,
    AgentRequest,
    GatewayEnded,
    GatewayGenerate,
    GatewayRefused,
    session_key,
)
from cascade_rl.protocol.messages import Rollout, WorkKey

from .groups import Group
from .pool import WorkerPool
from .rules import Rules
from .trajectories import Trajectories
from .trajectory import Phase, Trajectory

DEADLINE_MARGIN_S = 30.0  # an environment worker answers an agent past its timeout itself; past this, it is gone


def agent_key(g: Group, index: int) -> WorkKey:
    """The key of the agent's run of row ``index`` (its session: the API key signs it)."""
    return WorkKey(g.group_id, "agent", index, 0, g.attempt)


def agent_row(g: Group) -> dict:
    """The row as an agent gets it (``AgentRequest.row``)."""
    row = g.row
    return {"id": row.id, "domain": row.domain, "messages": [dict(m) for m in row.messages],
            "question": row.question, "answer": row.answer, "metadata": dict(row.metadata)}


class Agents:
    """Agent runs waiting for an environment worker, the gateway's calls, and their trajectories' ends."""

    def __init__(self, rules: Rules, trajectories: Trajectories, pool: WorkerPool,
                 clock: Callable[[], float]) -> None:
        self.rules, self.trajectories, self.pool, self.clock = rules, trajectories, pool, clock
        self.queue: deque[WorkKey] = deque()  # agent runs waiting for a worker

    def start(self, g: Group) -> None:
        """Every row of ``g`` becomes an agent's trajectory, its run queued."""
        if not self.rules.gateway_url:
            raise ValueError("agent rows need the run's gateway (gateway.base_url, filled by the supervisor)")
        for i in range(g.n):
            g.trajectories[i] = Trajectory(agent=True, phase=Phase.agent)
            self.queue.append(agent_key(g, i))

    def dispatch(self, groups: Mapping[str, Group]) -> list[tuple[bytes, AgentRequest]]:
        """Queued agent runs to environment workers serving "agent" (each holds one credit until its AgentDone)."""
        out = []
        while self.queue:
            key = self.queue[0]
            g = groups.get(key.group)
            if g is None or g.attempt != key.attempt or g.error:
                self.queue.popleft()
                continue
            picked = self.pool.pick("environment", 1, "agent")
            if picked is None:
                break
            ident, _ = picked
            self.queue.popleft()
            timeout_s = self.rules.agent_timeout_s
            self.pool.assign(ident, key, 1, self.clock(), timeout_s + DEADLINE_MARGIN_S)
            out.append((ident, AgentRequest(key, g.row.domain, agent_row(g), self.rules.gateway_url,
                                            session_key(self.rules.gateway_secret, key), timeout_s)))
        return out

    def generate(self, g: Group | None, gateway: bytes,
                 call: GatewayGenerate) -> GatewayRefused | GatewayEnded | None:
        """Model call ``call.key.turn`` of the row's agent: queued as the trajectory's next turn (None), answered empty
        at a limit of the run, or refused."""
        key = call.key
        t = g.trajectories.get(key.index) if g is not None and g.attempt == key.attempt and not g.error else None
        if t is None or not t.agent or t.phase == Phase.done:
            return GatewayRefused(key, 404, "this session's trajectory has ended (its group finished, failed or was "
                                            "sent again): start no new calls with its key")
        if t.phase == Phase.gen:
            return GatewayRefused(key, 409, "a call of this session is still being answered: one call at a time")
        if key.turn != t.turn:
            return GatewayRefused(key, 409, f"call {key.turn} of a session that has made {t.turn}")
        if t.ended:
            return GatewayRefused(key, 400, f"this trajectory ended at its limit ({t.ended}): its agent gets no more "
                                            "model calls; end the agent")
        if t.turn >= self.rules.max_turns:
            return self.limit(t, key, f"orchestrator.max_turns={self.rules.max_turns} model calls")
        prompt = np.asarray(call.prompt_ids, np.int32)
        current = len(t.segment_starts)
        continuing = call.segment == current and bool(t.segments)
        if continuing:
            so_far = t.context(g.prompt_ids)
            if len(prompt) < len(so_far) or not np.array_equal(prompt[:len(so_far)], so_far):
                return GatewayRefused(key, 400, "the prompt does not extend the session's tokens in its segment "
                                                f"{current} (a gateway error: it must open segment {current + 1})")
            grown = len(prompt) - len(so_far)  # what the rendering adds: the agent's new messages
        elif call.segment == current + (1 if t.segments else 0):
            grown = 0  # a segment's prompt is context, outside the budget (as a row's prompt is)
        else:
            return GatewayRefused(key, 400, f"segment {call.segment} after segment {current}")
        room = min(self.trajectories.budget(g) - t.after_prompts() - grown,
                   self.rules.context - len(prompt) if self.rules.context else 1 << 30)
        if room <= 0:  # the new messages stay in the row as context, as the built-in path keeps the last observation
            used = t.after_prompts() + grown
            if continuing:
                t.add_piece(prompt[len(prompt) - grown:])
            return self.limit(t, key, f"no tokens left: {used} after its prompts "
                                      f"(orchestrator.max_total_tokens, or max_turns x sampling.max_tokens), a prompt "
                                      f"of {len(prompt)} in a context of {self.rules.context}")
        if continuing:
            t.add_piece(prompt[len(prompt) - grown:])
        else:
            t.open_segment(prompt)
        t.call_max_tokens, t.call_stop = call.max_tokens, list(call.stop)
        t.gateway, t.phase, t.queued_at = gateway, Phase.gen, self.clock()
        self.trajectories.queue.append(key)
        return None

    @staticmethod
    def limit(t: Trajectory, key: WorkKey, reason: str) -> GatewayEnded:
        """The trajectory is at a limit: this call is answered with no tokens (its messages are not added), the next
        is refused; the agent's end scores the trajectory as it stands, as the built-in path does there."""
        t.ended = reason
        return GatewayEnded(key, reason)

    def took_turn(self, g: Group, r: Rollout) -> tuple[bytes, Rollout] | None:
        """Model call ``r.key.turn`` sampled: the trajectory holds it, and it goes back to the gateway (the agent's
        reply). A sampler's error fails the group (the gateway answers the agent with it)."""
        t = g.trajectories[r.key.index]
        if r.finish_reason == "error":
            g.error = f"sampler_error: {r.error or 'unknown sampler error'}"
            t.phase = Phase.done
            return (t.gateway, r) if t.gateway else None
        t.add_turn(r, self.trajectories.template.assistant_text(r.response_ids))
        t.tool_calls += t.messages[-1]["content"].count("<tool_call>")
        t.phase = Phase.agent
        return t.gateway, r

    def finished(self, g: Group, msg: AgentDone) -> Rollout | None:
        """The agent of row ``msg.key.index`` ended: its trajectory as one rollout (its reward, if it gave one, set as
        its score), or the group failed with the agent's reason."""
        t = g.trajectories[msg.key.index]
        t.phase = Phase.done
        if not msg.ok:
            g.error = msg.error if msg.error.startswith("agent_") else f"agent_error: {msg.error}"
            return None
        if not t.turn:
            g.error = "agent_error: the agent ended without a model call through its client"
            return None
        t.reward = msg.reward if msg.reward is not None else t.posted_reward
        return t.rollout(g.prompt_ids)

    def lost(self, g: Group, key: WorkKey) -> None:
        """An agent run whose worker went away or never answered: its trajectory cannot be resumed."""
        t = g.trajectories.get(key.index)
        if t is not None and t.phase != Phase.done and not g.error:
            t.phase = Phase.done
            g.error = (f"agent_lost: the environment worker running {key} did not answer within agent.timeout_s "
                       f"+ {DEADLINE_MARGIN_S:.0f} s, or went away")


"""The orchestrator's rules as a state machine: messages and a clock in, messages out; no sockets, no tokenizer.

    core = Core(Rules.from_config(cfg), decode=lambda ids: text, ledger=Ledger(path), clock=time.monotonic)
    core.receive(b"sampler-0", Ready("sampler-0", "sampler", slots=64))
    g = core.add_group(row, prompt_ids, n=4, sampling=SamplingParams(), train=True, step=0)
    core.dispatch()                      # queued work -> workers with free credit
    for ident, msg in core.take_outbox(): ...   # what the IO thread sends
    core.expire()                        # deadlines passed: re-dispatch, re-request
    core.to_trainer([batch], core.settle(groups))  # complete groups' fates; a TrainBatch a trainer rank, by the outbox

Flow (docs/ARCHITECTURE.md §3, §6): a group waits in the prompt queue until a sampler has credit for its n
sequences (and ``max_inflight_groups`` allows), each rollout that comes back is queued for a verifier of its
domain (a group domain, GenRM, once the whole group is in), and under MOPD each complete group for a teacher of
its domain. Every item a worker holds has a deadline; an item past it, or held by a worker that restarted or
became unreachable, is sent again (a group with its attempt incremented, so the old attempt's late replies are
recognised as duplicates). ``settle`` decides the fate of complete groups and writes it to the ledger.

A multi-turn group (its rows name an environment) keeps each row as a trajectory (orchestrator/trajectory.py),
run by the core's ``Trajectories`` (orchestrator/trajectories.py): after each model turn an environment worker
runs the turn's tool calls, the observation's token ids are appended (``TurnTemplate.observation_ids``: the chat
template's, never re-tokenised model text) and a sampler continues the row (a ``PromptRequest`` keyed "gen"),
until the trajectory ends; then the core scores it like a single-turn rollout. An environment step or a later
turn past its deadline, or held by a worker that is gone, is sent again with the same attempt: it carries its
trajectory's state, so any worker can serve it (docs/ARCHITECTURE.md §12).

Everything the core sends goes through its outbox (``take_outbox``), the trainer's batches too (``to_trainer``);
the main loop changes its state only through its methods (``receive``, ``add_group``, ``settle``, ``cancel``,
``forget``, ``take_step``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

from cascade_rl.data.rows import Row
from cascade_rl.protocol.agents import AgentDone, GatewayGenerate, GatewayReward
from cascade_rl.protocol.messages import (
    EnvReply,
    GroupScoreRequest,
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    StepDone,
    TeacherLogprobs,
    TeacherRequest,
    TrainBatch,
    WeightsReady,
    WorkKey,
)
from cascade_rl.protocol.sockets import UNREACHABLE
from cascade_rl.verifiers.registry import is_group_domain

from .agents import Agents
from .groups import AGENT, UNAVAILABLE, Group, filter_reason, masked, staleness
from .ledger import Ledger
from .pool import Worker, WorkerPool
from .rules import Rules
from .trajectories import Trajectories, TurnTemplate
from .trajectory import Mean

log = logging.getLogger("orchestrator")


class Core:
    def __init__(self, rules: Rules, decode: Callable[[np.ndarray], str], ledger: Ledger,
                 clock: Callable[[], float] = time.monotonic, template: TurnTemplate | None = None,
                 version: int = 0) -> None:
        """``decode``: response token ids -> the text a verifier scores (the whole assistant turn); ``template``:
        the chat template's side of multi-turn rows; ``version``: the newest trained version (a resumed run's
        checkpoint step)."""
        self.rules, self.decode, self.ledger, self.clock = rules, decode, ledger, clock
        self.pool = WorkerPool()
        self.trajectories = Trajectories(rules, template, self.pool, clock)  # multi-turn rows' steps and turns
        self.agents = Agents(rules, self.trajectories, self.pool, clock)  # agents' runs and their model calls
        self.groups: dict[str, Group] = {}
        self.prompt_queue: deque[str] = deque()  # group ids waiting for a sampler
        self.score_queue: deque[tuple[str, int]] = deque()  # (group id, rollout index; -1: the whole group)
        self.teacher_queue: deque[str] = deque()  # MOPD: group ids waiting for a teacher
        self.outbox: list[tuple[bytes, object]] = []
        self.version = version  # the newest trained version (StepDone)
        self.weights: WeightsReady | None = None  # the newest notice, for samplers that join late
        self.steps_done: dict[int, StepDone] = {}  # until the main loop takes them (``take_step``)
        self.last_step: StepDone | None = None
        self.malformed = 0
        self.stray_replies = 0  # replies naming no training rollout: late evaluation replies, unknown keys
        self.turn_waits = {"builtin": Mean(), "agent": Mean()}  # multi-turn turns after the first: queued to sampled
        self._seq: Counter = Counter(ledger.group_seq)  # groups made per step ("e": evaluation); a restart's go on
        self._handlers = {Ready: self._on_ready, Rollout: self._on_rollout, Score: self._on_score,
                          TeacherLogprobs: self._on_teacher, WeightsReady: self._on_weights, StepDone: self._on_step,
                          EnvReply: self._on_env, GatewayGenerate: self._on_call, AgentDone: self._on_agent_done,
                          GatewayReward: self._on_posted_reward}

    # ------------------------------------------------------------------ input

    def receive(self, ident: bytes, msg) -> None:
        """One inbound message (or ``UNREACHABLE``: a send to ``ident`` failed, the peer is gone)."""
        if isinstance(msg, str) and msg == UNREACHABLE:
            self.unreachable(ident)
        else:
            self._handlers[type(msg)](ident, msg)

    def unreachable(self, ident: bytes) -> None:
        w = self.pool.leave(ident)
        if w is not None:
            self._requeue_worker(ident, w, "worker unreachable")

    def add_group(self, row: Row, prompt_ids: np.ndarray, n: int, sampling: SamplingParams, train: bool,
                  step: int = -1, env: str = "") -> Group:
        """A new group, queued for a sampler (training groups enter the ledger now: their ids are dispatched);
        ``env``: its rows are multi-turn trajectories in that environment."""
        if env and self.trajectories.template is None:
            raise ValueError("a multi-turn group needs the core's TurnTemplate (the chat template)")
        scope = f"s{step}" if train else "e"
        self._seq[scope] += 1
        g = Group(f"{scope}g{self._seq[scope]}" if train else f"e{self._seq[scope]}", row, prompt_ids, n, sampling,
                  self.version, train, step, needs_teacher=train and self.rules.mopd, env=env)
        self.groups[g.group_id] = g
        if env == AGENT:  # its agents make the prompts: no first turn of the group's own
            self.agents.start(g)
        else:
            self.prompt_queue.append(g.group_id)
        if train:
            self.ledger.dispatch(g)
        return g

    def forget(self, groups: list[Group]) -> None:
        """Complete evaluation groups out of the core (they have no fate in the books); their late replies are
        strays."""
        for g in groups:
            del self.groups[g.group_id]

    def take_step(self, step: int) -> StepDone:
        """The trainer's ``StepDone`` of ``step``, once it is in ``steps_done``: taken out."""
        return self.steps_done.pop(step)

    # ------------------------------------------------------------------ output

    def take_outbox(self) -> list[tuple[bytes, object]]:
        out, self.outbox = self.outbox, []
        return out

    def dispatch(self) -> None:
        self._dispatch_prompts()
        for ident, msg in [*self.agents.dispatch(self.groups), *self.trajectories.dispatch(self.groups)]:
            if isinstance(msg, PromptRequest):  # a turn of a multi-turn row or an agent's call
                self._weights_first(ident, msg.min_version)
            self._send(ident, msg)
        self._dispatch_scores()
        self._dispatch_teachers()

    def expire(self) -> None:
        """Items past their deadline go out again: a group to another sampler, a score or teacher request again."""
        for ident, key in self.pool.expired(self.clock()):
            g = self.groups.get(key) if isinstance(key, str) else None  # a sampler holds a group by its id
            if g is not None:
                log.warning("group %s: sampler %s missed its deadline; re-dispatching", key, ident.decode())
                self._redispatch(g)
            else:
                log.warning("%s missed its deadline at %s; re-requesting", key, ident.decode())
                self._requeue_item(key)

    # ------------------------------------------------------------------ the fate of groups

    def settle(self, batch: list[Group]) -> list[Group]:
        """Complete groups out of flight: the ones to train on (their loss masking decided); the others filtered
        (with the reason) or stale, in the ledger."""
        kept = []
        r = self.rules
        for g in batch:
            del self.groups[g.group_id]
            reason = filter_reason(g, r.dynamic_filtering, r.overlong_penalty)
            if reason:
                self.ledger.settle(g, "filtered", reason)
            elif (behind := staleness(g, g.step)) > r.max_staleness:
                self.ledger.settle(g, "stale", f"{behind} versions behind step {g.step}")
            else:
                g.masked = masked(g, r.mask_threshold, r.overlong_penalty)
                kept.append(g)
        return kept

    def cancel(self, groups: list[Group], reason: str) -> None:
        """Training groups no longer wanted (over-dispatch's surplus): filtered with ``reason``, their work freed."""
        for g in groups:
            del self.groups[g.group_id]
            self.pool.release_group(g.group_id)
            self.ledger.settle(g, "filtered", reason)

    def to_trainer(self, batches: list[TrainBatch], groups: list[Group]) -> None:
        """``batches[r]`` to trainer rank r (each its own share of ``groups``), through the outbox."""
        for rank, batch in enumerate(batches):
            self._send(self.pool.trainer(rank), batch)
        self.trained(groups)

    def trained(self, batch: list[Group]) -> None:  # ``batch`` went to the trainer
        for g in batch:
            self.ledger.settle(g, "trained", "masked" if g.masked else "")

    def books(self) -> dict:
        live = {rid for g in self.groups.values() if g.train for rid in g.ids()}
        return {**self.ledger.books(live), "stray_replies": self.stray_replies}

    # ------------------------------------------------------------------ handlers

    def _on_ready(self, ident: bytes, msg: Ready) -> None:
        old = self.pool.get(ident)
        if msg.draining:  # retiring: what it holds still comes back, so nothing is requeued
            if old is not None:
                old.draining = True
            log.info("%s is draining (%d items in hand)", ident.decode(), len(old.held) if old else 0)
            return
        replaced = self.pool.join(ident, Worker(msg.role, msg.slots, msg.version, tuple(msg.domains), rank=msg.rank))
        if replaced is not None:  # a restarted worker: whatever it held is gone with its predecessor
            self._requeue_worker(ident, replaced, "worker restarted")
        log.info("%s joined as %s (%d slots, version %d)", ident.decode(), msg.role, msg.slots, msg.version)

    def _on_rollout(self, ident: bytes, r: Rollout) -> None:
        key = r.key
        if key.kind == "gen":  # a later turn of a multi-turn row, from any sampler
            g = self._turn_reply(ident, key, "gen")
            if g is not None:  # queued to sampled: what a turn waits, an agent's call or a built-in turn
                t = g.trajectories[key.index]
                self.turn_waits["agent" if t.agent else "builtin"].add(self.clock() - t.queued_at)
            if g is not None and g.env == AGENT:  # an agent's call: its reply goes back through the gateway
                g.trajectories[key.index].sampler = ident
                if (back := self.agents.took_turn(g, r)) is not None:
                    self._send(*back)
            elif g is not None:
                self._finished(g, self.trajectories.next_turn(g, ident, r))
            return
        g = self.groups.get(key.group)
        if g is None or key.attempt != g.attempt or g.worker != ident:
            rid = "" if r.finish_reason == "error" else key.rollout_id  # an error answers the request, no row
            self._dropped(rid, key.attempt, "a rollout of an attempt already re-dispatched")
            return
        w = self.pool.get(ident)
        if w is not None:
            w.version = max(w.version, r.policy_version)
        if r.finish_reason == "error":
            g.error = f"sampler_error: {r.error or 'unknown sampler error'}"
            self.pool.release(g.worker, g.group_id)
            return
        if not 0 <= key.index < g.n or key.index in g.rollouts or key.index in g.trajectories:
            self.malformed += 1
            return
        if g.env:  # the first turn of a multi-turn row
            done = self.trajectories.start(g, ident, r)
            if len(g.trajectories) == g.n:
                self.pool.release(g.worker, g.group_id)
            self._finished(g, done)
            return
        self._rollout_done(g, r)

    def _on_env(self, ident: bytes, reply: EnvReply) -> None:
        g = self._turn_reply(ident, reply.key, "env")
        if g is not None:
            self._finished(g, self.trajectories.env_step(g, reply))

    def _on_call(self, ident: bytes, call: GatewayGenerate) -> None:
        """The gateway asks for an agent's model call: queued as its trajectory's next turn, answered empty at a limit,
        or refused."""
        answer = self.agents.generate(self.groups.get(call.key.group), ident, call)
        if answer is not None:  # refused, or answered empty at the trajectory's limit
            log.info("gateway call %s: %s", call.key, answer)
            self._send(ident, answer)

    def _on_agent_done(self, ident: bytes, msg: AgentDone) -> None:
        """An agent ended: its trajectory scored by its own reward, or by the domain's verifier (reward None)."""
        self.pool.release(ident, msg.key)
        g = self.groups.get(msg.key.group)
        t = g.trajectories.get(msg.key.index) if g is not None and g.attempt == msg.key.attempt else None
        if t is None or t.phase == "done" or g.error:
            self._dropped(msg.key.rollout_id if t is not None else "", msg.key.attempt, f"the end of agent {msg.key} "
                          "after its trajectory ended")
            return
        r = self.agents.finished(g, msg)
        if r is not None:
            if t.reward is not None:  # its own reward: no verifier
                g.scores[r.key.index] = Score(g.score_key(r.key.index), t.reward, True, "the agent's reward",
                                              worker_id=msg.worker_id)
            self._rollout_done(g, r)

    def _on_posted_reward(self, ident: bytes, msg: GatewayReward) -> None:
        g = self.groups.get(msg.key.group)
        t = g.trajectories.get(msg.key.index) if g is not None and g.attempt == msg.key.attempt else None
        if t is not None and t.agent:
            t.posted_reward = msg.reward

    def _finished(self, g: Group, r: Rollout | None) -> None:
        """A multi-turn row's handler is done: ``r`` is its finished trajectory, if it ended."""
        if r is not None:
            self._rollout_done(g, r)

    def _rollout_done(self, g: Group, r: Rollout) -> None:
        g.rollouts[r.key.index] = r
        if len(g.rollouts) == g.n:
            if not g.env:
                self.pool.release(g.worker, g.group_id)
            if g.needs_teacher:
                self.teacher_queue.append(g.group_id)
        self._queue_score(g, r.key.index)

    def _on_score(self, ident: bytes, s: Score) -> None:
        key = s.key
        g = self._reply(ident, key, "score")
        if g is None:
            return
        if not 0 <= key.index < g.n or key.index in g.scores:
            self._dropped(key.rollout_id, key.attempt, "a second score of this rollout")
            return
        g.scores[key.index] = s
        if s.unavailable and not g.error:  # a judge down, no sandbox: not a reward of 0 (verifiers/errors.py)
            g.error = f"{UNAVAILABLE}: {s.reason}"

    def _on_teacher(self, ident: bytes, t: TeacherLogprobs) -> None:
        g = self._reply(ident, t.key, "teacher")
        if g is None:
            return
        if g.teacher is not None or len(g.rollouts) < g.n:
            self._dropped(t.key.rollout_id, t.key.attempt, "a second teacher reply for this group")
            return
        lens = [len(g.rollouts[i].response_ids) for i in range(g.n)]
        if not t.ok or len(t.logprobs) != sum(lens):
            g.error = f"teacher_error: {t.error or f'{len(t.logprobs)} log-probs for {sum(lens)} tokens'}"
            return
        g.teacher = np.split(np.asarray(t.logprobs, np.float32), np.cumsum(lens)[:-1])

    def _on_weights(self, ident: bytes, msg: WeightsReady) -> None:
        self.weights = msg

    def _on_step(self, ident: bytes, msg: StepDone) -> None:
        self.version = max(self.version, msg.version)
        self.last_step = msg  # the newest (its checkpoint ends the summary)
        self.steps_done[msg.step] = msg  # until the main loop logs it (several in flight with max_staleness > 1)

    def _reply(self, ident: bytes, key: WorkKey, kind: str) -> Group | None:
        """A reply to the score or teacher request ``key``: frees the worker's credit. Its group if it answers the
        group's current attempt, else None, counted as dropped (a key of another ``kind`` than the reply's names
        no rollout: a stray reply)."""
        self.pool.release(ident, key)
        g = self.groups.get(key.group)
        if g is None or key.attempt != g.attempt or key.kind != kind:
            rid = key.rollout_id if key.kind == kind else ""
            self._dropped(rid, key.attempt, "a reply to an attempt already re-dispatched")
            return None
        return g

    def _turn_reply(self, ident: bytes, key: WorkKey, kind: str) -> Group | None:
        """A multi-turn reply (``kind`` "env" or "gen"): frees the worker's credit. Its group if the trajectory waits
        for it, else None, counted as a duplicate (a reply to a step sent again, or to an attempt already
        re-dispatched)."""
        self.pool.release(ident, key)
        g = self.groups.get(key.group)
        if not self.trajectories.awaits(g, key, kind):
            rid = key.rollout_id if key.kind in ("env", "gen") else ""  # a score or teacher key names no step
            self._dropped(rid, key.attempt, f"a second reply to {kind} step {key}")
            return None
        return g

    def _dropped(self, rollout_id: str, attempt: int, reason: str) -> None:
        if not self.ledger.duplicate(rollout_id, attempt, reason):
            self.stray_replies += 1

    # ------------------------------------------------------------------ dispatch

    def _send(self, ident: bytes, msg) -> None:
        self.outbox.append((ident, msg))

    def _weights_first(self, ident: bytes, min_version: int) -> None:
        """A sampler behind ``min_version`` gets the newest notice before the request that needs it: it joined late,
        or its SUB missed the trainer's notice (a PUB drops what a subscriber not yet connected would read)."""
        w = self.pool.get(ident)
        if w is not None and w.version < min_version and self.weights is not None and self.weights.version >= min_version:
            self._send(ident, self.weights)
            w.version = self.weights.version

    def _dispatch_prompts(self) -> None:
        inflight = self.pool.items("sampler")
        while self.prompt_queue and inflight < self.rules.max_inflight_groups:
            g = self.groups.get(self.prompt_queue[0])
            if g is None or g.worker is not None:
                self.prompt_queue.popleft()
                continue
            picked = self.pool.pick("sampler", g.n)
            if picked is None:
                return
            ident, w = picked
            self.prompt_queue.popleft()
            self._weights_first(ident, g.min_version)
            g.worker = ident
            self.pool.assign(ident, g.group_id, g.n, self.clock(), self.rules.sampler_timeout_s)
            sampling = g.sampling
            if self.rules.context and len(g.prompt_ids) + sampling.max_tokens > self.rules.context:
                room = max(1, self.rules.context - len(g.prompt_ids))  # a long prompt: the answer fits the context
                sampling = dataclasses.replace(sampling, max_tokens=room)
            self._send(ident, PromptRequest(g.sample_key(), g.row.domain, g.prompt_ids, g.n, sampling, g.min_version,
                                            keep=bool(g.env)))
            inflight += 1

    def _queue_score(self, g: Group, index: int) -> None:
        """Rollout ``index`` to be scored; for a group domain (GenRM) the whole group once, when every rollout is
        in (index -1: every rollout still without a score). An evaluation group of a group domain is scored one
        response at a time by the domain's held-out verifier (``EVAL_VERIFIERS``: GenRM against the row's
        baseline answer), since group-relative rewards average the same in every group."""
        if not is_group_domain(g.row.domain) or not g.train:
            self.score_queue.append((g.group_id, index))
        elif len(g.rollouts) == g.n and (g.group_id, -1) not in self.score_queue:
            self.score_queue.append((g.group_id, -1))

    def _dispatch_scores(self) -> None:
        while self.score_queue:
            group_id, index = self.score_queue[0]
            g = self.groups.get(group_id)
            indices = [i for i in range(g.n) if i not in g.scores] if g is not None and index == -1 else [index]
            if g is None or not indices or any(i not in g.rollouts or i in g.scores for i in indices):
                self.score_queue.popleft()
                continue
            picked = self.pool.pick("verifier", len(indices), g.row.domain)
            if picked is None:
                return
            ident, _ = picked
            self.score_queue.popleft()
            keys = [g.score_key(i) for i in indices]
            texts = [g.trajectories[i].final_text() if g.env else self.decode(g.rollouts[i].response_ids)
                     for i in indices]
            timeout_s = self.rules.verifier_timeout_s
            if index == -1:
                req = GroupScoreRequest(keys, g.row.domain, g.row.question, texts, g.row.answer, g.row.metadata,
                                        timeout_s)
            else:
                # a multi-turn row's verifier also gets what its environment left (an agent's edited files)
                extra = {"env_state": g.trajectories[index].state} if g.env else {}
                req = ScoreRequest(keys[0], g.row.domain, texts[0], g.row.answer,
                                   {"question": g.row.question, **g.row.metadata, **extra}, timeout_s)
            for key in keys:
                self.pool.assign(ident, key, 1, self.clock(), timeout_s)
            self._send(ident, req)

    def _dispatch_teachers(self) -> None:
        """MOPD: each complete group's rollouts to a teacher of its domain (one request per group)."""
        while self.teacher_queue:
            g = self.groups.get(self.teacher_queue[0])
            if g is None or g.teacher is not None or g.error or len(g.rollouts) < g.n:
                self.teacher_queue.popleft()
                continue
            picked = self.pool.pick("teacher", g.n, g.row.domain)
            if picked is None:
                return
            ident, _ = picked
            self.teacher_queue.popleft()
            responses = [g.rollouts[i].response_ids for i in range(g.n)]
            timeout_s = self.rules.teacher_timeout_s
            self.pool.assign(ident, g.teacher_key(), g.n, self.clock(), timeout_s)
            self._send(ident, TeacherRequest(g.teacher_key(), g.row.domain, g.prompt_ids,
                                             np.concatenate(responses).astype(np.int32),
                                             np.array([len(r) for r in responses], np.int32), g.sampling.temperature,
                                             timeout_s))

    # ------------------------------------------------------------------ sending work again

    def _requeue_item(self, key: WorkKey) -> None:
        """A score, teacher or multi-turn request that will not come back (deadline, worker gone): ask again."""
        g = self.groups.get(key.group)
        if g is None or key.attempt != g.attempt:
            return  # its group is done, or was re-dispatched (the new attempt asks for itself)
        if key.kind == "teacher":
            self.teacher_queue.append(g.group_id)
        elif key.kind == "agent":  # an agent cannot be resumed midway: its trajectory fails
            self.agents.lost(g, key)
        elif key.kind in ("env", "gen"):
            self.trajectories.requeue(key)  # its trajectory still waits for it (else the dispatch skips it)
        else:
            self._queue_score(g, key.index)

    def _redispatch(self, g: Group) -> None:
        self.pool.release(g.worker, g.group_id)
        g.attempt += 1
        g.worker, g.rollouts, g.scores, g.teacher, g.error, g.trajectories = None, {}, {}, None, "", {}
        if g.train:
            self.ledger.redispatch(g)
        self.prompt_queue.appendleft(g.group_id)

    def _requeue_worker(self, ident: bytes, w: Worker, why: str) -> None:
        for key in list(w.held):
            g = self.groups.get(key) if isinstance(key, str) else None  # a sampler holds a group by its id
            if g is not None:
                if g.worker == ident and g.first_turns() < g.n and not g.error:
                    log.warning("group %s: %s (%s); re-dispatching", key, why, ident.decode())
                    self._redispatch(g)
            else:
                self._requeue_item(key)
        w.held.clear()

"""Orchestrator: the hub of the data plane.

    python -m cascade_rl.learner.orchestrator --config RUN_DIR/config.yaml

It binds the one ROUTER every sampler, verifier and the trainer connect to,
opens the prompt sets the supervisor prepared in ``run_dir/data`` (data/:
memory-mapped, drawn in the seeded order whose count is the checkpoint's data
cursor), and runs the stage top to bottom (``run``): evaluate the starting policy,
then for each step sample a batch of groups on the newest weights, score
them, hand the complete groups to the trainer as a ``TrainBatch`` and wait for
``StepDone``; evaluate again at the end and write ``summary.json``.

Between those lines ``pump`` serves the sockets: it dispatches queued groups
to samplers with free capacity (credit-based: a sampler's ``slots`` count
sequences, a verifier's count score requests, and never more than
``max_inflight_groups`` groups are out), routes each rollout to a
verifier of its domain, and re-dispatches any group or score whose deadline
passed or whose worker vanished. Every rollout ends in exactly one of the
books' columns: trained, filtered (with a reason) or stale.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq
from transformers import AutoTokenizer

from cascade_rl.data.promptset import PromptSet, PromptStream
from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import Row
from cascade_rl.protocol import auth
from cascade_rl.protocol.codec import ProtocolError
from cascade_rl.protocol.messages import (
    GroupScoreRequest,
    Heartbeat,
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
)
from cascade_rl.protocol.sockets import bind_router, recv_routed, send
from cascade_rl.protocol.worker_main import worker_start
from cascade_rl.verifiers.registry import is_group_domain

from . import checkpoint

log = logging.getLogger("orchestrator")
INBOUND = (Ready, Rollout, Score, TeacherLogprobs, StepDone, WeightsReady)


@dataclasses.dataclass
class Group:
    """One prompt and its n rollouts, from dispatch to training (or filtering)."""

    group_id: str
    row: Row
    prompt_ids: np.ndarray
    n: int
    sampling: SamplingParams
    min_version: int
    train: bool  # False: an evaluation group (outside the books)
    attempt: int = 0
    worker: bytes | None = None
    deadline: float = 0.0
    rollouts: dict[int, Rollout] = dataclasses.field(default_factory=dict)
    scores: dict[int, Score] = dataclasses.field(default_factory=dict)
    error: str = ""
    masked: bool = False  # trained with its loss masked (no rollout scored above orchestrator.mask_threshold)
    needs_teacher: bool = False  # MOPD: a training group needs its teacher's log-probs
    teacher: list[np.ndarray] | None = None  # per rollout, the teacher's log-prob of each response token

    @property
    def complete(self) -> bool:
        return bool(self.error) or (len(self.scores) == self.n and (not self.needs_teacher or self.teacher is not None))


@dataclasses.dataclass
class Worker:
    role: str
    slots: int  # capacity: sequences for a sampler or a teacher, score requests for a verifier
    version: int = 0
    domains: tuple[str, ...] = ()
    assigned: dict = dataclasses.field(default_factory=dict)  # group id or score key -> slots it takes
    draining: bool = False  # retiring (a swap): finishes what it holds, gets nothing new

    @property
    def load(self) -> int:
        return sum(self.assigned.values())

    def fits(self, need: int) -> bool:
        """Room for ``need`` more; an idle worker takes any item (a group larger than its slots)."""
        return not self.draining and (self.load + need <= self.slots or not self.assigned)


@dataclasses.dataclass
class Books:
    """Rollout accounting. ``dispatched`` counts each requested rollout once, however often it is
    re-dispatched (``redispatched`` counts those re-sends); late duplicates are dropped."""

    dispatched: int = 0
    trained: int = 0
    filtered: int = 0
    stale: int = 0
    redispatched: int = 0
    duplicates_dropped: int = 0
    filtered_reasons: Counter = dataclasses.field(default_factory=Counter)

    def summary(self, in_flight: int) -> dict:
        lost = self.dispatched - self.trained - self.filtered - self.stale - in_flight
        return {
            "dispatched": self.dispatched,
            "trained": self.trained,
            "filtered": self.filtered,
            "stale": self.stale,
            "redispatched": self.redispatched,
            "duplicates_dropped": self.duplicates_dropped,
            "in_flight": in_flight,
            "lost": lost,
            "filtered_reasons": dict(self.filtered_reasons),
        }



class Orchestrator:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.render = PromptRenderer(self.tokenizer, cfg.data.thinking)
        data_dir = self.run_dir / "data"  # prepared by the supervisor (supervisor/run_data.py)
        self.prompts = PromptStream(data_dir, cfg.data.seed)  # its draw count is the data cursor
        self.heldout = PromptSet(data_dir / "eval.arrow").rows()
        self.data_report = json.loads((data_dir / "data.json").read_text())
        self.mopd = cfg.trainer.algorithm == "mopd"
        self.ctx = zmq.Context.instance()
        self.router = bind_router(self.ctx, cfg.endpoints.orchestrator)
        self.beat = None
        if cfg.endpoints.get("heartbeat"):
            self.beat = self.ctx.socket(zmq.PUSH)
            self.beat.setsockopt(zmq.LINGER, 0)
            self.beat.setsockopt(zmq.SNDHWM, 10)
            auth.connect(self.beat, cfg.endpoints.heartbeat)  # CURVE client on tcp (protocol/auth.py)
        self.workers: dict[bytes, Worker] = {}
        self.groups: dict[str, Group] = {}
        self.prompt_queue: deque[str] = deque()
        self.score_queue: deque[tuple[str, int]] = deque()  # (group id, rollout index)
        self.score_deadlines: dict[str, float] = {}
        self.teacher_queue: deque[str] = deque()  # MOPD: group ids whose rollouts await teacher log-probs
        self.teacher_deadlines: dict[str, float] = {}
        self.version = 0
        self.weights: WeightsReady | None = None
        self.step_done: StepDone | None = None
        self.steps_done: dict[int, StepDone] = {}
        self.books = Books()
        self.malformed = 0
        self.next_beat = 0.0
        self.status = {"state": "starting", "step": 0, "steps": cfg.trainer.steps}
        self.per_question: dict[str, np.ndarray] = {}  # latest evaluation, accuracy per held-out question
        self._seq = 0
        self._prompt_ids: dict[str, np.ndarray] = {}
        self.mismatch: list[dict[str, float]] = []  # per step: engine vs trainer log-probs
        self.trainer_window = [0.0, 0.0]  # first batch sent, last StepDone: the trainer's share of the run
        self.trainer_busy_s = 0.0
        self.start_step = self._resume()
        self.tb = None
        if cfg.orchestrator.tensorboard:  # optional extra: fails here, at start, if it is not installed
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    # ------------------------------------------------------------------ the stage, top to bottom

    def run(self) -> dict:
        t_start = time.perf_counter()
        steps = self.cfg.trainer.steps
        self.status["state"] = "waiting for workers"
        self.pump(lambda: self._have("trainer") and self._have("sampler") and self._have("verifier")
                  and (not self.mopd or self._have("teacher")))
        if self.start_step:  # resumed: the trainer publishes the checkpoint's weights before anything samples
            self.pump(lambda: self.weights is not None and self.weights.version >= self.start_step)
        self.status["state"] = "eval"
        before = self.evaluate()
        per_question_before = dict(self.per_question)
        self._log({"step": 0, **before})
        # max_staleness = k: the batch of step s is sampled once the trainer has finished every step before
        # s - k (its weights are then version >= s - k), so when it is trained, at version s, no rollout is more
        # than k versions old. k = 0: sample, train, repeat (the paper); k >= 1: up to k batches are sampled
        # while the trainer steps (truncated importance weights correct them). docs/ARCHITECTURE.md §5.
        k = self.cfg.orchestrator.max_staleness
        in_training: deque = deque()  # (step, groups, t0, t_sample) sent to the trainer, StepDone not yet handled
        t_loop = time.perf_counter()
        for step in range(self.start_step, steps):
            while in_training and in_training[0][0] < step - k:
                self._finish_step(*in_training.popleft())
            self.status.update(state="sampling", step=step)
            t0 = time.perf_counter()
            groups = self.sample_batch(step)
            t_sample = time.perf_counter() - t0
            self._to_trainer(self.build_batch(step, groups))
            self.trainer_window[0] = self.trainer_window[0] or time.perf_counter()
            in_training.append((step, groups, t0, t_sample))
        while in_training:
            self._finish_step(*in_training.popleft())
        loop_s = time.perf_counter() - t_loop
        self.status.update(state="eval", step=steps)
        after = self.evaluate()
        self._log({"step": steps, **after})
        books = self.books.summary(in_flight=sum(g.n for g in self.groups.values() if g.train))
        summary = {
            **{f"{k}_before": v for k, v in before.items()},
            **{f"{k}_after": v for k, v in after.items()},
            "heldout_gain": self.paired_gain(per_question_before),
            "heldout_domains": {k.split("/", 1)[1]: {"before": v, "after": after.get(k)}
                                for k, v in before.items() if k.startswith("heldout_accuracy/")},
            "steps": steps,
            "resumed_from_step": self.start_step,
            "max_staleness": self.cfg.orchestrator.max_staleness,
            "loop_s": loop_s,  # the training steps alone (no evaluations before and after)
            "trainer_busy_frac": self.trainer_busy_s / max(1e-9, self.trainer_window[1] - self.trainer_window[0]),
            "policy_version": self.version,
            "wall_s": time.perf_counter() - t_start,
            "books": books,
            "eval": {"n": self.cfg.orchestrator.eval_n, "questions": len(self.heldout),
                     "temperature": self.cfg.orchestrator.eval_temperature},
            "mismatch": self.mismatch_summary(),
            "malformed_messages": self.malformed,
            "data": self.data_report,
            "checkpoint": self.step_done.checkpoint if self.step_done else "",
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.status["state"] = "done"
        self._heartbeat(force=True)
        return summary

    def _finish_step(self, step: int, groups: list[Group], t0: float, t_sample: float) -> None:
        """Wait for the trainer's StepDone of ``step``; log its metrics (and evaluate when due)."""
        self.status["state"] = "training"
        self.pump(lambda: step in self.steps_done)
        done = self.steps_done.pop(step)
        self.trainer_window[1] = time.perf_counter()
        self.trainer_busy_s += float(done.metrics.get("train_s", 0.0))
        metrics = self.step_metrics(step, groups, t_sample, time.perf_counter() - t0, done)
        steps = self.cfg.trainer.steps
        if self.cfg.orchestrator.eval_every and (step + 1) % self.cfg.orchestrator.eval_every == 0 and step + 1 < steps:
            self.status["state"] = "eval"
            metrics.update(self.evaluate())
        self._log(metrics)

    def sample_batch(self, step: int) -> list[Group]:
        """``prompts_per_step`` complete groups sampled on the newest weights (strictly on-policy).
        Filtered and stale groups are replaced by new ones, for at most ``max_refill_rounds`` rounds."""
        t, o = self.cfg.trainer, self.cfg.orchestrator
        wanted, kept = t.prompts_per_step, []
        for _ in range(o.max_refill_rounds + 1):
            batch = [self._new_group(self.prompts.next(), t.group_size, self._train_sampling(), True)
                     for _ in range(wanted - len(kept))]
            self.pump(lambda batch=batch: all(g.complete for g in batch))
            for g in batch:
                del self.groups[g.group_id]
                reason = self._filter_reason(g)
                if reason:
                    self.books.filtered += g.n
                    self.books.filtered_reasons[reason] += g.n
                elif self._is_stale(g):
                    self.books.stale += g.n
                else:
                    g.masked = o.mask_threshold is not None and bool(self.rewards(g).max() <= o.mask_threshold)
                    kept.append(g)
            if len(kept) == wanted:
                return kept
        raise RuntimeError(
            f"step {step}: only {len(kept)} of {wanted} groups survived {o.max_refill_rounds} refill rounds "
            f"(filtered so far: {dict(self.books.filtered_reasons)}); the prompts are all too easy or too hard "
            f"for this model, or raise orchestrator.max_refill_rounds")

    def rewards(self, g: Group) -> np.ndarray:
        """The rewards trained on: the verifiers' scores, 0 for a truncated response under
        ``overlong_penalty``."""
        r = np.array([g.scores[i].reward for i in range(g.n)], np.float32)
        if self.cfg.orchestrator.overlong_penalty:
            r[[g.rollouts[i].finish_reason == "length" for i in range(g.n)]] = 0.0
        return r

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy under the current weights: avg@eval_n at eval_temperature (the paper's
        metric), and greedy pass@1 if ``eval_greedy``. Both sets of groups are sampled together."""
        o, max_tokens = self.cfg.orchestrator, self.cfg.sampling.max_tokens
        if not self.heldout:  # no held-out prompts (no data.eval_files, no data.heldout_fraction)
            return {}
        modes = {"heldout_accuracy": (SamplingParams(temperature=o.eval_temperature, max_tokens=max_tokens), o.eval_n)
                 } if o.eval_n else {}
        if o.eval_greedy:
            modes["heldout_greedy_accuracy"] = (SamplingParams(temperature=0.0, max_tokens=max_tokens), 1)
        groups = {name: [self._new_group(row, n, sampling, False) for row in self.heldout]
                  for name, (sampling, n) in modes.items()}
        everything = [g for gs in groups.values() for g in gs]
        self.pump(lambda: all(g.complete for g in everything))
        result = {}
        for name, gs in groups.items():
            for g in gs:
                del self.groups[g.group_id]
            per_question = np.array([np.mean([g.scores[i].reward if i in g.scores else 0.0 for i in range(g.n)])
                                     for g in gs])
            self.per_question[name] = per_question
            result[name] = float(np.mean(per_question))
            by_domain = np.array([g.row.domain for g in gs])  # each domain's accuracy too
            result.update({f"{name}/{dom}": float(per_question[by_domain == dom].mean())
                           for dom in sorted(set(by_domain))})
        return result

    def paired_gain(self, before: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
        """After − before per metric, with a 95 % interval from the per-question paired differences
        (the same held-out questions are scored both times)."""
        out = {}
        for name, b in before.items():
            d = self.per_question[name] - b
            half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
            out[name] = {"delta": float(d.mean()), "ci95_low": float(d.mean() - half),
                         "ci95_high": float(d.mean() + half)}
        return out

    def build_batch(self, step: int, groups: list[Group]) -> TrainBatch:
        rows = [(g.rollouts[i], g.masked) for g in groups for i in range(g.n)]
        width = max(len(r.prompt_ids) + len(r.response_ids) for r, _ in rows)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = np.full((len(rows), width), pad, np.int32)
        response_mask = np.zeros((len(rows), width), bool)
        inf_logprobs = np.zeros((len(rows), width), np.float32)
        teacher = [lp for g in groups for lp in g.teacher] if self.mopd else None
        teacher_logprobs = np.zeros((len(rows), width), np.float32) if self.mopd else None
        for i, (r, _) in enumerate(rows):
            p, n = len(r.prompt_ids), len(r.response_ids)
            input_ids[i, :p] = r.prompt_ids
            input_ids[i, p : p + n] = r.response_ids
            response_mask[i, p : p + n] = True
            inf_logprobs[i, p : p + n] = r.inf_logprobs
            if teacher is not None:
                teacher_logprobs[i, p : p + n] = teacher[i]
        self.books.trained += len(rows)
        return TrainBatch(
            step=step,
            group_size=self.cfg.trainer.group_size,
            input_ids=input_ids,
            response_mask=response_mask,
            inf_logprobs=inf_logprobs,
            rewards=np.concatenate([self.rewards(g) for g in groups]),
            versions=np.array([r.policy_version for r, _ in rows], np.int32),
            teacher_logprobs=teacher_logprobs,
            loss_masked=np.array([masked for _, masked in rows], bool),
            cursor={"examples_drawn": self.prompts.drawn},
        )

    def step_metrics(self, step: int, groups: list[Group], t_sample: float, t_step: float, done: StepDone) -> dict:
        rollouts = [g.rollouts[i] for g in groups for i in range(g.n)]
        rewards = np.concatenate([self.rewards(g) for g in groups])
        tokens = sum(len(r.response_ids) for r in rollouts)
        trainer = done.metrics
        self.mismatch.append({k.removeprefix("mismatch/"): v for k, v in trainer.items() if k.startswith("mismatch/")})
        return {
            "step": step + 1,
            "version": self.version,
            "reward_mean": float(np.mean(rewards)),
            "verifier_reward_mean": float(np.mean([g.scores[i].reward for g in groups for i in range(g.n)])),
            "masked_groups": sum(g.masked for g in groups),
            "response_len_mean": tokens / len(rollouts),
            "truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "staleness_mean": float(np.mean([step - r.policy_version for r in rollouts])),
            "staleness_max": max(step - r.policy_version for r in rollouts),  # <= orchestrator.max_staleness
            "gen_tokens_per_s": tokens / max(t_sample, 1e-9),
            "sample_s": t_sample,
            "step_s": t_step,
            **{f"trainer/{k}": v for k, v in trainer.items()},
        }

    def mismatch_summary(self) -> dict[str, float]:
        """Engine vs trainer log-probs over the run: mean of the per-step means and fractions, max of maxima."""
        if not self.mismatch:
            return {}
        out = {k: float(np.mean([m[k] for m in self.mismatch])) for k in self.mismatch[0] if k != "abs_diff_max"}
        return {**out, "abs_diff_max": max(m["abs_diff_max"] for m in self.mismatch)}

    # ------------------------------------------------------------------ groups

    def _resume(self) -> int:
        """With ``trainer.resume_from``: the checkpoint's step, with the data cursor replayed to it."""
        path = checkpoint.resolve(self.cfg.trainer.resume_from, self.run_dir)
        if path is None:
            return 0
        info = json.loads((path / checkpoint.STATE_JSON).read_text())
        self.prompts.restore(info["extra"].get("orchestrator", {}).get("examples_drawn", 0))
        self.version = info["step"]
        log.info("resuming at step %d (%d prompts drawn)", info["step"], self.prompts.drawn)
        return info["step"]

    def _train_sampling(self) -> SamplingParams:
        s = self.cfg.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)

    def _new_group(self, row: Row, n: int, sampling: SamplingParams, train: bool) -> Group:
        self._seq += 1
        # every evaluation re-asks the same questions: render each held-out prompt once (training prompts
        # come once per epoch of a file that may hold millions: rendered when drawn, never kept)
        key = None if train else row.key()
        ids = self._prompt_ids.get(key) if key else None
        if ids is None:
            ids = np.array(self.render.ids(row.messages), np.int32)
            if key:
                self._prompt_ids[key] = ids
        g = Group(f"{'t' if train else 'e'}{self._seq}", row, ids, n, sampling, self.version, train,
                  needs_teacher=train and self.mopd)
        self.groups[g.group_id] = g
        self.prompt_queue.append(g.group_id)
        if train:
            self.books.dispatched += n
        return g

    def _filter_reason(self, g: Group) -> str:
        if g.error:  # "sampler_error: ..." or "teacher_error: ..."
            return g.error
        if self.cfg.orchestrator.dynamic_filtering and np.all(self.rewards(g) == self.rewards(g)[0]):
            return "uniform_rewards"  # dynamic filtering: all right or all wrong, no signal
        return ""

    def _is_stale(self, g: Group) -> bool:
        return any(self.version - r.policy_version > self.cfg.orchestrator.max_staleness
                   for r in g.rollouts.values())

    # ------------------------------------------------------------------ the event loop

    def pump(self, until: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Serve sockets, dispatch and enforce deadlines until ``until()`` holds."""
        give_up = time.monotonic() + timeout_s if timeout_s else None
        while not until():
            self._dispatch_prompts()
            self._dispatch_scores()
            self._dispatch_teachers()
            self._heartbeat()
            if self.router.poll(timeout=100):
                while self.router.poll(0):
                    self._receive()
            self._enforce_deadlines()
            if give_up and time.monotonic() > give_up:
                raise TimeoutError("orchestrator: condition not reached in time")

    def _receive(self) -> None:
        try:
            ident, msg = recv_routed(self.router, INBOUND)
        except ProtocolError as e:
            self.malformed += 1
            log.warning("dropped malformed message: %s", e)
            return
        if isinstance(msg, Ready):
            self._on_ready(ident, msg)
        elif isinstance(msg, Rollout):
            self._on_rollout(ident, msg)
        elif isinstance(msg, Score):
            self._on_score(ident, msg)
        elif isinstance(msg, TeacherLogprobs):
            self._on_teacher(ident, msg)
        elif isinstance(msg, WeightsReady):
            self.weights = msg
        elif isinstance(msg, StepDone):
            self.version = max(self.version, msg.version)
            self.step_done = msg  # the newest (its checkpoint ends the summary)
            self.steps_done[msg.step] = msg  # until _finish_step logs it (several in flight with max_staleness > 1)

    def _on_ready(self, ident: bytes, msg: Ready) -> None:
        old = self.workers.get(ident)
        if msg.draining:  # retiring: what it holds still comes back, so nothing is requeued
            if old is not None:
                old.draining = True
            log.info("%s is draining (%d items in hand)", ident.decode(), len(old.assigned) if old else 0)
            return
        if old is not None:  # a restarted worker: whatever it held is gone with its predecessor
            self._requeue_worker(ident, old, "worker restarted")
        self.workers[ident] = Worker(msg.role, msg.slots, msg.version, tuple(msg.domains))
        log.info("%s joined as %s (%d slots, version %d)", ident.decode(), msg.role, msg.slots, msg.version)

    def _on_rollout(self, ident: bytes, r: Rollout) -> None:
        g = self.groups.get(r.group_id)
        if g is None or r.attempt != g.attempt or g.worker != ident:
            self.books.duplicates_dropped += 1  # a late reply to an attempt already re-dispatched
            return
        w = self.workers.get(ident)
        if w is not None:
            w.version = max(w.version, r.policy_version)
        if r.finish_reason == "error":
            g.error = f"sampler_error: {r.error or 'unknown sampler error'}"
            self._release(g)
            return
        if not 0 <= r.index < g.n or r.index in g.rollouts:
            self.malformed += 1
            return
        g.rollouts[r.index] = r
        if len(g.rollouts) == g.n:
            self._release(g)
            if g.needs_teacher:
                self.teacher_queue.append(g.group_id)
        self._queue_score(g, r.index)

    def _queue_score(self, g: Group, index: int) -> None:
        """Queue rollout ``index`` for scoring; for a group domain (GenRM), queue the whole group once, when
        every rollout is in (index -1: every rollout still without a score)."""
        if not is_group_domain(g.row.domain):
            self.score_queue.append((g.group_id, index))
        elif len(g.rollouts) == g.n and (g.group_id, -1) not in self.score_queue:
            self.score_queue.append((g.group_id, -1))

    def _reply(self, ident: bytes, key: str, deadlines: dict[str, float]) -> tuple[Group | None, str]:
        """A reply to the score or teacher request ``key`` ("group/index/attempt"): frees the worker's slot
        and the deadline. Its group and index if it answers the group's current attempt, else (None, "")
        (a late reply to an attempt already re-dispatched, or a key that was never sent: dropped)."""
        w = self.workers.get(ident)
        if w is not None:
            w.assigned.pop(key, None)
        deadlines.pop(key, None)
        group_id, index, attempt = (key.rsplit("/", 2) + ["", ""])[:3]
        g = self.groups.get(group_id)
        if g is None or not attempt.isdigit() or int(attempt) != g.attempt:
            self.books.duplicates_dropped += 1
            return None, ""
        return g, index

    def _on_score(self, ident: bytes, s: Score) -> None:
        g, index = self._reply(ident, s.key, self.score_deadlines)
        if g is None:
            return
        if not index.isdigit() or int(index) in g.scores:
            self.books.duplicates_dropped += 1
            return
        g.scores[int(index)] = s

    def _on_teacher(self, ident: bytes, t: TeacherLogprobs) -> None:
        g, _ = self._reply(ident, t.key, self.teacher_deadlines)
        if g is None:
            return
        if g.teacher is not None:
            self.books.duplicates_dropped += 1
            return
        lens = [len(g.rollouts[i].response_ids) for i in range(g.n)]
        if not t.ok or len(t.logprobs) != sum(lens):
            g.error = f"teacher_error: {t.error or f'{len(t.logprobs)} log-probs for {sum(lens)} tokens'}"
            return
        g.teacher = np.split(np.asarray(t.logprobs, np.float32), np.cumsum(lens)[:-1])

    def _release(self, g: Group) -> None:
        w = self.workers.get(g.worker) if g.worker else None
        if w is not None:
            w.assigned.pop(g.group_id, None)

    def _dispatch_prompts(self) -> None:
        inflight = sum(len(w.assigned) for w in self.workers.values() if w.role == "sampler")
        while self.prompt_queue and inflight < self.cfg.orchestrator.max_inflight_groups:
            g = self.groups.get(self.prompt_queue[0])
            if g is None:
                self.prompt_queue.popleft()
                continue
            free = [(i, w) for i, w in self.workers.items() if w.role == "sampler" and w.fits(g.n)]
            if not free:
                return
            ident, w = min(free, key=lambda iw: iw[1].load)
            self.prompt_queue.popleft()
            if w.version < g.min_version and self.weights is not None and self.weights.version >= g.min_version:
                if not self._send(ident, self.weights):  # a late joiner: hand it the newest weights first
                    self.prompt_queue.appendleft(g.group_id)  # it is gone (dropped by _send): another takes it
                    continue
                w.version = self.weights.version
            g.worker, g.deadline = ident, time.monotonic() + self.cfg.orchestrator.sampler_timeout_s
            req = PromptRequest(g.group_id, g.row.domain, g.prompt_ids, g.n, g.sampling, g.min_version,
                                g.attempt)
            if self._send(ident, req):
                w.assigned[g.group_id] = g.n
                inflight += 1
            else:
                self.prompt_queue.appendleft(g.group_id)

    def _dispatch_scores(self) -> None:
        while self.score_queue:
            group_id, index = self.score_queue[0]
            g = self.groups.get(group_id)
            indices = [i for i in range(g.n) if i not in g.scores] if g is not None and index == -1 else [index]
            if g is None or not indices or any(i not in g.rollouts for i in indices):
                self.score_queue.popleft()
                continue
            domain = g.row.domain
            free = [(i, w) for i, w in self.workers.items()
                    if w.role == "verifier" and domain in w.domains and w.fits(len(indices))]
            if not free:
                return
            ident, w = min(free, key=lambda iw: iw[1].load)
            self.score_queue.popleft()
            keys = [f"{group_id}/{i}/{g.attempt}" for i in indices]
            # the verifier gets the whole assistant turn: what the chat template opened it with ("<think>\n")
            texts = [self.render.prefix + self.tokenizer.decode(g.rollouts[i].response_ids, skip_special_tokens=True)
                     for i in indices]
            deadline_s = self.cfg.orchestrator.verifier_timeout_s
            if index == -1:
                req = GroupScoreRequest(keys, domain, g.row.question, texts, g.row.answer, g.row.metadata, deadline_s)
            else:
                req = ScoreRequest(keys[0], domain, texts[0], g.row.answer,
                                   {"question": g.row.question, **g.row.metadata}, deadline_s)
            if self._send(ident, req):
                for key in keys:
                    w.assigned[key] = 1
                    self.score_deadlines[key] = time.monotonic() + deadline_s
            else:
                self.score_queue.appendleft((group_id, index))

    def _dispatch_teachers(self) -> None:
        """MOPD: each complete group's rollouts to a teacher of its domain (one request per group)."""
        while self.teacher_queue:
            g = self.groups.get(self.teacher_queue[0])
            if g is None or g.teacher is not None or g.error or len(g.rollouts) < g.n:
                self.teacher_queue.popleft()
                continue
            domain = g.row.domain
            free = [(i, w) for i, w in self.workers.items()
                    if w.role == "teacher" and domain in w.domains and w.fits(g.n)]
            if not free:
                return
            ident, w = min(free, key=lambda iw: iw[1].load)
            self.teacher_queue.popleft()
            key = f"{g.group_id}/teacher/{g.attempt}"
            responses = [g.rollouts[i].response_ids for i in range(g.n)]
            timeout_s = self.cfg.orchestrator.teacher_timeout_s
            req = TeacherRequest(key, domain, g.prompt_ids, np.concatenate(responses).astype(np.int32),
                                 np.array([len(r) for r in responses], np.int32), g.sampling.temperature, timeout_s)
            if self._send(ident, req):
                w.assigned[key] = g.n
                self.teacher_deadlines[key] = time.monotonic() + timeout_s
            else:
                self.teacher_queue.appendleft(g.group_id)

    def _requeue_item(self, key: str) -> None:
        """A score or teacher request that will not come back (deadline, worker gone): ask again."""
        group_id, index, _ = key.rsplit("/", 2)
        g = self.groups.get(group_id)
        if g is None:
            return
        if index == "teacher":
            self.teacher_queue.append(group_id)
        else:
            self._queue_score(g, int(index))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for g in list(self.groups.values()):
            if g.worker is not None and len(g.rollouts) < g.n and not g.error and now > g.deadline:
                log.warning("group %s: sampler %s missed its deadline; re-dispatching", g.group_id, g.worker)
                self._redispatch(g)
        for deadlines in (self.score_deadlines, self.teacher_deadlines):
            for key, deadline in list(deadlines.items()):
                if now > deadline:
                    del deadlines[key]
                    for w in self.workers.values():
                        w.assigned.pop(key, None)
                    log.warning("%s missed its deadline; re-requesting", key)
                    self._requeue_item(key)

    def _redispatch(self, g: Group) -> None:
        self._release(g)
        g.attempt += 1
        g.worker, g.rollouts, g.scores, g.teacher = None, {}, {}, None
        if g.train:
            self.books.redispatched += g.n
        self.prompt_queue.appendleft(g.group_id)

    def _requeue_worker(self, ident: bytes, w: Worker, why: str) -> None:
        for item in list(w.assigned):
            if item in self.groups:
                log.warning("group %s: %s (%s); re-dispatching", item, why, ident.decode())
                self._redispatch(self.groups[item])
            else:
                self.score_deadlines.pop(item, None)
                self.teacher_deadlines.pop(item, None)
                self._requeue_item(item)
        w.assigned.clear()

    def _send(self, ident: bytes, msg) -> bool:
        try:
            send(self.router, msg, identity=ident)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: the worker is gone; its work goes back to the queues
            log.warning("%s unreachable (%s); dropping it", ident.decode(), e)
            w = self.workers.pop(ident, None)
            if w is not None:
                self._requeue_worker(ident, w, "worker unreachable")
            return False

    def _to_trainer(self, batch: TrainBatch) -> None:
        self.pump(lambda: self._have("trainer"))
        ident = next(i for i, w in self.workers.items() if w.role == "trainer")
        if not self._send(ident, batch):
            raise RuntimeError("trainer unreachable")

    def _have(self, role: str) -> bool:
        return any(w.role == role for w in self.workers.values())

    # ------------------------------------------------------------------ reporting

    def _log(self, metrics: dict) -> None:
        metrics = {**metrics, "time": time.time()}  # wall clock: with max_staleness > 0 steps overlap, and
        # the time between two lines is what a step costs
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(k, v, global_step=metrics.get("step", 0))
            self.tb.flush()
        self.status["last"] = {k: v for k, v in metrics.items()
                               if not k.startswith("trainer/") or k.startswith(("trainer/mismatch/", "trainer/mopd/"))}
        self._heartbeat(force=True)

    def _heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.beat is None or (now < self.next_beat and not force):
            return
        self.next_beat = now + self.cfg.supervisor.heartbeat_s
        in_flight = sum(g.n for g in self.groups.values() if g.train)
        counters = {"books": self.books.summary(in_flight), "malformed": self.malformed, **self.status}
        try:
            send(self.beat, Heartbeat("orchestrator", "orchestrator", os.getpid(),
                                      self.status["state"], self.version, counters), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


def main(argv: list[str] | None = None) -> None:
    _, cfg = worker_start(__doc__.splitlines()[0], argv, default_id="orchestrator")
    summary = Orchestrator(cfg).run()
    log.info("done: %s", json.dumps(summary))


if __name__ == "__main__":
    main()

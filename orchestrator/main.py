"""Orchestrator: the hub of the data plane, one stage top to bottom.

    python -m cascade_rl.orchestrator.main --config RUN_DIR/config.yaml

Started by the supervisor. It opens the prompt sets the supervisor prepared in ``run_dir/data``
(memory-mapped, drawn in the seeded order whose count is the checkpoint's data cursor), binds the
ROUTER every worker connects to (an IO thread owns it: protocol/sockets.py ``RouterLink``) and runs
the stage (``run``): wait for the workers, evaluate the starting policy, then for each step sample a
batch of groups, score them, hand the complete groups to the trainer as a ``TrainBatch`` and take its
``StepDone``; evaluate again and write ``summary.json``.

Every rule of dispatch, credit, deadline and fate lives in orchestrator/core.py, a state machine
without sockets; this file only feeds it: ``pump`` moves messages between the IO thread and the core
until a condition holds, and says what it waits for in its heartbeat (a stalled run's report,
supervisor/stall.py, prints it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cascade_rl.data.promptset import PromptSet, PromptStream
from cascade_rl.data.render import PromptRenderer, TurnRenderer
from cascade_rl.data.tokenizer import load_tokenizer
from cascade_rl.learner import checkpoint_dirs
from cascade_rl.protocol import exits
from cascade_rl.protocol.agents import AgentDone, GatewayGenerate, GatewayReward, read_secret
from cascade_rl.protocol.messages import (
    EnvReply,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    StepDone,
    TeacherLogprobs,
    WeightsReady,
)
from cascade_rl.protocol.sockets import RouterLink
from cascade_rl.protocol.worker_main import worker_start

from . import evaluate as evaluation
from . import refill, rollout_log, trajectory
from .assembly import Assembly, Part, shares
from .batch import build_batch, mismatch_summary, step_metrics
from .core import Core
from .groups import UNAVAILABLE, Group
from .ledger import LEDGER_FILE, Ledger, compare_trainer
from .report import MetricsLog, live_metrics, write_summary
from .rules import Rules
from .trackers import RunIdentity, Trackers

log = logging.getLogger("orchestrator")
INBOUND = (Ready, Rollout, Score, TeacherLogprobs, StepDone, WeightsReady, EnvReply, GatewayGenerate, AgentDone,
           GatewayReward)
UNAVAILABLE_MAX_WAIT_S = 30.0  # the longest wait between refill rounds while a verifier is unavailable


@dataclasses.dataclass
class Outage:
    """Refill rounds of one step that lost groups to an unavailable verifier, in a row, and since when."""

    since: float = 0.0
    rounds: int = 0


class Orchestrator:
    def __init__(self, cfg) -> None:
        # --- data: the prepared prompt sets, the held-out rows rendered once
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.render = PromptRenderer(self.tokenizer, cfg.data.thinking)
        data_dir = self.run_dir / "data"  # prepared by the supervisor (supervisor/run_data.py)
        self.prompts = PromptStream(data_dir, cfg.data.seed)  # its draw count is the data cursor
        self.heldout = PromptSet(data_dir / "eval.arrow").rows()
        self.heldout_ids = [np.array(self.render.ids(row.messages), np.int32) for row in self.heldout]
        self.data_report = json.loads((data_dir / "data.json").read_text())
        # --- resume, rules and ledger, the IO thread
        self.start_step = self._resume()
        rules = Rules.from_config(cfg, evaluation.model_context(cfg.model.path))
        if cfg.get("gateway", {}).get("secret_file"):  # agent rows: each trajectory's API key is signed with it
            rules.gateway_secret = read_secret(cfg.gateway.secret_file)
        self.core = Core(rules, self._decode,
                         Ledger(self.run_dir / LEDGER_FILE, self.start_step),
                         template=TurnRenderer(self.render), version=self.start_step)
        self.trackers = Trackers(list(cfg.logger), RunIdentity.of(cfg))  # W&B, MLflow, TensorBoard: a thread
        self.metrics = MetricsLog(self.run_dir, self.trackers)
        self.status = {"state": "starting", "step": self.start_step, "steps": cfg.run.steps, "progress": 0}
        self._snapshot: dict = {"state": "starting"}
        self.link = RouterLink(cfg.endpoints.orchestrator, cfg.endpoints.get("heartbeat") or None, INBOUND,
                               status=lambda: self._snapshot, heartbeat_s=cfg.supervisor.heartbeat_s).start()
        self.next_beat = 0.0
        self.per_question: dict[str, np.ndarray] = {}  # the latest evaluation, per held-out question
        self.mismatch: list[dict[str, float]] = []  # per step: engine vs trainer log-probs
        self.trainer_window, self.trainer_busy_s = [0.0, 0.0], 0.0  # first batch sent, last StepDone
        self.multi_turn = trajectory.Totals()  # multi-turn: the trained trajectories' counts (summary.json multi_turn)
        self.sampled: dict[int, int] = {}  # per step in flight: the rollouts sampled for it, kept or not
        self.keep_rate = refill.KeepRate()  # the fraction of settled groups kept lately (over-dispatch)

    # ------------------------------------------------------------------ the stage, top to bottom

    def run(self) -> dict:
        t_start, o, steps = time.perf_counter(), self.cfg.orchestrator, self.cfg.run.steps
        roles = ["trainer", "sampler", "verifier"] + (["teacher"] if self.core.rules.mopd else []) + (
            ["environment"] if self.cfg.environment.serve else [])
        self.pump(lambda: all(self.core.pool.have(r) for r in roles), "workers: " + ", ".join(roles))
        if self.start_step:  # resumed: the trainer publishes the checkpoint's weights before anything samples
            self.pump(lambda: self.core.weights is not None and self.core.weights.version >= self.start_step,
                      f"the trainer's weights of the checkpoint (version {self.start_step})")
        before = self.evaluate()
        per_question_before = dict(self.per_question)
        self._log({"step": 0, **before})
        # max_staleness = k: the batch of step s is sampled once the trainer has finished every step before s - k
        # (its weights are then version >= s - k), so when it is trained, at version s, no rollout is more than k
        # versions old. k = 0: sample, train, repeat (the paper). docs/ARCHITECTURE.md §5.
        in_training: deque = deque()  # (step, groups, t0, t_sample): sent to the trainer, StepDone not yet taken
        t_loop = time.perf_counter()
        for step in range(self.start_step, steps):
            while in_training and in_training[0][0] < step - o.max_staleness:
                self.finish_step(*in_training.popleft())
            self.status.update(state="sampling", step=step)
            t0 = time.perf_counter()
            groups = self.sample_batch(step)  # sent to the trainer as they are kept
            t_sample = time.perf_counter() - t0
            in_training.append((step, groups, t0, t_sample))
        while in_training:
            self.finish_step(*in_training.popleft())
        loop_s = time.perf_counter() - t_loop
        self.status.update(state="eval", step=steps)
        after = self.evaluate()
        self._log({"step": steps, **after})
        books = {**self.core.books(), "trainer_ids": compare_trainer(self.run_dir)}
        summary = write_summary(
            self.run_dir, before, after,
            heldout_gain={k: evaluation.paired_gain(self.per_question[k], b) for k, b in per_question_before.items()},
            heldout_domain_gain=evaluation.domain_gains(self.per_question, per_question_before, self.heldout),
            heldout_ci95=evaluation.domain_intervals(self.per_question, self.heldout),
            # per held-out row (ids in order), each mode: what another run's gains can be paired with
            heldout_per_question={"rows": [row.id for row in self.heldout], **{
                k: {"before": np.round(b, 4).tolist(), "after": np.round(self.per_question[k], 4).tolist()}
                for k, b in per_question_before.items()}},
            steps=steps, resumed_from_step=self.start_step, max_staleness=o.max_staleness,
            loop_s=loop_s,  # the training steps alone (no evaluations before and after)
            trainer_busy_frac=self.trainer_busy_s / max(1e-9, self.trainer_window[1] - self.trainer_window[0]),
            policy_version=self.core.version, wall_s=time.perf_counter() - t_start, books=books,
            version_span=self.core.ledger.version_span(),  # in-flight updates: tokens of one rollout, many versions
            eval={"n": o.eval_n, "questions": len(self.heldout), "temperature": o.eval_temperature},
            mismatch=mismatch_summary(self.mismatch), multi_turn=self.multi_turn.summary(),
            turn_wait={k: m.summary() for k, m in self.core.turn_waits.items() if m.n},  # queued to sampled
            malformed_messages=self.core.malformed + self.link.malformed, data=self.data_report,
            checkpoint=self.core.last_step.checkpoint if self.core.last_step else "")
        self.status["state"] = "done"
        self._beat(force=True)
        return summary

    def sample_batch(self, step: int) -> list[Group]:
        """``prompts_per_step`` complete groups sampled for ``step``, each settled as soon as it is scored and sent
        to the trainer in parts as they are kept (``orchestrator.stream_tokens``; one part, the whole step, by
        default: orchestrator/assembly.py). A filtered or stale group is replaced at once (with
        ``orchestrator.over_dispatch``, ahead of time: orchestrator/refill.py), up to ``max_refill_rounds`` x
        ``prompts_per_step`` replacements; one lost to an unavailable verifier (a judge server restarting) does not
        count, and its replacement waits for the verifier to come back (``wait_for_verifiers``)."""
        r, o, s, t = self.cfg.run, self.cfg.orchestrator, self.cfg.sampling, self.cfg.trainer
        sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)
        wanted, kept, waiting, outage, order = r.prompts_per_step, [], [], Outage(), {}
        parts = Assembly(wanted, t.world_size // t.context_parallel, o.stream_tokens,
                         order=lambda g: order[g.group_id])
        budget = wanted * (1 + o.max_refill_rounds)  # groups the step may dispatch (unavailable verifiers' aside)
        most = 1.0 if self.core.rules.gateway_secret else o.over_dispatch  # agents are never cut off
        while True:
            n = min(refill.to_dispatch(wanted - len(kept), len(waiting), self.keep_rate.value, most), budget)
            if not n and not waiting:
                raise RuntimeError(self._refills_exhausted(step, len(kept), wanted))
            if (ahead := len(waiting) + n - (wanted - len(kept))) > 0 and n:
                log.info("step %d: %d groups in flight for %d missing (%d ahead; keep rate %.2f)", step,
                         len(waiting) + n, wanted - len(kept), ahead, self.keep_rate.value)
            for _ in range(n):
                row = self.prompts.next()  # rendered when drawn, never kept: a file may hold millions
                ids = np.array(self.render.ids(row.messages), np.int32)
                self.sampled[step] = self.sampled.get(step, 0) + r.group_size  # trained or filtered: the cost
                waiting.append(self.core.add_group(row, ids, r.group_size, sampling, train=True, step=step,
                                                   env=self.env_of(row)))
                order[waiting[-1].group_id] = len(order)
            budget -= n
            self.pump(lambda waiting=waiting: any(g.complete for g in waiting),
                      lambda kept=kept, waiting=waiting: f"step {step}: {len(kept)} of {wanted} groups kept, "
                                                         f"{len(waiting)} being sampled and scored")
            done = sorted((g for g in waiting if g.complete), key=lambda g: order[g.group_id])
            waiting = [g for g in waiting if not g.complete]
            settled = []  # each group settled (kept, filtered, stale) as it completes, while the step needs it
            for i, g in enumerate(done):
                if len(kept) + len(settled) == wanted:  # over-dispatch: complete, yet surplus
                    waiting, done = waiting + done[i:], done[:i]
                    break
                settled += self.core.settle([g])
            unavailable = [g.error for g in done if g.error.startswith(UNAVAILABLE)]
            self.keep_rate.add(len(settled), len(done) - len(unavailable))
            kept += settled
            for part in parts.add(settled):  # kept ones go on in parts
                self.to_trainer(step, part)
            if len(kept) == wanted:
                if waiting:  # over-dispatch's surplus
                    self.core.cancel(waiting, f"surplus: step {step} was complete")
                return kept
            if unavailable:  # not the prompts' fault: replaced without using the budget, once the verifier is back
                budget += len(unavailable)
                self.wait_for_verifiers(step, len(unavailable), unavailable[-1], outage)
            elif done:
                outage = Outage()

    def _refills_exhausted(self, step: int, kept: int, wanted: int) -> str:
        rounds = self.cfg.orchestrator.max_refill_rounds
        reasons = self.core.ledger.reasons
        why = ("the prompts are all too easy or too hard for this model, or raise orchestrator.max_refill_rounds"
               if reasons.get("uniform_rewards", 0) * 2 >= sum(reasons.values()) else
               f"most groups failed; the commonest reason: {reasons.most_common(1)[0][0][:500]}")
        return (f"step {step}: only {kept} of {wanted} groups survived {rounds} refill rounds (filtered so far: "
                f"{dict(reasons)}); {why}")

    def wait_for_verifiers(self, step: int, lost: int, reason: str, outage: Outage) -> None:
        """``lost`` groups of this round failed because a verifier could not score (a judge down or restarting: the
        supervisor restarts a judge it serves). Replacements sampled now would fail the same way, so wait first: 1 s,
        doubling each round, at most 30 s; past ``orchestrator.unavailable_timeout_s`` of this the step fails."""
        now = time.monotonic()
        outage.since, outage.rounds = outage.since or now, outage.rounds + 1
        limit = self.cfg.orchestrator.unavailable_timeout_s
        if now - outage.since > limit:
            raise RuntimeError(f"step {step}: verifiers unavailable for over orchestrator.unavailable_timeout_s={limit:g} "
                               f"s; the last reason: {reason}")
        wait = min(UNAVAILABLE_MAX_WAIT_S, 2.0 ** (outage.rounds - 1))
        log.warning("step %d: %d groups lost to an unavailable verifier (%s); new groups in %g s", step, lost,
                    reason[:300], wait)
        until = now + wait
        self.pump(lambda: time.monotonic() >= until,
                  f"step {step}: {wait:g} s before new groups, a verifier being unavailable ({reason[:200]})")

    def to_trainer(self, step: int, part: Part) -> None:
        """``part`` of ``step``'s groups to the trainer: each data-parallel rank its own share as a ``TrainBatch``
        (the ranks of one context-parallel group the same one); the ledger settles them as trained."""
        o, t = self.cfg.orchestrator, self.cfg.trainer
        self.pump(lambda: all(self.core.pool.trainer(r) for r in range(t.world_size)), "the trainer's ranks")
        batches = []
        for share in shares(part.groups, t.world_size // t.context_parallel):
            batch = build_batch(step, share, self.cfg.run.group_size, self.core.rules.mopd,
                                o.overlong_penalty, {"examples_drawn": self.prompts.drawn})
            batches += [dataclasses.replace(batch, part=part.index, last=part.last,
                                            step_groups=self.cfg.run.prompts_per_step)] * t.context_parallel
            if o.get("save_rollouts", False):
                rollout_log.append(self.run_dir / "rollouts.jsonl", batch, share)
        self.core.to_trainer(batches, part.groups)
        self._flush()
        self.multi_turn.add(x for g in part.groups for x in g.trajectories.values())
        self.trainer_window[0] = self.trainer_window[0] or time.perf_counter()

    def finish_step(self, step: int, groups: list[Group], t0: float, t_sample: float) -> None:
        """Take the trainer's StepDone of ``step``; log its metrics (and evaluate when due)."""
        self.status["state"] = "training"
        self.pump(lambda: step in self.core.steps_done, f"the trainer's StepDone of step {step}")
        done = self.core.take_step(step)
        self.trainer_window[1] = time.perf_counter()
        self.trainer_busy_s += float(done.metrics.get("train_s", 0.0))
        self.mismatch.append({k.removeprefix("mismatch/"): v for k, v in done.metrics.items()
                              if k.startswith("mismatch/")})
        metrics = step_metrics(step, self.core.version, groups, self.cfg.orchestrator.overlong_penalty, t_sample,
                               time.perf_counter() - t0, done)
        # what filtering costs: rollouts sampled per rollout trained (1.0: none filtered, stale or failed)
        metrics["sampled_per_trained"] = self.sampled.pop(step, 0) / max(1, sum(g.n for g in groups))
        every, steps = self.cfg.orchestrator.eval_every, self.cfg.run.steps
        if every and (step + 1) % every == 0 and step + 1 < steps:
            metrics.update(self.evaluate())
        self._log(metrics)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy under the current weights (orchestrator/evaluate.py): avg@eval_n at eval_temperature
        and, with ``eval_greedy``, greedy pass@1; both sets of groups sampled together."""
        o = self.cfg.orchestrator
        if not self.heldout:  # no held-out prompts (no data.eval_files, no data.heldout_fraction)
            return {}
        self.status["state"] = "eval"
        groups = {name: [self.core.add_group(row, ids, n, sampling, train=False, env=self.env_of(row))
                         for row, ids in zip(self.heldout, self.heldout_ids)]
                  for name, (sampling, n) in evaluation.modes(o.eval_n, o.eval_temperature, o.eval_greedy,
                                                               self.cfg.sampling.max_tokens).items()}
        everything = [g for gs in groups.values() for g in gs]
        self.pump(lambda: all(g.complete for g in everything),
                  lambda: f"evaluation: {sum(g.complete for g in everything)} of {len(everything)} groups")
        result = {}
        for name, gs in groups.items():
            self.core.forget(gs)
            rewards = [[g.scores[i].reward if i in g.scores else 0.0 for i in range(g.n)] for g in gs]
            self.per_question[name], domains = evaluation.accuracy([g.row.domain for g in gs], rewards)
            result[name] = float(np.mean(self.per_question[name]))
            result.update({f"{name}/{d}": v for d, v in domains.items()})
        return result

    # ------------------------------------------------------------------ the event loop

    def pump(self, until: Callable[[], bool], waiting_for: str | Callable[[], str], timeout_s: float = 0.0) -> None:
        """Move messages between the IO thread and the core, dispatch and enforce deadlines, until ``until()``."""
        give_up = time.monotonic() + timeout_s if timeout_s else None
        self.waiting_for = waiting_for
        while not until():
            self.core.dispatch()
            self._flush()
            self._beat()
            try:
                item = self.link.inbox.get(timeout=0.1)
                while True:
                    self.core.receive(*item)
                    item = self.link.inbox.get_nowait()
            except queue.Empty:
                pass
            self.core.expire()
            if give_up and time.monotonic() > give_up:
                raise TimeoutError(f"orchestrator: still waiting for {self._waiting()}")
        self.status["progress"] += 1  # what the supervisor's stall watch looks for

    def _flush(self) -> None:
        """What the core has to send, to the IO thread."""
        for item in self.core.take_outbox():
            self.link.send(item)

    def _waiting(self) -> str:
        return self.waiting_for() if callable(self.waiting_for) else self.waiting_for

    def _beat(self, force: bool = False) -> None:
        """Hand the IO thread a fresh status for its heartbeats (built here: the core is this thread's alone)."""
        now = time.monotonic()
        if now < self.next_beat and not force:
            return
        self.next_beat = now + self.cfg.supervisor.heartbeat_s
        counters = {"books": self.core.books(), "malformed": self.core.malformed, **self.status,
                    "dashboards_failed": self.trackers.failed.copy(),  # the supervisor says each once
                    "waiting_for": self._waiting(), "workers": self.core.pool.holdings(self.core.clock())}
        self._snapshot = {"state": self.status["state"], "version": self.core.version, "counters": counters}
        if force:
            self.link.beat_now()

    def _log(self, metrics: dict) -> None:
        self.status["last"] = live_metrics(self.metrics.log(metrics))
        self._beat(force=True)

    def env_of(self, row) -> str:
        """The environment of a multi-turn row: its own, else its domain's default ("": single-turn)."""
        return row.env or self.cfg.environment.defaults.get(row.domain, "")

    def _decode(self, response_ids: np.ndarray) -> str:
        """What a verifier scores: the whole assistant turn, with what the chat template opened it with."""
        return self.render.prefix + self.tokenizer.decode(response_ids, skip_special_tokens=True)

    def _resume(self) -> int:
        """With ``run.resume_from``: the checkpoint's step, with the data cursor replayed to it."""
        path = checkpoint_dirs.resolve(self.cfg.run.resume_from, self.run_dir)
        if path is None:
            return 0
        info = json.loads((path / checkpoint_dirs.STATE_JSON).read_text())
        self.prompts.restore(info["extra"].get("orchestrator", {}).get("examples_drawn", 0))
        log.info("resuming at step %d (%d prompts drawn)", info["step"], self.prompts.drawn)
        return info["step"]

    def close(self, ok: bool) -> None:
        if ok:
            self.trackers.attach([self.run_dir / "summary.json", self.run_dir / "config.yaml"])
        self.trackers.close(ok)
        self.core.ledger.close()
        self.link.close()


def main(argv: list[str] | None = None) -> None:
    _, cfg = worker_start(__doc__.splitlines()[0], argv, default_id="orchestrator")
    orchestrator, ok = Orchestrator(cfg), False
    try:
        summary = orchestrator.run()
        log.info("done: %s", json.dumps(summary))
        ok = True
    except Exception as e:
        if exits.disk_full(e, cfg.run_dir):  # the supervisor stops the run and says so; the ledger is whole
            log.error("no space left in run_dir=%s (%s): the ledger so far is whole", cfg.run_dir, e)
            raise SystemExit(exits.DISK_FULL) from e
        raise
    finally:
        orchestrator.close(ok)


if __name__ == "__main__":
    main()

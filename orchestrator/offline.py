"""The orchestrator's rules run in one process with the real parts answering in place of the sockets.

    core = offline_core(PromptRenderer(tokenizer, thinking=True))
    groups = [core.add_group(row, ids, n, sampling, train=False, env=row.env) for ...]
    run_in_process(core, engine, environments={"python": build_environment("python")})

``run_in_process`` delivers every message the core sends to what serves it here: PromptRequests (first
turns and multi-turn rows' next turns) to a sampler engine, EnvRequests to the environment of that name
(environments/registry.py), ScoreRequests to the domain's verifier (``verifiers.scoring.score_one``); their
replies go back to the core, until it has nothing left to send. The rules are the ones a launch runs
(orchestrator/core.py), so an offline evaluation of a checkpoint (orchestrator/evaluate.py) samples
multi-turn rows exactly as a stage does, and a test can drive real engines without sockets.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from cascade_rl.data.render import PromptRenderer, TurnRenderer
from cascade_rl.protocol.messages import (
    EnvRequest,
    GroupScoreRequest,
    PromptRequest,
    Ready,
    Rollout,
    Score,
    ScoreRequest,
)
from cascade_rl.samplers.engine import to_generation
from cascade_rl.verifiers.registry import JUDGED_DOMAINS
from cascade_rl.verifiers.scoring import score_group, score_one

from .core import Core, Rules
from .ledger import Ledger

SAMPLER, VERIFIER, ENVIRONMENT = b"sampler-0", b"verifier-0", b"environment-0"


def offline_core(render: PromptRenderer, rules: Rules | None = None, domains: list[str] = (),
                 environments: list[str] = ()) -> Core:
    """A core for prompts rendered by ``render``, with one in-process sampler, verifier (of ``domains``) and
    environment worker (of ``environments``) joined, and no ledger file."""
    tokenizer = render.tokenizer
    core = Core(rules or Rules(), decode=lambda ids: render.prefix + tokenizer.decode(ids, skip_special_tokens=True),
                ledger=Ledger(None), template=TurnRenderer(render))
    for ident, role, served in ((SAMPLER, "sampler", []), (VERIFIER, "verifier", list(domains)),
                                (ENVIRONMENT, "environment", list(environments))):
        core.receive(ident, Ready(ident.decode(), role, 1 << 20, 0, served))
    return core


class Scorer:
    """Score requests in this process: ``workers`` at a time (a verifier that runs a sandbox or calls a judge
    waits on another process, so threads overlap them), and the requests of judged domains (``JUDGED_DOMAINS``)
    ``judge_workers`` at a time: each waits on an HTTP call, and the judge server decodes the calls it has at
    once together (a judge given 4 at a time decodes 4 rows a step, given 32 it decodes 32 in about the same
    time). Each distinct (domain, response, reference, metadata) is scored once. A sharpened policy samples the
    same response again and again: an evaluation of code or SWE rows then runs each distinct program once. A
    score the verifier could not make (``unavailable``) is not remembered."""

    def __init__(self, workers: int = 4, judge_workers: int = 4) -> None:
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="score")
        self.judge_pool = ThreadPoolExecutor(max(1, judge_workers), thread_name_prefix="judge")
        self.memo: dict[str, Score] = {}
        self.calls = 0

    @staticmethod
    def _key(m: ScoreRequest) -> str:
        return json.dumps([m.domain, m.text, m.reference, m.metadata], sort_keys=True, default=str)

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        keys = [self._key(m) for m in requests]
        todo = {k: m for k, m in zip(keys, requests) if k not in self.memo}
        judged = [k for k, m in todo.items() if m.domain in JUDGED_DOMAINS]
        rest = [k for k, m in todo.items() if m.domain not in JUDGED_DOMAINS]
        scoring = (self.judge_pool.map(score_one, [todo[k] for k in judged]),  # both pools at work at once
                   self.pool.map(score_one, [todo[k] for k in rest]))
        scores = [s for results in scoring for s in results]
        for k, score in zip(judged + rest, scores):
            self.calls += 1
            todo[k] = score
            if not score.unavailable:  # an unavailable verifier is asked again next time
                self.memo[k] = score
        return [dataclasses.replace(self.memo.get(k) or todo[k], key=m.key) for k, m in zip(keys, requests)]

    def close(self) -> None:
        self.pool.shutdown()
        self.judge_pool.shutdown()


def run_in_process(core: Core, engine, environments: Mapping[str, object] = {}, scorer: Scorer | None = None) -> None:
    """Serve everything ``core`` sends, here, until it sends nothing more (every group complete)."""
    from cascade_rl.environments.steps import run_step  # environments import the verifiers: loaded when needed

    own = scorer is None
    scorer = scorer or Scorer()
    try:
        _serve(core, engine, environments, scorer, run_step)
    finally:
        if own:
            scorer.close()


def _serve(core: Core, engine, environments: Mapping[str, object], scorer: Scorer, run_step) -> None:
    while True:
        core.dispatch()
        out = core.take_outbox()
        if not out:
            return
        prompts = [m for _, m in out if isinstance(m, PromptRequest)]
        groups = engine.generate([to_generation(r) for r in prompts]) if prompts else []
        for req, samples in zip(prompts, groups):
            for k, s in enumerate(samples):
                core.receive(SAMPLER, Rollout(req.key.answer(k), req.domain, req.prompt_ids, s.response_ids,
                                              s.logprobs, s.finish_reason, engine.version, SAMPLER.decode()))
        for score in scorer.score([m for _, m in out if isinstance(m, ScoreRequest)]):
            core.receive(VERIFIER, score)
        steps = [m for _, m in out if isinstance(m, EnvRequest)]  # tool calls run in sandboxes: side by side too
        for reply in scorer.pool.map(lambda m: run_step(environments.get(m.env) or _Missing(m.env, sorted(environments)),
                                                        m), steps):
            core.receive(ENVIRONMENT, reply)
        for _, m in out:
            if isinstance(m, GroupScoreRequest):
                for score in score_group(m):
                    core.receive(VERIFIER, score)


class _Missing:
    """An environment this process does not have: every step fails with the names it has."""

    def __init__(self, name: str, have: list[str]) -> None:
        self.reason = f"no environment {name!r} here (have: {have})"

    def step(self, messages, state, metadata):
        raise LookupError(self.reason)

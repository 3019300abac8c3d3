"""A group (one prompt and its n rollouts) and the rules that decide what is trained: pure functions, no IO.

Ids (docs/ARCHITECTURE.md §6, the ledger): a training group of step s is ``s{s}g{k}`` (k counts the step's
groups, refills included), an evaluation group ``e{k}``; rollout i of a group is ``{group}/{i}`` for the
whole of its life, whichever attempt (re-dispatch) produced it (protocol/messages.py ``rollout_id``). The work
handed to samplers, verifiers, teachers and environments is keyed by a ``WorkKey`` (protocol/messages.py), built
here (``sample_key``, ``score_key``, ``teacher_key``, ``turn_key``) and echoed in the reply; its text (logs, the
stall report) is ``{group}/{i}/{attempt}`` for a score, ``{group}/teacher/{attempt}``, ``{group}/{i}:env{t}/{attempt}``
and ``{group}/{i}:gen{t}/{attempt}`` for a multi-turn row's environment step and later turn
(orchestrator/trajectory.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cascade_rl.data.rows import Row
from cascade_rl.protocol.messages import Rollout, SamplingParams, Score, WorkKey, rollout_id

from .trajectory import Trajectory

# the reason of a group failed by a verifier that could not score (verifiers/errors.py): not the prompts' fault, so
# its replacements do not use up refill rounds (orchestrator/main.py sample_batch)
UNAVAILABLE = "verifier_unavailable"
AGENT = "agent"  # the env of rows a user's agent runs through the gateway (orchestrator/agents.py)


@dataclasses.dataclass
class Group:
    """One prompt and its n rollouts, from dispatch to training (or filtering)."""

    group_id: str
    row: Row
    prompt_ids: np.ndarray
    n: int
    sampling: SamplingParams
    min_version: int  # samplers serve it on weights of this version or newer
    train: bool  # False: an evaluation group (outside the books)
    step: int = -1  # the step whose batch it is sampled for (training groups)
    attempt: int = 0  # re-dispatches so far; replies of older attempts are duplicates
    worker: bytes | None = None  # the sampler that holds it
    rollouts: dict[int, Rollout] = dataclasses.field(default_factory=dict)
    scores: dict[int, Score] = dataclasses.field(default_factory=dict)
    error: str = ""  # "sampler_error: ..." or "teacher_error: ...": the group is filtered with it
    masked: bool = False  # trained with its loss masked (no rollout scored above orchestrator.mask_threshold)
    needs_teacher: bool = False  # MOPD: a training group needs its teacher's log-probs
    teacher: list[np.ndarray] | None = None  # per rollout, the teacher's log-prob of each response token
    env: str = ""  # multi-turn: the environment of its rows ("": single-turn)
    trajectories: dict[int, Trajectory] = dataclasses.field(default_factory=dict)  # multi-turn rows so far

    @property
    def complete(self) -> bool:
        return bool(self.error) or (len(self.scores) == self.n and (not self.needs_teacher or self.teacher is not None))

    def rollout_id(self, index: int) -> str:
        return rollout_id(self.group_id, index)

    def ids(self) -> list[str]:
        return [self.rollout_id(i) for i in range(self.n)]

    def sample_key(self) -> WorkKey:
        """The first turn of every row (its rollouts answer with their row index)."""
        return WorkKey.sample(self.group_id, self.attempt)

    def score_key(self, index: int) -> WorkKey:
        return WorkKey.score(self.group_id, index, self.attempt)

    def teacher_key(self) -> WorkKey:
        return WorkKey.teacher(self.group_id, self.attempt)

    def turn_key(self, index: int, kind: str, turn: int) -> WorkKey:
        """A multi-turn row's environment step (``kind`` "env") or next turn ("gen") after model turn ``turn``."""
        return WorkKey.step(self.group_id, index, kind, turn, self.attempt)

    def first_turns(self) -> int:
        """Rows whose first turn the sampler of the group sent (it holds the group until all have come)."""
        return len(self.trajectories) if self.env else len(self.rollouts)


def rewards(g: Group, overlong_penalty: bool) -> np.ndarray:
    """The rewards trained on: the verifiers' scores, 0 for a truncated response under ``overlong_penalty``."""
    r = np.array([g.scores[i].reward for i in range(g.n)], np.float32)
    if overlong_penalty:
        r[[g.rollouts[i].finish_reason == "length" for i in range(g.n)]] = 0.0
    return r


def filter_reason(g: Group, dynamic_filtering: bool, overlong_penalty: bool) -> str:
    """Why a complete group is not trained on ("" if it is): its error, or uniform rewards under dynamic
    filtering (DAPO: all right or all wrong, no signal; judged after the overlong penalty)."""
    if g.error:
        return g.error
    if dynamic_filtering:
        r = rewards(g, overlong_penalty)
        if np.all(r == r[0]):
            return "uniform_rewards"
    return ""


def staleness(g: Group, step: int) -> int:
    """How many versions behind the policy that trains ``step`` (version ``step``) its oldest rollout is."""
    return max(step - r.policy_version for r in g.rollouts.values())


def masked(g: Group, threshold: float | None, overlong_penalty: bool) -> bool:
    """Loss masking (agentless SWE RL): no rollout scored above ``threshold``."""
    return threshold is not None and bool(rewards(g, overlong_penalty).max() <= threshold)

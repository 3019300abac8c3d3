"""Every wire type of cascade-rl, each commented ``sender → receiver``.

Fields are the minimum of docs/ARCHITECTURE.md §3 plus what the implementation needs. Arrays
are declared with :func:`array` and travel in their own frames. ``validate``
returns a reason string for semantically impossible values (the codec turns it
into a ``ProtocolError``); checks that need model knowledge (vocabulary size,
context length) belong to the receiver.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

import numpy as np

from .codec import array, message, struct

# --------------------------------------------------------------------------- data plane


@struct
class SamplingParams:
    """How to sample one group (part of ``PromptRequest``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings; the response ends after one
    seed: int | None = None


def rollout_id(group: str, index: int) -> str:
    """The ledger's id of rollout ``index`` of ``group`` for its whole life, whichever attempt made it
    (``ledger.jsonl``, ``trained_ids.jsonl``, ``TrainBatch.ids``): ``{group}/{index}``."""
    return f"{group}/{index}"


@struct(frozen=True)
class WorkKey:
    """One item of work the orchestrator hands a verifier, a teacher or an environment, echoed in its reply
    (docs/ARCHITECTURE.md §3): what it is of which group, and the group's attempt (a reply to an older attempt is
    a duplicate). Built here, by kind; carried as a map, never as text to parse. ``str(key)`` is its name in
    logs and the stall report: ``{group}/{index}/{attempt}`` (score), ``{group}/teacher/{attempt}``,
    ``{group}/{index}:sample/{attempt}`` (a first turn), ``{group}/{index}:env{turn}/{attempt}`` and
    ``{group}/{index}:gen{turn}/{attempt}`` (multi-turn, §12), ``{group}/{index}:agent0/{attempt}`` (a user's agent
    running row ``index``, §14; its model calls are ``gen`` keys)."""

    group: str  # the group id (orchestrator/groups.py: s3g5, e2)
    kind: str  # one of KINDS
    index: int = 0  # the row of the group (teacher, and a group's sample request: 0, the request is the group's)
    turn: int = 0  # env: the step after model turn ``turn``; gen: the sampler's turn ``turn`` + 1; else 0
    attempt: int = 0  # the group's re-dispatches when it was handed out

    KINDS = ("sample", "score", "teacher", "env", "gen", "agent")  # a class constant, not a field
    SAMPLING = ("sample", "gen")  # the kinds of a PromptRequest and its Rollouts

    @classmethod
    def sample(cls, group: str, attempt: int) -> WorkKey:
        """The first turn of every row of a group (a ``PromptRequest`` of n); its rollouts answer with their row
        (``answer``)."""
        return cls(group, "sample", 0, 0, attempt)

    @classmethod
    def score(cls, group: str, index: int, attempt: int) -> WorkKey:
        """The score of rollout ``index`` (a verifier's ``ScoreRequest`` or one of a ``GroupScoreRequest``)."""
        return cls(group, "score", index, 0, attempt)

    @classmethod
    def teacher(cls, group: str, attempt: int) -> WorkKey:
        """The teacher's log-probs of the whole group (MOPD)."""
        return cls(group, "teacher", 0, 0, attempt)

    @classmethod
    def step(cls, group: str, index: int, kind: str, turn: int, attempt: int) -> WorkKey:
        """A multi-turn row's environment step (``kind`` "env") or next turn ("gen") after model turn ``turn``."""
        return cls(group, kind, index, turn, attempt)

    def answer(self, k: int) -> WorkKey:
        """The key of the ``k``-th rollout answering a ``PromptRequest`` of this key: a group's first turn answers
        with row ``k``, a multi-turn row's next turn (n is 1) with its own row."""
        return dataclasses.replace(self, index=k) if self.kind == "sample" else self

    @property
    def rollout_id(self) -> str:
        """The ledger's id of the rollout this work is for (a teacher's: the group's first)."""
        return rollout_id(self.group, self.index)

    def __str__(self) -> str:
        if self.kind == "teacher":
            return f"{self.group}/teacher/{self.attempt}"
        if self.kind == "score":
            return f"{self.group}/{self.index}/{self.attempt}"
        if self.kind == "sample":
            return f"{self.group}/{self.index}:sample/{self.attempt}"
        return f"{self.group}/{self.index}:{self.kind}{self.turn}/{self.attempt}"

    def validate(self) -> str:
        if not self.group:
            return "empty group id"
        if self.kind not in self.KINDS:
            return f"kind {self.kind!r} is none of {self.KINDS}"
        if min(self.index, self.turn, self.attempt) < 0:
            return f"negative index, turn or attempt in {self}"
        if self.kind in ("sample", "score", "teacher", "agent") and self.turn:
            return f"a {self.kind} key has no turn ({self.turn})"
        if self.kind == "teacher" and self.index:
            return f"a teacher key has no row index ({self.index})"
        return ""


@message("ready")
class Ready:
    """worker → orchestrator: I am up, on ``version``, with ``slots`` free work slots."""

    worker_id: str
    role: str  # sampler | verifier | trainer | teacher | environment
    slots: int
    version: int = 0
    domains: list[str] = field(default_factory=list)  # verifiers/teachers: domains served; environments: names
    draining: bool = False  # no more work for me: I finish what I hold, then exit (a swap retiring me)
    rank: int = 0  # a trainer: its rank among trainer.world_size (each rank is sent its own share of every batch)

    def validate(self) -> str:
        return "slots must be >= 0" if self.slots < 0 else "rank must be >= 0" if self.rank < 0 else ""


@message("prompt_request")
class PromptRequest:
    """orchestrator → sampler: sample ``n`` responses to one prompt."""

    key: WorkKey  # kind "sample": a group's first turn, n rows; kind "gen": continue row ``key.index`` of the group
    # (a multi-turn trajectory): n is 1, prompt_ids is the whole trajectory so far (docs/ARCHITECTURE.md §12)
    domain: str
    prompt_ids: np.ndarray = array("int32")
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_version: int = 0
    keep: bool = False  # multi-turn: the engine may keep each row's K/V for its next turn (prefix reuse)

    def validate(self) -> str:
        if self.key.kind not in WorkKey.SAMPLING:
            return f"a {self.key.kind} key asks for no sampling"
        return "a continuation (kind gen) samples n=1" if self.key.kind == "gen" and self.n != 1 else ""


@message("rollout")
class Rollout:
    """sampler → orchestrator: one sampled response, tagged with inference log-probs."""

    key: WorkKey  # its request's ``key.answer(k)``: the group, the row, the attempt and (multi-turn) the turn
    domain: str
    prompt_ids: np.ndarray = array("int32")
    response_ids: np.ndarray = array("int32")
    inf_logprobs: np.ndarray = array("float32")
    finish_reason: str = "stop"  # stop | length | error
    policy_version: int = 0
    sampler_id: str = ""
    t_gen: float = 0.0
    error: str = ""
    loss_mask: np.ndarray | None = array("bool", default=None)  # [R] True for model tokens; None: all are.
    # A multi-turn trajectory's observation tokens are False: no loss, no gradient, no mismatch metric
    routes: np.ndarray | None = array("int16", 3, default=None)  # [P + R - 1, MoE layers, top_k]: the experts the
    # engine chose for every token it ran (prompt, then response but the last); None: not asked for (R3)
    token_versions: np.ndarray | None = array("int32", default=None)  # [R] the policy version that sampled each
    # token (in-flight updates: a row can span versions); None: all are ``policy_version``
    segment_starts: np.ndarray | None = array("int32", default=None)  # positions in prompt + response where a new
    # segment begins (an agent that rewrote its history, §14): each segment is its own sequence in training

    def validate(self) -> str:
        if self.key.kind not in WorkKey.SAMPLING:
            return f"a {self.key.kind} key answers no sampling"
        if self.finish_reason not in ("stop", "length", "error"):
            return f"finish_reason {self.finish_reason!r}"
        if self.finish_reason != "error" and len(self.response_ids) != len(self.inf_logprobs):
            return f"{len(self.response_ids)} response ids but {len(self.inf_logprobs)} log-probs"
        ran = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routes is not None and self.finish_reason != "error" and len(self.routes) != ran:
            return f"routes for {len(self.routes)} tokens, but the engine ran {ran} (prompt + response - 1)"
        if self.routes is not None and self.routes.size and int(self.routes.min()) < 0:
            return "routes hold a negative expert id"
        if self.token_versions is not None and self.finish_reason != "error":
            if len(self.token_versions) != len(self.response_ids):
                return f"{len(self.response_ids)} response ids but {len(self.token_versions)} token versions"
            if len(self.token_versions) and int(self.token_versions.min()) != self.policy_version:
                return "policy_version must be the oldest token version"
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_ids):
            return f"{len(self.response_ids)} response ids but a loss mask of {len(self.loss_mask)}"
        if self.segment_starts is not None:
            total, starts = len(self.prompt_ids) + len(self.response_ids), self.segment_starts
            if len(starts) and (int(starts.min()) <= 0 or int(starts.max()) >= total or np.any(np.diff(starts) <= 0)):
                return f"segment starts {starts.tolist()} are not increasing positions inside 1..{total - 1}"
        return ""


@message("score_request")
class ScoreRequest:
    """orchestrator → verifier: score one response of ``domain``."""

    key: WorkKey
    domain: str
    text: str
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    deadline_s: float = 30.0

    def validate(self) -> str:
        return "" if math.isfinite(self.deadline_s) and self.deadline_s > 0 else f"deadline_s {self.deadline_s}"


@message("group_score_request")
class GroupScoreRequest:
    """orchestrator → verifier: score a group's responses together (pairwise judges: GenRM); one ``Score`` per
    key comes back, ``keys[i]`` for ``texts[i]``."""

    keys: list[WorkKey]
    domain: str
    prompt: str
    texts: list[str]
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    deadline_s: float = 60.0

    def validate(self) -> str:
        if not self.keys or len(self.keys) != len(self.texts):
            return f"{len(self.keys)} keys for {len(self.texts)} texts"
        return "" if math.isfinite(self.deadline_s) and self.deadline_s > 0 else f"deadline_s {self.deadline_s}"


@message("score")
class Score:
    """verifier → orchestrator: the reward of one response."""

    key: WorkKey
    reward: float
    ok: bool
    reason: str = ""
    t_verify: float = 0.0
    worker_id: str = ""
    unavailable: bool = False  # the verifier could not score at all (judge down, no sandbox): the group fails


@message("env_request")
class EnvRequest:
    """orchestrator → environment: the model's last turn of a multi-turn trajectory; run its tool calls.
    ``messages`` is the whole conversation so far (the row's prompt, then assistant and tool turns, the new
    assistant turn last, as text); ``state`` is what the environment returned last time for this trajectory
    (opaque to the orchestrator: any environment worker can serve any step)."""

    key: WorkKey  # kind "env": row ``index``'s step after model turn ``turn``
    env: str  # the environment's registered name
    domain: str
    messages: list[dict[str, Any]]
    state: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's
    deadline_s: float = 60.0  # the whole step (every tool call of the turn)

    def validate(self) -> str:
        if not self.messages or self.messages[-1].get("role") != "assistant":
            return "messages must end with the assistant turn to act on"
        return "" if math.isfinite(self.deadline_s) and self.deadline_s > 0 else f"deadline_s {self.deadline_s}"


@message("env_reply")
class EnvReply:
    """environment → orchestrator: the tool turn(s) that answer the assistant turn of ``key``, or ``done``: the
    turn made no tool call, the episode ends and its final turn is scored by the domain's verifier."""

    key: WorkKey
    done: bool
    tool_messages: list[dict[str, Any]] = field(default_factory=list)  # {"role": "tool", "content": ...}, in order
    state: dict[str, Any] = field(default_factory=dict)  # handed back with the next step of this trajectory
    tool_calls: int = 0
    tool_errors: int = 0  # calls that failed: a bad call, an exception, a crash, a timeout
    timeouts: int = 0  # calls killed at their deadline (counted in tool_errors too)
    ok: bool = True  # False: the environment could not act (unknown env, it raised): the trajectory fails
    error: str = ""
    worker_id: str = ""
    t_env: float = 0.0


@message("teacher_request")
class TeacherRequest:
    """orchestrator → teacher: the log-prob of every response token of one group under the teacher of
    ``domain`` (MOPD). The group's responses share the prompt; ``response_ids`` holds them back to back,
    response i being the next ``response_lens[i]`` tokens."""

    key: WorkKey
    domain: str
    prompt_ids: np.ndarray = array("int32")  # [P]
    response_ids: np.ndarray = array("int32")  # [sum(response_lens)] the responses, concatenated
    response_lens: np.ndarray = array("int32")  # [n] tokens of each response, each >= 1
    temperature: float = 1.0  # the sampling temperature: log-probs of softmax(logits / temperature)
    deadline_s: float = 60.0  # not started within this long of arriving: answered ok=False, not computed

    def validate(self) -> str:
        lens = self.response_lens
        if len(lens) == 0 or int(lens.min()) < 1:
            return "response_lens must hold at least one response, each of >= 1 token"
        if int(lens.sum(dtype=np.int64)) != len(self.response_ids):
            return f"response_lens sum to {int(lens.sum(dtype=np.int64))} but there are {len(self.response_ids)} ids"
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            return f"temperature {self.temperature}"
        return "" if math.isfinite(self.deadline_s) and self.deadline_s > 0 else f"deadline_s {self.deadline_s}"


@message("teacher_logprobs")
class TeacherLogprobs:
    """teacher → orchestrator: the teacher's log-prob of each response token of the group ``key``, in the
    request's order (``len(logprobs) == len(response_ids)``); empty when ``ok`` is False."""

    key: WorkKey
    logprobs: np.ndarray = array("float32")  # [sum(response_lens)]
    ok: bool = True
    error: str = ""  # why not ok: a token out of the vocabulary, too long, a domain not served, ...
    worker_id: str = ""
    t_teacher: float = 0.0  # seconds of the forward this group was part of (shared with its batch)


@message("train_batch")
class TrainBatch:
    """orchestrator → trainer: complete groups, rows ordered group by group, packed: every per-token array is the
    rows' tokens one after another ([T], T = sum(lengths)), no padding on the wire (protocol/rows.py: offsets,
    padding, building one from padded arrays)."""

    step: int
    group_size: int
    input_ids: np.ndarray = array("int32", 1)  # [T] each row's prompt + response tokens, row after row
    response_mask: np.ndarray = array("bool", 1)  # [T] True where input_ids[t] is a response token
    inf_logprobs: np.ndarray = array("float32", 1)  # [T] sampler log-prob of input_ids[t] (0 elsewhere)
    rewards: np.ndarray = array("float32", 1)  # [N]
    versions: np.ndarray = array("int32", 1)  # [N] policy version that sampled each row
    lengths: np.ndarray = array("int32", 1)  # [N] each row's tokens (>= 1; a row may end on context tokens)
    teacher_logprobs: np.ndarray | None = array("float32", 1, default=None)  # [T] for MOPD
    loss_masked: np.ndarray | None = array("bool", 1, default=None)  # [N] rows trained with no loss
    routes: np.ndarray | None = array("int16", 3, default=None)  # [T, MoE layers, top_k] the engine's experts of
    # input_ids[t] (-1: none, e.g. each row's last token); None: the rollouts carried none
    cursor: dict[str, int] = field(default_factory=dict)  # the orchestrator's data cursor, saved with checkpoints
    ids: list[str] = field(default_factory=list)  # [N] each row's rollout id (the ledger's; trained_ids.jsonl)
    segment_starts: np.ndarray | None = array("int32", 2, default=None)  # [N, S] where each row's later segments
    # begin, as positions in the row (-1: none); each segment is its own sequence, with its row's reward (§14)
    part: int = 0  # this batch's place among its step's parts (orchestrator.stream_tokens: groups as they are scored)
    last: bool = True  # the step's last part: the trainer updates the weights after it
    step_groups: int = 0  # groups in the whole step, every part together (0: this batch is the whole step)

    def validate(self) -> str:
        n, tokens = len(self.lengths), len(self.input_ids)
        if self.part < 0 or self.step_groups < 0:
            return f"part {self.part}, step_groups {self.step_groups}: neither may be negative"
        if self.step_groups and self.step_groups < n // max(1, self.group_size):
            return f"a part of {n // self.group_size} groups in a step of {self.step_groups}"
        if self.ids and len(self.ids) != n:
            return f"{len(self.ids)} rollout ids for {n} rows"
        if self.group_size <= 0 or n % self.group_size:
            return f"{n} rows is not a whole number of groups of {self.group_size}"
        if n and int(self.lengths.min()) < 1:
            return f"a row of {int(self.lengths.min())} tokens: every row holds at least one"
        if int(self.lengths.sum(dtype=np.int64)) != tokens:
            return f"lengths sum to {int(self.lengths.sum(dtype=np.int64))} but there are {tokens} tokens"
        for name in ("response_mask", "inf_logprobs", "teacher_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != (tokens,):
                return f"{name} shape {value.shape} != {(tokens,)}: one entry per token"
        if self.rewards.shape != (n,) or self.versions.shape != (n,):
            return "rewards/versions must have one entry per row"
        if self.loss_masked is not None and self.loss_masked.shape != (n,):
            return "loss_masked must have one entry per row"
        if self.routes is not None and self.routes.shape[0] != tokens:
            return f"routes for {self.routes.shape[0]} tokens, not {tokens} (+ layers, top_k)"
        if self.segment_starts is not None and (len(self.segment_starts) != n or (
                self.segment_starts.size and bool((self.segment_starts >= self.lengths[:, None]).any()))):
            return f"segment_starts shape {self.segment_starts.shape}: one row per row, each start inside its row"
        return ""


@message("step_done")
class StepDone:
    """trainer → orchestrator: optimizer step ``step`` finished; weights ``version`` are published."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str = ""  # HF directory written at this step, if any


# --------------------------------------------------------------------------- weights


@message("weights_ready")
class WeightsReady:
    """trainer → all (PUB; orchestrator re-sends to late samplers): new policy weights."""

    version: int
    uri: str
    format: str = "safetensors"
    nbytes: int = 0
    checksum: str = ""
    adapter: dict[str, Any] = field(default_factory=dict)  # a LoRA run: the file is adapter_model.safetensors and
    # this its adapter_config.json (weights/adapters.py); empty: full weights


@message("weights_get")
class WeightsGet:
    """sampler → trainer's stream ROUTER (``stream``, ``delta`` transports): send me chunk ``chunk`` of weights
    ``version``: its safetensors file (``part`` empty), or another payload the publisher serves with it (``part``
    ``delta``: the elements that changed since the version before, weights/delta.py)."""

    version: int
    chunk: int
    part: str = ""

    def validate(self) -> str:
        if len(self.part) > 32:
            return f"part name of {len(self.part)} characters"
        return "" if self.version >= 0 and self.chunk >= 0 else f"version {self.version}, chunk {self.chunk}"


@message("weights_chunk")
class WeightsChunk:
    """trainer's stream ROUTER → sampler: chunk ``chunk`` of the ``chunks`` of weights ``version``, a safetensors
    file of ``nbytes`` bytes whose checksum is ``checksum`` (weights/common.py); ``data`` is the chunk's bytes,
    ``[chunk * S, min((chunk + 1) * S, nbytes))`` for the publisher's chunk size ``S``."""

    version: int
    chunk: int
    chunks: int
    nbytes: int
    checksum: str
    data: np.ndarray = array("uint8")

    def validate(self) -> str:
        if self.version < 0 or self.nbytes < 0:
            return f"version {self.version}, nbytes {self.nbytes}"
        if not 0 <= self.chunk < self.chunks:
            return f"chunk {self.chunk} of {self.chunks}"
        if self.chunks > max(1, self.nbytes):  # every chunk but the only one of an empty file holds >= 1 byte
            return f"{self.chunks} chunks of a {self.nbytes}-byte file"
        if len(self.data) > self.nbytes:
            return f"{len(self.data)} bytes in one chunk of a {self.nbytes}-byte file"
        return ""


@message("weights_refused")
class WeightsRefused:
    """trainer's stream ROUTER → sampler: a ``WeightsGet`` not served (a version evicted or never published, a
    chunk out of range, a malformed request: ``version`` -1 when it could not be read), and why."""

    version: int
    reason: str

    def validate(self) -> str:
        return "" if self.version >= -1 else f"version {self.version}"


# --------------------------------------------------------------------------- control plane


@message("heartbeat")
class Heartbeat:
    """every worker → supervisor: liveness and counters."""

    role: str
    worker_id: str
    pid: int
    state: str
    version: int = 0
    counters: dict[str, Any] = field(default_factory=dict)


@message("control")
class Control:
    """CLI → supervisor: ``op`` is status | scale | swap | stop."""

    op: str
    args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> str:
        return "" if self.op in ("status", "scale", "swap", "stop") else f"unknown op {self.op!r}"


@message("control_reply")
class ControlReply:
    """supervisor → CLI."""

    ok: bool
    result: Any = None
    error: str = ""

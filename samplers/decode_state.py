"""The torch engine's decode state (samplers/torch_engine.py): sampling one token per row, the host's view of the
slots, the fixed device buffers a decode step (and its CUDA graph) reads and writes, and one ``generate`` call's
rows."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from .engine import GenerationRequest, Sample


def sample_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor, top_p_on: bool = True,
                  greedy_on: bool = True) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob, by inverse-CDF sampling at the uniforms ``u [B, 1]``. ``temperature
    == 0`` rows are greedy (log-prob at T=1). No device->host read (a CUDA graph captures it): the host says
    whether any row truncates to ``top_p`` (``top_p_on``) or is greedy (``greedy_on``); off skips that work."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if top_p_on:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # inverse-CDF sampling: one uniform per row (torch.multinomial draws one exponential per vocab entry,
    # 10x slower here); a zero-probability token never holds the first cdf value above u
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    if greedy_on:
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@dataclasses.dataclass
class Slots:
    """The host's view of the slots; slots 0..active-1 hold the running rows. The host knows all of it without
    reading the device: it admits the rows and reads each step's tokens."""

    row: np.ndarray  # row id (rows are the n samples of each request, in request order)
    pos: np.ndarray  # where the slot's next input token goes (= tokens in its KV cache)
    n_gen: np.ndarray  # tokens sampled so far
    max_tokens: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray

    @classmethod
    def empty(cls, n: int) -> Slots:
        return cls(*(np.zeros(n, np.int64) for _ in range(4)), np.ones(n, np.float32), np.ones(n, np.float32))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            t[dst] = t[src]


@dataclasses.dataclass
class StepBuffers:
    """What a decode step reads and writes on the device, allocated once with the KV cache (a CUDA graph
    replays on these very tensors): slot i's row is entry i of each."""

    last: Tensor  # long: the input token (the last sampled)
    pos: Tensor  # long: its position
    row: Tensor  # long: the slot's row (where its routes go)
    temperature: Tensor
    top_p: Tensor
    u: Tensor  # [slots, 1]: the step's uniforms, drawn before it (outside a graph: any generator works)
    next: Tensor  # long: the sampled token
    out: Tensor  # float64 [slots, 2]: sampled token and its log-prob, the step's one device->host read
    routes: Tensor | None  # long [slots, MoE layers, k]: the experts of the input token

    MOVED = ("last", "pos", "row", "temperature", "top_p")  # the per-slot state compaction moves

    @classmethod
    def empty(cls, n: int, device, route_shape: tuple[int, int] | None) -> StepBuffers:
        i, f = dict(dtype=torch.long, device=device), dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(n, **i), torch.zeros(n, **i), torch.zeros(n, **i), torch.ones(n, **f),
                   torch.ones(n, **f), torch.zeros(n, 1, **f), torch.zeros(n, **i),
                   torch.zeros(n, 2, dtype=torch.float64, device=device),
                   None if route_shape is None else torch.zeros(n, *route_shape, **i))

    def move(self, dst: Tensor, src: Tensor) -> None:
        for name in self.MOVED:
            t = getattr(self, name)
            t[dst] = t[src]

    def put(self, start: int, tokens: Tensor, logps: Tensor) -> None:
        """Sampled tokens and log-probs of slots ``start..``: the next step's input, the step's output."""
        end = start + len(tokens)
        self.next[start:end] = tokens
        self.out[start:end, 0] = tokens
        self.out[start:end, 1] = logps


@dataclasses.dataclass
class Run:
    """The state of one ``generate`` call; the sampled tokens and log-probs are on the host."""

    requests: list[GenerationRequest]
    row_request: list[int]  # request index of each row
    waiting: deque[int]  # rows not yet admitted
    slots: Slots
    tokens: np.ndarray  # [rows, max_tokens] int64 sampled tokens
    logps: np.ndarray  # [rows, max_tokens] float32 their log-probs
    versions: np.ndarray  # [rows, max_tokens] int32: the policy version that sampled each token
    length: list[int]
    finish: list[str]
    any_stop_strings: bool
    active: int = 0  # running slots: 0..active-1
    left: list[int] = dataclasses.field(default_factory=list)  # rows of each request still running
    first_row: list[int] = dataclasses.field(default_factory=list)  # each request's first row
    finished: list[int] = dataclasses.field(default_factory=list)  # requests whose rows all finished this step
    routes: Tensor | None = None  # [rows, prompt + max_tokens, MoE layers, k] int16 on the device, -1 unset
    admitted: np.ndarray | None = None  # [rows] int64: each row's admission order (a paged cache preempts the newest)
    admissions: int = 0
    resumed: dict[int, int] = dataclasses.field(default_factory=dict)  # preempted rows waiting: tokens sampled so far

    @classmethod
    def start(cls, requests: list[GenerationRequest], n_slots: int, device, route_shape: tuple[int, int] | None = None
              ) -> Run:
        """``route_shape`` (MoE layers, top_k): keep every row's experts, prompt and response."""
        row_request = [i for i, r in enumerate(requests) for _ in range(r.n)]
        n, width = len(row_request), max(r.max_tokens for r in requests)
        routes = None
        if route_shape is not None:
            total = max(len(r.prompt_ids) + r.max_tokens for r in requests)
            routes = torch.full((n, total, *route_shape), -1, dtype=torch.int16, device=device)
        return cls(requests, row_request, deque(range(n)), Slots.empty(n_slots), np.zeros((n, width), np.int64),
                   np.zeros((n, width), np.float32), np.zeros((n, width), np.int32), [0] * n, ["length"] * n,
                   any(r.stop for r in requests), left=[r.n for r in requests],
                   first_row=np.cumsum([0] + [r.n for r in requests[:-1]]).tolist(), routes=routes,
                   admitted=np.zeros(n, np.int64))

    def note_admitted(self, rows: list[int]) -> None:
        """Rows ``rows`` join the running ones now (a paged cache preempts the newest first)."""
        self.admitted[rows] = self.admissions + np.arange(len(rows))
        self.admissions += len(rows)

    def context(self, r: int) -> np.ndarray:
        """Row ``r``'s prompt and the tokens it sampled before it was preempted (its prompt if it never was)."""
        prompt = self.requests[self.row_request[r]].prompt_ids
        return np.concatenate([prompt, self.tokens[r, : self.resumed[r]].astype(np.int32)]) if r in self.resumed \
            else prompt

    def stop_hits(self, tokenizer) -> np.ndarray:
        """Running slots whose response text now ends in one of their stop strings."""
        s, b = self.slots, self.active
        hit = np.zeros(b, bool)
        for i, (r, n) in enumerate(zip(s.row[:b].tolist(), s.n_gen[:b].tolist())):
            stop = self.requests[self.row_request[r]].stop
            if stop:
                tail = tokenizer.decode(self.tokens[r, max(0, n - 16) : n].tolist())
                hit[i] = any(tail.endswith(x) for x in stop)
        return hit

    def samples(self, i: int, read: Callable[[Tensor], np.ndarray]) -> list[Sample]:
        """Request ``i``'s samples; ``read`` copies its rows' routes to the host (the engine's counted read)."""
        first = self.first_row[i]
        routes = None if self.routes is None else read(self.routes[first: first + self.requests[i].n])
        # a row's routes: every token the engine ran, the prompt's and the response's but the last
        ran = len(self.requests[i].prompt_ids) - 1
        return [Sample(self.tokens[r, : self.length[r]].astype(np.int32), self.logps[r, : self.length[r]].copy(),
                       self.finish[r], None if routes is None else routes[k, : ran + self.length[r]].copy(),
                       self.versions[r, : self.length[r]].copy())
                for k, r in enumerate(range(first, first + self.requests[i].n))]

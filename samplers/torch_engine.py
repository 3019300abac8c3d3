"""The built-in torch engine: continuous batching over a static or paged KV cache (and Mamba state cache).

    engine = TorchEngine("models/tiny", max_batch=256)
    groups = engine.generate(requests)          # n Samples per GenerationRequest, in request order
    python bench/sampler_throughput.py --quick  # tokens/s against transformers' generate and vLLM

What it serves (samplers/models.py, ``SERVED_MODEL_TYPES``: the model class by the checkpoint's ``model_type``):

- ``qwen3``, ``qwen3_moe``: samplers/torch_model.py (logits equal to transformers' to ~1e-6 in fp32), with the
  C++ CPU kernels in fp32 on CPU; its cache a ``KVCache`` (samplers/kv_cache.py).
- ``nemotron_h`` (Nemotron-H: Mamba-2, attention and MoE layers): samplers/nemotron_h_model.py (tests/
  test_nemotron_h_engine.py: logits, greedy tokens and log-probs against transformers in fp32), torch ops only
  (the C++ kernels know Qwen3 alone: ``cpu_kernels=True`` is refused with the reason); its cache a
  ``HybridCache`` (samplers/state_cache.py): K/V of the attention layers, conv windows and SSM states of the Mamba
  layers, prefilled, extended, saved, restored and compacted together, so everything below holds for it.

Another ``model_type`` (llama, qwen2, ...) is refused at construction, before any weight is read, with an
``UnservedModelError`` that says to sample with ``sampler.engine=vllm``.
``generate`` repeats one step until every row (n per request) is done:

- decode: one forward pass for the B running slots, each at its own position, attention masked to each slot's own
  length, and a token sampled for each (``_step``: a pure function of fixed buffers, no device->host read; on CUDA a
  CUDA graph replay, samplers/cuda_graphs.py).
- admit: waiting rows (FIFO) take the free slots of the ``max_batch`` decode slots. The rows of one request admitted
  together share one prefill: the prompt runs once and its K/V is written into each row's slot; the prompts admitted
  together prefill as one right-padded batch (``prefill_tokens`` caps its size); their first tokens are sampled from
  its logits.
- read the step's tokens and log-probs (the one device->host read of a step); a row is done on EOS, a stop string or
  ``max_tokens`` (checked on the host) and leaves its slot at once, so a waiting row joins at the next step.
- compact: the last running slots move into the holes (a copy of their K/V), so the running slots are always 0..B-1
  and a decode step reads views of the cache, never a gather of it.

Multi-turn rows (``GenerationRequest.prefix_keys``): a row that stops keeps its K/V (and Mamba state, taken at
the same point: O(1) in the length) under its key; its next turn, a request whose prompt extends the kept tokens,
restores it into its slot and prefills only the new tokens (the observation) with the cache's ``extend``.

``kv_cache="paged"`` (samplers/paged_kv.py): K/V in blocks of a pool of ``kv_cache_tokens`` tokens instead of
``max_len`` positions reserved for every slot; rows wait for blocks, and the newest are preempted and recomputed
when running rows need blocks none are free for (samplers/scheduler.py).

Log-probs are those of the sampled token under the temperature-scaled distribution before top-p truncation (what the
trainer recomputes at the same temperature); temperature 0 is greedy (log-prob at T=1). The response ends with its EOS.

Speed (bench/sampler_throughput.py, 2 CPU cores, fp32): 3.69x the tokens/s of transformers' ``generate`` at 64
sequences x 64 tokens, 5.06x at 32 prompts x 8 samples x 128 tokens. On CPU in fp32 the model runs the C++ kernels of
kernels/cpu_decode.cpp (a decode step is one op: ~1.7 ms at 64 rows on the tiny MoE, 0.4 ms at one row); elsewhere, or
with ``cpu_kernels=False``, torch ops (1.75x). MoE experts: ``choose_experts`` (samplers/torch_model.py), grouped on
CUDA in bf16 on sm_90 / sm_100. The tiny Nemotron-H, torch ops only: 1.58x ``generate``'s tokens/s at 16 prompts x 64
tokens (2 threads, best of 3; a one-off script, on a machine other jobs shared).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from ..kernels import cpu_decode
from ..protocol.devices import MODEL_LOADING, torch_dtype
from .adapter_merge import AdapterMerger
from .cuda_graphs import DecodeGraphs
from .decode_state import Run, StepBuffers, sample_tokens
from .engine import GenerationRequest, Sample, check_request, register_engine
from .kv_cache import KVCache
from .models import SERVED_MODEL_TYPES, eos_token_ids, model_class
from .paged_kv import PagedKVCache
from .prefix_cache import Kept, PrefixCache
from .scheduler import admissible, preempt
from .state_cache import HybridCache
from .torch_model import choose_experts

INFLIGHT_KV = ("recompute", "keep")  # TorchEngine(inflight_kv=): the running rows' K/V when weights change mid-generation
KV_CACHES = ("static", "paged")  # TorchEngine(kv_cache=): slots x max length reserved, or blocks of a shared pool
PAGED_NO_CPU_KERNELS = "kernels/cpu_decode.cpp reads the static KV cache's layout: kv_cache='paged' runs torch ops"


@register_engine("torch")
class TorchEngine:
    served_model_types = SERVED_MODEL_TYPES  # HF model_types it samples; __init__ refuses the others
    gpu_memory = "torch"  # on a GPU, gpus.memory.sampler caps this process's torch allocator (samplers/engine.py)

    @classmethod
    def from_config(cls, cfg, device: torch.device, url: str = "") -> TorchEngine:
        """The run's model in ``model.dtype`` on the sampler's ``device``."""
        s = cfg.sampler
        return cls(cfg.model.path, dtype=cfg.model.dtype, device=str(device), return_routes=s.return_routes,
                   inflight_kv=s.inflight_kv, cuda_graphs=s.cuda_graphs, kv_cache=s.kv_cache,
                   kv_cache_tokens=s.kv_cache_tokens, kv_block_size=s.kv_block_size)

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", max_batch: int = 256,
                 prefill_tokens: int = 8192, moe_impl: str | None = None, ignore_eos: bool = False,
                 cpu_kernels: bool | None = None, prefix_cache_tokens: int = 1 << 18, return_routes: bool = False,
                 inflight_kv: str = "recompute", cuda_graphs: bool = True, kv_cache: str = "static",
                 kv_cache_tokens: int = 1 << 18, kv_block_size: int = 16) -> None:
        """``max_batch``: decode slots (rows sampled at once); ``prefill_tokens``: most padded prompt tokens in one
        prefill pass; ``moe_impl``: one of kernels/moe.py's ``EXPERTS`` without the C++ kernels, by default
        ``choose_experts``'s pick for the device and dtype (grouped on CPU and on CUDA in bf16 on sm_90 / sm_100,
        dense elsewhere on CUDA); ``ignore_eos``: rows run to ``max_tokens`` (benchmarks); ``cpu_kernels``: the C++
        kernels (kernels/cpu_decode.cpp: MoE, RMS norm, decode attention), by default on for fp32 on CPU when they
        build; ``prefix_cache_tokens``: most tokens of multi-turn rows' K/V kept between their turns (0: none kept,
        every turn prefills its whole trajectory); ``return_routes``: each sample carries the experts every MoE
        layer chose for each of its tokens (``Sample.routes``; routing replay); ``inflight_kv``: what the rows
        running when new weights arrive mid-generation do with their K/V (``generate(between=)``): ``recompute`` it
        under the new weights (each token's log-prob is then exactly its version's) or ``keep`` it (no prefill; the
        tokens after the update attend to K/V of the old weights); ``cuda_graphs``: on CUDA, each decode step
        replays a CUDA graph (samplers/cuda_graphs.py; eager if a capture fails); ``kv_cache``: ``static`` (every
        slot reserves the call's longest prompt + max_tokens) or ``paged`` (blocks of ``kv_block_size`` tokens from
        a pool of ``kv_cache_tokens``, allocated at the first call; torch ops only, since the C++ decode op reads
        the static layout, and no CUDA graphs, since a step's shapes follow the blocks in flight)."""
        # here, not at the top: the supervisor imports this module for its registry entry, and transformers' auto
        # classes cost a process ~3 s of CPU to import
        from transformers import AutoConfig, AutoTokenizer

        if inflight_kv not in INFLIGHT_KV:
            raise ValueError(f"inflight_kv={inflight_kv!r}: choose one of {INFLIGHT_KV}")
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={kv_cache!r}: choose one of {KV_CACHES}")
        self.inflight_kv, self.paged, self.kv_block_size = inflight_kv, kv_cache == "paged", kv_block_size
        self.kv_blocks = kv_cache_tokens // kv_block_size + 1  # paged: the pool, its scratch block included
        self.device, self.dtype = torch.device(device), torch_dtype(dtype)
        # the model's class by its model_type (samplers/models.py): an unserved one is refused before any weight is read
        model_cls = model_class(AutoConfig.from_pretrained(model_path).model_type)
        # why the C++ kernels cannot run this model ('' if they can): then they stay off, and asking for them fails
        self.cpu_kernels_off = model_cls.cpu_kernels_refusal or (PAGED_NO_CPU_KERNELS if self.paged else "")
        fits = self.device.type == "cpu" and self.dtype == torch.float32
        if cpu_kernels and self.cpu_kernels_off:
            raise ValueError(f"cpu_kernels=True: {self.cpu_kernels_off}")
        if cpu_kernels and not fits:
            raise ValueError("cpu_kernels=True needs device=cpu and dtype=float32")
        if cpu_kernels and not cpu_decode.available():
            raise RuntimeError(f"cpu_kernels=True but the C++ kernels did not build: {cpu_decode.build_error()}")
        if cpu_kernels is None:
            cpu_kernels = fits and not self.cpu_kernels_off and cpu_decode.available()
        self.cpu_kernels = cpu_kernels
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        self.experts = choose_experts(self.device.type, self.dtype, capability, self.cpu_kernels, moe_impl)
        with MODEL_LOADING:  # built on the meta device: one load at a time in a process (launch --inline)
            self.model = model_cls.from_pretrained(model_path, self.dtype, self.device,
                                                   moe_impl="grouped" if self.experts == "cpu" else self.experts)
        if self.cpu_kernels:
            self.model.use_cpu_kernels()
        a = self.model.args
        self.route_shape = (len(a.moe_layers), a.top_k) if return_routes and a.moe_layers else None
        self.model.record_routes(self.route_shape is not None)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = eos_token_ids(model_path, self.tokenizer)
        self.eos_ids = torch.tensor(eos, device=self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        self.vocab_size = self.model.args.vocab_size
        self.max_context = self.model.args.max_position_embeddings
        self.max_batch, self.prefill_tokens, self.ignore_eos = max_batch, prefill_tokens, ignore_eos
        self.use_graphs = cuda_graphs and self.device.type == "cuda" and not self.paged
        self.cache: KVCache | PagedKVCache | HybridCache | None = None  # the model's new_cache
        self.buf: StepBuffers | None = None  # with the cache
        self.graphs: DecodeGraphs | None = None  # with the cache, on CUDA
        self.version = 0
        self.adapters = AdapterMerger()  # load_adapter: a LoRA run's versions, merged over the base's weights
        # prefix_hits, prefix_tokens_reused, inflight_recomputed_tokens; steps, decode_steps and host_reads (every
        # device->host read of generate, through _read: one a step); paged: kv_waits (admissions stopped for want
        # of blocks), kv_preempted (rows), kv_peak_blocks
        self.counters = Counter()
        # multi-turn rows' K/V (and Mamba states) between their turns (GenerationRequest.prefix_keys)
        self.prefixes = PrefixCache(prefix_cache_tokens, self.counters)

    @property
    def eos_ids(self) -> Tensor:
        """The EOS token ids (a tensor on the device); the stop checks use their host copy."""
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: Tensor) -> None:
        self._eos_ids, self.eos_host = ids, ids.cpu().numpy().astype(np.int64)

    def check(self, request: GenerationRequest) -> str:
        need, pool = len(request.prompt_ids) + request.max_tokens, (self.kv_blocks - 1) * self.kv_block_size
        if self.paged and need > pool and not check_request(request, self.vocab_size, self.max_context):
            return f"prompt + max_tokens ({need}) exceed the paged KV cache ({pool}): raise sampler.kv_cache_tokens"
        return check_request(request, self.vocab_size, self.max_context)

    def load_weights(self, path: str, version: int) -> None:
        self.load_tensors(load_file(path, device=str(self.device)), version)

    def load_tensors(self, tensors: dict[str, Tensor], version: int) -> None:
        """Apply weights given as tensors in HF names (``cuda_ipc``: views of the trainer's GPU buffer, which it
        reuses later): copied into this model's parameters (in place: captured decode graphs stay valid),
        nothing kept of them."""
        self.model.load_hf_state_dict(tensors)
        self.adapters.reset()  # new full weights: a later adapter applies over them
        self.version = version
        self.prefixes.clear()  # K/V computed by the old weights

    def load_adapter(self, path: str, version: int, config: dict) -> None:
        """A LoRA run's version (peft's adapter file at ``path``, its config ``config``): merged from the base's
        weights (samplers/adapter_merge.py), then as ``load_tensors``: in place, version set, kept K/V dropped."""
        self.adapters.apply(self.model, load_file(path, device=str(self.device)), config)
        self.version = version
        self.prefixes.clear()

    streams_groups = True  # generate(..., on_done=) reports each request as soon as its rows are done
    inflight_updates = True  # generate(..., between=) may load new weights between decode steps

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest],
                 on_done: Callable[[int, list[Sample]], None] | None = None,
                 between: Callable[[], None] | None = None) -> list[list[Sample]]:
        """``n`` samples for each request, in request order; ``on_done(i, samples)`` is called as soon as
        request i's rows have all finished (the caller can pass them on while the others still run).
        ``between()`` is called between decode steps: it may load new weights (``load_tensors`` /
        ``load_weights``); the rows keep generating, each token tagged with the version that sampled it
        (``Sample.versions``), their K/V recomputed or kept (``inflight_kv``)."""
        if not requests:
            return []
        for r in requests:
            if reason := self.check(r):
                raise ValueError(f"request {r.key}: {reason}")
        self._ensure_cache(sum(r.n for r in requests), max(len(r.prompt_ids) + r.max_tokens for r in requests))
        run = Run.start(requests, self.cache.slots, self.device, self.route_shape)
        seeds = [r.seed for r in requests if r.seed is not None]
        generator = torch.Generator(self.device).manual_seed(hash(tuple(seeds)) & 0xFFFFFFFF) if seeds else None
        while True:
            if run.active and self.paged and (out := preempt(run, self.cache, self.counters)) is not None:
                self._retire(run, out)  # paged: rows preempted so that the others' next tokens have blocks
            if run.active:  # rows with a token to feed: one decode step for them, then new rows join
                self._decode(run, generator)
            if run.waiting and run.active < self.cache.slots:
                self._admit(run, generator)
            if run.active == 0:
                break
            step = self._read(self.buf.out[: run.active])  # the step's one device->host read
            self.counters["steps"] += 1
            done = self._record(run, step[:, 0].astype(np.int64), step[:, 1].astype(np.float32))
            if done.any():
                self._retire(run, done)
                if on_done is not None:
                    for i in run.finished:
                        on_done(i, run.samples(i, self._read))
                run.finished.clear()
            if between is not None and run.active:
                version = self.version
                between()
                if self.version != version and self.inflight_kv == "recompute":
                    self._recompute(run)
        return [run.samples(i, self._read) for i in range(len(run.requests))]

    def _read(self, t: Tensor) -> np.ndarray:
        """A copy of ``t`` on the host. Every device->host read of ``generate`` goes through here and is
        counted (``counters["host_reads"]``; tests/test_torch_engine.py checks one a step): on a GPU each is a
        sync, the step's launches wait for it."""
        self.counters["host_reads"] += 1
        return t.to("cpu", copy=True).numpy()

    def _to_device(self, values) -> Tensor:
        """Host numbers (ints: int64) on the device: a host->device copy, not a read (pinned and asynchronous on
        CUDA, so the host does not wait for the queued steps)."""
        t = torch.from_numpy(np.asarray(values) if not isinstance(values, list) else np.asarray(values, np.int64))
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    # --- one step's parts ---

    def _decode(self, run: Run, generator: torch.Generator | None) -> None:
        """One decode step for the running slots 0..active-1: their tokens and log-probs into ``buf.out``, their
        next input into ``buf.last``. The step itself (``_step``) is a graph replay on CUDA."""
        s, d, b = run.slots, self.buf, run.active
        kv_len = int(s.pos[:b].max()) + 1
        top_p_on, greedy_on = bool((s.top_p[:b] < 1.0).any()), bool((s.temperature[:b] <= 0).any())
        n = b
        if self.graphs is not None and self.graphs.enabled:
            n, kv_len = self.graphs.shape(b, kv_len)
        d.u[:n].uniform_(generator=generator)
        self.cache.plan_decode(s.pos[:b])  # paged: the blocks the step reads (host bookkeeping)
        if self.graphs is None or not self.graphs.replay((n, kv_len, top_p_on, greedy_on)):
            self._step(b, kv_len, top_p_on, greedy_on)
        d.last[:b] = d.next[:b]
        if run.routes is not None:  # the experts of each slot's input token, at its position
            run.routes[d.row[:b], d.pos[:b]] = d.routes[:b].to(torch.int16)
        d.pos[:b] += 1
        s.pos[:b] += 1
        self.counters["decode_steps"] += 1

    def _step(self, n: int, kv_len: int, top_p_on: bool, greedy_on: bool) -> None:
        """The decode step of slots 0..n-1 as a pure function of ``buf`` (and the cache and weights): reads
        ``last``, ``pos``, the sampling parameters and ``u``, writes the slots' K/V at ``pos``, ``next``, ``out``
        and ``routes``. No device->host read and static shapes: CUDA graphs capture it; run twice it writes the
        same, so their warm-up changes nothing."""
        d = self.buf
        logits = self.model.decode(d.last[:n], d.pos[:n], self.cache, kv_len).float()
        d.put(0, *sample_tokens(logits, d.temperature[:n], d.top_p[:n], d.u[:n], top_p_on, greedy_on))
        if d.routes is not None:
            d.routes[:n] = self.model.last_routes()[:, 0]

    def _admit(self, run: Run, generator: torch.Generator | None) -> None:
        """Move waiting rows into free slots (samplers/scheduler.py); prefill their prompts, once per request (a
        preempted row: its prompt and the tokens it sampled); sample their next tokens into ``buf``."""
        take = admissible(run, self.cache, self.paged, self.counters)
        if not take:  # paged: the head waits for blocks
            return
        k = next((j for j, r in enumerate(take) if r not in run.resumed), len(take))  # preempted rows come first
        contexts = [run.context(r) for r in take[:k]]
        reqs = [run.requests[run.row_request[r]] for r in take]
        s, d, a, b = run.slots, self.buf, run.active, run.active + len(take)
        s.row[a:b] = take
        s.pos[a:b] = [len(c) for c in contexts] + [len(q.prompt_ids) for q in reqs[k:]]
        s.n_gen[a:b] = [run.resumed.pop(r) for r in take[:k]] + [0] * (len(take) - k)
        s.max_tokens[a:b] = [q.max_tokens for q in reqs]
        s.temperature[a:b] = [q.temperature for q in reqs]
        s.top_p[a:b] = [q.top_p for q in reqs]
        d.row[a:b], d.pos[a:b] = self._to_device(s.row[a:b]), self._to_device(s.pos[a:b])
        d.temperature[a:b], d.top_p[a:b] = self._to_device(s.temperature[a:b]), self._to_device(s.top_p[a:b])
        run.note_admitted(take)
        for slot in range(a, b) if self.paged else ():  # blocks for what the prefill writes (admissible counted)
            self.cache.grow(slot, int(s.pos[slot]), strict=True)
        run.active = b
        parts = []
        if k:
            routes: list[Tensor] | None = [] if run.routes is not None else None
            parts.append(self._prefill(contexts, np.arange(a, a + k), np.arange(k), routes))
            for r, x in zip(take[:k], routes or ()):  # the last sampled token's (the others ran before)
                run.routes[r, len(x) - 1] = x[-1]
        if k < len(take):
            parts.append(self._admitted_logits(run, take[k:], a + k))
        logits = torch.cat(parts)
        d.u[a:b].uniform_(generator=generator)
        d.put(a, *sample_tokens(logits, d.temperature[a:b], d.top_p[a:b], d.u[a:b],
                                bool((s.top_p[a:b] < 1.0).any()), bool((s.temperature[a:b] <= 0).any())))
        d.last[a:b] = d.next[a:b]

    def _admitted_logits(self, run: Run, take: list[int], a: int) -> Tensor:
        """The first logits of rows ``take`` (now in slots a..): their prompts prefilled, or only what follows
        their kept K/V."""
        groups, src = [], []  # rows are in request order: one request's admitted rows are adjacent
        for r in take:
            if not groups or groups[-1] != run.row_request[r]:
                groups.append(run.row_request[r])
            src.append(len(groups) - 1)
        reqs = [run.requests[run.row_request[r]] for r in take]
        kept = {j: hit for j, r in enumerate(take) if (hit := self._kept_prefix(run, r)) is not None}
        routes: list[Tensor] | None = [] if run.routes is not None else None  # each prefilled prompt's
        if not kept:
            logits = self._prefill([run.requests[g].prompt_ids for g in groups], np.arange(a, a + len(take)),
                                   np.array(src), routes)[self._to_device(src)]
            for j, r in enumerate(take) if routes is not None else ():
                run.routes[r, : len(routes[src[j]])] = routes[src[j]]
            return logits
        # rows whose earlier turns' K/V is kept prefill only what follows it; the others as usual
        logits = torch.empty((len(take), self.vocab_size), device=self.device)
        fresh = [j for j in range(len(take)) if j not in kept]
        if fresh:
            order = list(dict.fromkeys(src[j] for j in fresh))
            src_f = np.array([order.index(src[j]) for j in fresh])
            logits[self._to_device(fresh)] = self._prefill([run.requests[groups[g]].prompt_ids for g in order],
                                                       a + np.array(fresh), src_f, routes)[self._to_device(src_f)]
            for j in fresh if routes is not None else ():
                r = routes[order.index(src[j])]
                run.routes[take[j], : len(r)] = r
        rows = list(kept)
        for j in rows:
            self.cache.restore(a + j, kept[j][1])
        logits[self._to_device(rows)] = self._extend([reqs[j].prompt_ids[len(kept[j][0]):] for j in rows],
                                                 [a + j for j in rows], [len(kept[j][0]) for j in rows])
        if run.routes is not None:  # the kept turns' routes, then the new tokens'
            extended = self.model.last_routes()
            for i, j in enumerate(rows):
                done, total = len(kept[j][0]), len(reqs[j].prompt_ids)
                if kept[j][2] is not None:
                    run.routes[take[j], :done] = kept[j][2]
                run.routes[take[j], done:total] = extended[i, : total - done].to(torch.int16)
        return logits

    # --- multi-turn: K/V kept across calls ---

    def _kept_prefix(self, run: Run, r: int) -> Kept | None:
        """The kept K/V of row ``r``'s earlier turns, if its request names it and its prompt extends them."""
        req = run.requests[run.row_request[r]]
        if not req.prefix_keys:
            return None
        return self.prefixes.take(req.prefix_keys[r - run.first_row[run.row_request[r]]], req.prompt_ids)

    def _keep(self, run: Run, slot: int, r: int) -> None:
        """Row ``r`` stopped in ``slot``: keep its K/V under its key for its next turn."""
        req = run.requests[run.row_request[r]]
        if not req.prefix_keys or not self.prefixes.max_tokens:
            return
        n = int(run.slots.pos[slot])  # in the cache: the prompt and every sampled token but the last
        ids = np.concatenate([req.prompt_ids, run.tokens[r, : n - len(req.prompt_ids)].astype(np.int32)])
        key = req.prefix_keys[r - run.first_row[run.row_request[r]]]
        routes = None if run.routes is None else run.routes[r, :n].clone()
        self.prefixes.put(key, ids, self.cache.save(slot, n), routes)

    def _extend(self, suffixes: list[np.ndarray], slots: list[int], starts: list[int]) -> Tensor:
        """Last-position logits of continuations whose slots already hold ``starts`` tokens."""
        width = max(len(x) for x in suffixes)
        tokens = torch.full((len(suffixes), width), self.pad_id, dtype=torch.long)
        for i, x in enumerate(suffixes):
            tokens[i, : len(x)] = torch.from_numpy(x.astype(np.int64))
        # a short suffix padded to the longest may run past the context: its padding's positions are clamped (its
        # outputs are never read, and the cache clamps the same way)
        starts_t = self._to_device(starts)
        positions = (starts_t[:, None] + torch.arange(width, device=self.device)).clamp_(max=self.max_context - 1)
        kv_len = min(max(starts) + width, self.cache.max_len)
        attend = self.cache.extend(self._to_device(slots), starts_t, kv_len)
        logits = self.model(tokens.to(self.device), positions, attend,
                            last=self._to_device([len(x) - 1 for x in suffixes]))
        return logits.float()

    def _prefill(self, prompts: list[np.ndarray], slots: np.ndarray, src: np.ndarray,
                 routes: list[Tensor] | None = None) -> Tensor:
        """Last-position logits of each prompt; slot ``slots[j]`` gets the K/V of prompt ``src[j]``. ``routes``:
        each prompt's experts [P, MoE layers, k] are appended to it."""
        out, g0 = [], 0
        while g0 < len(prompts):  # chunks of at most prefill_tokens padded tokens (and at least one prompt)
            g1, width = g0 + 1, len(prompts[g0])
            while g1 < len(prompts) and (g1 + 1 - g0) * max(width, len(prompts[g1])) <= self.prefill_tokens:
                width, g1 = max(width, len(prompts[g1])), g1 + 1
            tokens = torch.full((g1 - g0, width), self.pad_id, dtype=torch.long)
            for i, p in enumerate(prompts[g0:g1]):
                tokens[i, : len(p)] = torch.from_numpy(p.astype(np.int64))
            last = self._to_device([len(p) - 1 for p in prompts[g0:g1]])
            sel = (src >= g0) & (src < g1)
            positions = torch.arange(width, device=self.device).expand(g1 - g0, -1)
            attend = self.cache.prefill(self._to_device(slots[sel]), self._to_device(src[sel] - g0))
            out.append(self.model(tokens.to(self.device), positions, attend, last=last).float())
            if routes is not None:
                chunk = self.model.last_routes().to(torch.int16)
                routes.extend(chunk[i, : len(p)] for i, p in enumerate(prompts[g0:g1]))
            g0 = g1
        return torch.cat(out)

    def _record(self, run: Run, tokens: np.ndarray, logps: np.ndarray) -> np.ndarray:
        """Store the step's sampled tokens (host); which running slots are now done (finish reasons noted)."""
        s, b = run.slots, run.active
        rows, n = s.row[:b], s.n_gen[:b]
        run.tokens[rows, n] = tokens
        run.logps[rows, n] = logps
        run.versions[rows, n] = self.version  # the version whose forward gave these logits
        n += 1  # in place: s.n_gen
        stopped = np.isin(tokens, self.eos_host) if not self.ignore_eos else np.zeros(b, bool)
        if run.any_stop_strings:
            stopped |= run.stop_hits(self.tokenizer)
        done = stopped | (n >= s.max_tokens[:b])
        for slot in np.flatnonzero(done).tolist():
            r, stop = int(rows[slot]), bool(stopped[slot])
            run.length[r], run.finish[r] = int(n[slot]), "stop" if stop else "length"
            if stop:
                self._keep(run, slot, r)
            i = run.row_request[r]
            run.left[i] -= 1
            if run.left[i] == 0:
                run.finished.append(i)
        return done

    def _retire(self, run: Run, done: np.ndarray) -> None:
        """Free the done slots; the last running slots move into the holes so that 0..active-1 run."""
        s, keep = run.slots, ~done
        self.cache.release(np.flatnonzero(done).tolist())  # paged: their blocks back to the pool
        n_keep = int(keep.sum())
        holes = np.flatnonzero(~keep[:n_keep])
        if holes.size:
            movers = np.flatnonzero(keep[n_keep:]) + n_keep
            dst, src = self._to_device(holes), self._to_device(movers)
            self.cache.move(dst, src, int(s.pos[movers].max()), (holes, movers))
            s.move(holes, movers)
            self.buf.move(dst, src)
        run.active = n_keep

    def _recompute(self, run: Run) -> None:
        """New weights mid-generation: every running slot's K/V prefilled again under them (its prompt and the
        tokens sampled so far but the last, which the next decode step feeds)."""
        s, b = run.slots, run.active
        contexts = []
        for r, n in zip(s.row[:b].tolist(), s.n_gen[:b].tolist()):
            prompt = run.requests[run.row_request[r]].prompt_ids
            contexts.append(np.concatenate([prompt, run.tokens[r, : n - 1].astype(np.int32)]))
        self._prefill(contexts, np.arange(b), np.arange(b))
        self.counters["inflight_recomputed_tokens"] += sum(len(c) for c in contexts)

    # --- set-up and results ---

    def _ensure_cache(self, rows: int, length: int) -> None:
        """A cache with enough slots (up to ``max_batch``) and positions, and the decode step's buffers and
        graphs over it; grown, never shrunk."""
        slots, old = min(self.max_batch, rows), self.cache
        length = self.max_context if self.paged else length  # paged: any slot may hold up to the whole context
        if old is not None and old.slots >= slots and old.max_len >= length:
            return
        if old is not None:
            slots, length = max(slots, old.slots), max(length, old.max_len)
        length = min(-(-length // 128) * 128, self.max_context)
        self.cache = self.buf = self.graphs = None  # free the old ones first (the graphs hold the old cache)
        kv = (functools.partial(PagedKVCache, blocks=self.kv_blocks, block_size=self.kv_block_size) if self.paged
              else KVCache)
        self.cache = self.model.new_cache(slots, length, self.dtype, self.device, kv)
        self.buf = StepBuffers.empty(slots, self.device, self.route_shape)
        if self.use_graphs:
            self.graphs = DecodeGraphs(self._step, slots, length, self.device)

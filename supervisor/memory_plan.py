"""The memory plan: expected peak memory per role and per GPU, as terms, from a model's shape and the launch's
settings. Pure rules (no config, no files, no torch): supervisor/memory_report.py reads the config and prints.

    terms = trainer_terms(shape, TrainerSettings(...))     # [Term(name, bytes, formula)], summed per GPU
    advice = advise_trainer(shape, settings, budget)       # the settings to change when the sum does not fit

Units: bytes; P parameters, b the model dtype's bytes (bf16 2, fp32 4), h hidden, V vocabulary, T tokens a rank
holds in one micro-batch (whole groups: G rows of prompt + response each, divided by context parallelism).

Activations are what autograd keeps for the backward, per token, counted from the layers' code (transformers'
Qwen3-MoE, Nemotron-H; our grouped experts, modeling/mamba.py's torch scan) and checked against torch's
allocator on real steps (tests/test_memory_plan.py) and bench/lengths.py's RSS (bench/_plan_vs_lengths.py):
- every part's pre-norm keeps its input upcast to fp32 and its output: (4 + b)·h (Nemotron-H: 8·h, its output
  fp32 too), plus b·h of the part's input
- attention: b·(2q + 2kv) (SDPA/flash's q, k, v, out) + 4·heads (log-sum-exp); Qwen3's q/k norms (4 + b)·(q + kv)
- MLP: b·(gated ? 4 : 2)·I; MoE: b·(2k·h + (gated ? 4 : 2)·(k·I_e + I_shared)) + the k outputs before their sum
  (b·k·h; Nemotron-H fp32: 4·k·h) + the router's few floats
- Mamba-2 (modeling/mamba.py's chunked scan with seq_idx, fp32 inside whatever b): 4·(3·heads·Q + 5·heads·N +
  2·heads·P·N/Q + 12.5·d_inner) + b·5·conv_dim, Q the chunk, N the state, P the head dim
Kept: T × Σ layers. Checkpointed (trainer.activation_checkpointing): T × (layers × b·h + the largest layer), the
one layer being recomputed. Where the estimate is off and by how much: BENCHMARKS.md, "cascade-rl plan".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .memory_shapes import ModelShape

GiB = 2**30
RUNTIME = 1.0 * GiB  # per GPU process: the CUDA context, NCCL buffers, the caching allocator's slack


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str


@dataclass
class RolePlan:
    role: str
    gpus: int
    """GPUs the role's processes take (the trainer's ranks, one per sampler or teacher)."""
    budget: float
    """Bytes one of its processes may use on its GPU."""
    terms: list[Term]
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


# --- activations per token -----------------------------------------------------------------------------------


def part_activation(shape: ModelShape, part: str, b: int) -> float:
    """Bytes per token one part (its pre-norm included) keeps for the backward."""
    h, hybrid = shape.hidden, shape.model_type == "nemotron_h"
    norm = (8 if hybrid else 4 + b) * h + b * h  # Nemotron-H's RMSNorm keeps its output in fp32 too
    if part == "attention":
        qk_norm = (4 + b) * (shape.q + shape.kv) if shape.qk_norm else 0
        return norm + qk_norm + b * (2 * shape.q + 2 * shape.kv) + 4 * shape.heads
    width = 4 if shape.gated else 2
    if part == "mlp":
        return norm + b * width * shape.intermediate
    if part == "moe":
        k = shape.top_k
        router = 4 * (2 * shape.experts + 6 * k)
        # the k expert outputs before their weighted sum: fp32 under Nemotron-H's sigmoid router (and h more)
        combine = (4 * k * h + (4 * h if b < 4 else 0)) if hybrid else b * k * h
        return (norm + b * (2 * k * h + width * (k * shape.expert_intermediate + shape.shared_intermediate))
                + combine + router)
    if part == "mamba":  # modeling/mamba.py's scan with seq_idx (the packed layouts), fp32 inside
        nh, q, n, p = shape.mamba_heads, shape.chunk, shape.ssm_state, shape.mamba_head_dim
        scan = 3 * nh * q + 5 * nh * n + 2 * nh * p * n / q + 12.5 * shape.d_inner
        return norm + 4 * scan + b * 5 * shape.conv_dim
    raise ValueError(f"unknown layer part {part!r}")


def layer_activation(shape: ModelShape, layer: tuple[str, ...], b: int) -> float:
    return sum(part_activation(shape, p, b) for p in layer)


def head_activation(shape: ModelShape, b: int) -> float:
    """Per token outside the layers: the final norm, the hidden states the log-probs read, the embedding's output."""
    return (4 + b) * shape.hidden + b * shape.hidden + 64


def activation_per_token(shape: ModelShape, b: int, checkpointing: bool) -> float:
    """Bytes per token a forward keeps for its backward (checkpointed: each layer's input, and the largest
    layer's intermediates while it is recomputed)."""
    layers = [layer_activation(shape, layer, b) for layer in shape.layers]
    kept = len(layers) * b * shape.hidden + max(layers) if checkpointing else sum(layers)
    return kept + head_activation(shape, b)


# --- the trainer ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerSettings:
    dtype_bytes: int
    world_size: int
    context_parallel: int
    checkpointing: bool
    prompts_per_step: int
    group_size: int
    micro_batch_groups: int
    """0: a rank's whole share of the batch in one pass."""
    seq_tokens: int
    """The longest row: prompt + response (multi-turn: + every turn after the prompt)."""
    chunk_tokens: int
    sdpa_pack_tokens: int = 0
    """SDPA or eager attention on packs of this many tokens: a [T, T] mask each (0: varlen, no mask)."""
    reference: bool = False
    """A frozen reference policy in the trainer (trainer.kl_coef > 0)."""
    lora_rank: int = 0
    """trainer.lora.rank: a frozen base in its dtype, fp32 adapters the only trained (and optimized) weights."""

    @property
    def groups_per_pass(self) -> int:
        return self.micro_batch_groups or max(1, self.prompts_per_step // (self.world_size // self.context_parallel))

    @property
    def tokens(self) -> int:
        """Tokens one rank holds in one micro-batch, after context parallelism."""
        return math.ceil(self.groups_per_pass * self.group_size * self.seq_tokens / self.context_parallel)


def trainer_terms(shape: ModelShape, s: TrainerSettings) -> list[Term]:
    p, b, v, h = shape.params(), s.dtype_bytes, shape.vocab, shape.hidden
    shards = s.world_size  # FSDP2 over every rank (data- and context-parallel alike: world_size = dp × cp)
    t = s.tokens
    if s.lora_rank:
        a = shape.lora_params(s.lora_rank)
        terms = [Term("parameters", b * p / shards + 4 * a / shards,
                      f"b·P{' / ranks' if shards > 1 else ''} (frozen base) + 4·A (fp32 adapters, A = {a:,})")]
        if shards > 1:
            biggest = max(shape.layer_params(layer) for layer in shape.layers)
            outside = p - sum(shape.layer_params(layer) for layer in shape.layers)
            terms.append(Term("gathered layers", b * (2 * biggest + outside),
                              "b·(2 × largest layer + embedding, head): FSDP2's all-gathered copies in flight"))
        terms += [Term("gradients", 4 * a / shards, "4·A (the adapters' only)"),
                  Term("optimizer", 8 * a / shards, "8·A (AdamW moments of the adapters)")]
    elif shards > 1:
        biggest = max(shape.layer_params(layer) for layer in shape.layers)
        outside = p - sum(shape.layer_params(layer) for layer in shape.layers)
        terms = [Term("parameters", 4 * p / shards, "4·P / ranks (fp32 shards: the master)"),
                 Term("gathered layers", b * (2 * biggest + outside),
                      "b·(2 × largest layer + embedding, head): FSDP2's all-gathered copies in flight"),
                 Term("gradients", 4 * p / shards, "4·P / ranks (fp32, reduce-scattered)"),
                 Term("optimizer", 8 * p / shards, "8·P / ranks (AdamW moments, fp32)")]
    else:
        master = 4 * p if b < 4 else 0
        terms = [Term("parameters", b * p, "b·P"),
                 Term("gradients", 4 * p, "4·P (fp32: accumulated in fp32 buffers)"),
                 Term("optimizer", 8 * p + master, "8·P moments" + (" + 4·P fp32 master" if master else ""))]
    per_token = activation_per_token(shape, b, s.checkpointing)
    how = ("layers × b·h + the largest layer's" if s.checkpointing else "Σ layers' saved tensors")
    terms.append(Term("activations", t * per_token,
                      f"T × {per_token / 1024:.1f} KiB ({how}); T = {t:,} = {s.groups_per_pass} groups × "
                      f"{s.group_size} × {s.seq_tokens:,}" + (f" / CP {s.context_parallel}" if s.context_parallel > 1
                                                              else "")))
    head = 2 * s.chunk_tokens * v * 4 + 4 * v * h * (2 if b < 4 else 1)
    terms.append(Term("log-prob chunk", head, "2·chunk·V·4 + 4·V·h (dW fp32)" + (" + 4·V·h (fp32 W)" if b < 4 else "")))
    if s.sdpa_pack_tokens:
        packs = math.ceil(t / s.sdpa_pack_tokens)
        terms.append(Term("attention masks", packs * min(t, s.sdpa_pack_tokens) ** 2,
                          f"{packs} packs × pack² bytes (SDPA's [T, T] mask; varlen has none)"))
    if s.reference and s.lora_rank:  # the base with the adapters off: no second copy of the weights
        largest = max(layer_activation(shape, layer, b) for layer in shape.layers)
        terms.append(Term("reference forward", t * largest, "T × the largest layer (the policy, adapters off)"))
    elif s.reference:
        largest = max(layer_activation(shape, layer, b) for layer in shape.layers)
        terms += [Term("reference weights", b * p, "b·P (trainer.kl_coef > 0: a full frozen copy per rank)"),
                  Term("reference forward", t * largest, "T × the largest layer (no grad, one layer at a time)")]
    terms.append(Term("runtime", RUNTIME, "CUDA context, NCCL, allocator slack"))
    return terms


def advise_trainer(shape: ModelShape, s: TrainerSettings, budget: float) -> list[str]:
    """Settings that make the trainer fit, in the order to try them, each with what it gives."""
    def total(x: TrainerSettings) -> float:
        return sum(t.bytes for t in trainer_terms(shape, x))

    advice, cur = [], s
    steps = []
    if not cur.checkpointing:
        steps.append(("trainer.activation_checkpointing=true", replace(cur, checkpointing=True)))
    if cur.groups_per_pass > 1:
        steps.append(("trainer.micro_batch_groups=1", replace(cur, checkpointing=True, micro_batch_groups=1)))
    for name, nxt in steps:
        cur = nxt
        advice.append(f"{name}: {total(cur) / GiB:,.1f} GiB")
        if total(cur) <= budget:
            return advice
    best = None
    dp_now = cur.world_size // cur.context_parallel
    for dp, cp in sorted(((2**i, 2**j) for i in range(13) for j in range(13)), key=lambda x: (x[0] * x[1], x[1])):
        if dp < dp_now or cp < cur.context_parallel or dp * cp > 4096:
            continue
        if total(replace(cur, world_size=dp * cp, context_parallel=cp)) <= budget:
            best = (dp * cp, cp)
            break
    if best is None:
        advice.append("does not fit on 4,096 GPUs of this size: shorten the rows (sampling.max_tokens, "
                      "data.max_prompt_tokens) or use GPUs with more memory")
        return advice
    w, cp = best
    fit = replace(cur, world_size=w, context_parallel=cp)
    names = [f"trainer.world_size={w}"] if w != cur.world_size else []
    if cp != cur.context_parallel:
        names.append(f"trainer.context_parallel={cp}")
    advice.append(f"{' '.join(names)}: {total(fit) / GiB:,.1f} GiB on each of {w} GPUs")
    return advice


# --- samplers and teachers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerSettings:
    engine: str
    dtype_bytes: int
    slots: int
    seq_tokens: int
    prefill_tokens: int = 8192
    vllm_share: float = 0.9
    """vLLM: the share of the GPU it takes (gpu_memory_utilization, or gpus.memory.sampler)."""
    vllm_kv_bytes: int = 0
    vllm_margin: float = 2.0 * GiB
    vllm_max_model_len: int = 0


def kv_per_token(shape: ModelShape, b: int) -> float:
    """K/V bytes per token of context, every attention layer."""
    return shape.count("attention") * 2 * shape.kv * b


def state_per_row(shape: ModelShape, b: int) -> float:
    """Mamba-2 bytes per row whatever its length: the conv window (b) and the SSM state (fp32), every Mamba layer."""
    per_layer = shape.conv_dim * (shape.conv_kernel - 1) * b + shape.d_inner * shape.ssm_state * 4
    return shape.count("mamba") * per_layer


def sampler_terms(shape: ModelShape, s: SamplerSettings, gpu: float) -> list[Term]:
    b, p = s.dtype_bytes, shape.params()
    length = min(-(-s.seq_tokens // 128) * 128, shape.max_context or s.seq_tokens)
    per_row = length * kv_per_token(shape, b) + state_per_row(shape, b)
    weights = Term("weights", b * p, "b·P")
    if s.engine == "vllm":
        share = s.vllm_share * gpu
        pool = s.vllm_kv_bytes or max(0.0, share - b * p - s.vllm_margin)
        return [weights, Term("K/V + state pool", pool, f"{s.vllm_share:g} × GPU − weights − margin: "
                              f"{pool / per_row:,.1f} rows of {length:,} tokens ({per_row / GiB:.2f} GiB each)"),
                Term("activations margin", s.vllm_margin, "sampler.vllm.activation_margin_gib")]
    largest = max(part_activation(shape, part, b) for layer in shape.layers for part in layer)
    return [weights,
            Term("K/V cache", s.slots * length * kv_per_token(shape, b),
                 f"slots {s.slots} × {length:,} tokens × attention layers × 2·kv·b"),
            Term("Mamba state", s.slots * state_per_row(shape, b), f"slots {s.slots} × Mamba layers × "
                 f"(conv_dim·(K−1)·b + d_inner·N·4)"),
            Term("prefill", min(s.prefill_tokens, s.slots * length) * largest + s.slots * shape.vocab * 4,
                 "prefill tokens × the largest part's tensors + slots × V × 4 (last logits)"),
            Term("runtime", RUNTIME, "CUDA context, CUDA graphs, allocator slack")]


def advise_sampler(shape: ModelShape, s: SamplerSettings, gpu: float, budget: float) -> list[str]:
    b = s.dtype_bytes
    length = min(-(-s.seq_tokens // 128) * 128, shape.max_context or s.seq_tokens)
    per_row = length * kv_per_token(shape, b) + state_per_row(shape, b)
    if s.engine == "vllm":
        rows = sampler_terms(shape, s, gpu)[1].bytes / per_row
        if rows >= s.slots:
            return []
        if rows >= 1:
            return [f"vLLM holds {int(rows)} of the {s.slots} slots' rows at once at this length (the rest wait): "
                    f"sampler.slots={int(rows)} or more GPUs per sampler (sampler.vllm.options.tensor_parallel_size)"]
        return ["not one row fits beside the weights: raise sampler.vllm.gpu_memory_utilization, or more GPUs per "
                "sampler (sampler.vllm.options.tensor_parallel_size)"]
    fixed = sum(t.bytes for t in sampler_terms(shape, replace(s, slots=1), gpu)) - per_row
    slots = int((budget - fixed) // per_row)
    if slots >= 1:
        return [f"sampler.slots={min(slots, s.slots)}: {min(slots, s.slots)} rows of {length:,} tokens fit"]
    return ["the weights and one row do not fit: a GPU with more memory, or sampler.engine=vllm with "
            "tensor parallelism (sampler.vllm.options={tensor_parallel_size: N})"]


def teacher_terms(shape: ModelShape, b: int, tokens: int, chunk_tokens: int) -> list[Term]:
    largest = max(layer_activation(shape, layer, b) for layer in shape.layers)
    return [Term("weights", b * shape.params(), "b·P"),
            Term("forward", tokens * largest, f"{tokens:,} tokens × the largest layer (no grad)"),
            Term("log-prob chunk", chunk_tokens * shape.vocab * 4, "chunk·V·4"),
            Term("runtime", RUNTIME, "CUDA context, allocator slack")]

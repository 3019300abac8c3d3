"""``cascade-rl plan``: the memory plan of a launch config, per role and per GPU, printed or as JSON.

    cascade-rl plan stage=code_rl model.path=nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 model.dtype=bf16
    cascade-rl plan demo --gpu-memory 141GiB --json

The config is composed as ``launch`` composes it (supervisor/config.py), without the launch's checks: the plan
is for configurations this machine cannot run. The model is read from ``model.path``'s ``config.json``, or, for a
path that is not a directory here, from the published shapes of supervisor/memory_shapes.py ``KNOWN``. Nothing
is allocated and torch is never imported: the command takes well under a second past Hydra's imports. The terms
and their formulas: supervisor/memory_plan.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig

from .config_errors import ConfigError
from .memory_plan import (
    GiB,
    RolePlan,
    SamplerSettings,
    TrainerSettings,
    advise_sampler,
    advise_trainer,
    sampler_terms,
    teacher_terms,
    trainer_terms,
)
from .memory_shapes import KNOWN, ModelShape, known_config, shape_from_config
from .procs import teacher_groups

GPUS = {"h100": 80, "a100": 80, "a100-40": 40, "h200": 141, "b200": 180, "l40s": 48}  # GiB each
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def gpu_bytes(text: str) -> float:
    """``80GiB``, ``141``, ``80GB`` (GB taken as GiB's neighbour: 10^9), or a GPU's name (h100, h200, ...)."""
    t = text.strip().lower()
    if t in GPUS:
        return GPUS[t] * GiB
    m = re.fullmatch(r"([\d.]+)\s*(gib|gb|g)?", t)
    if not m:
        raise ConfigError(f"--gpu-memory {text!r}: give GiB (80GiB, 141) or a GPU ({', '.join(GPUS)})")
    return float(m[1]) * (1e9 if m[2] == "gb" else GiB)


def load_shape(path: str) -> ModelShape:
    """The model's shape from ``path/config.json``, else from the known published shapes by name."""
    config = Path(path) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
    elif (data := known_config(path)) is None:
        raise ConfigError(f"model.path={path}: no config.json there and not a known model ({', '.join(KNOWN)}); "
                          f"point it at a directory holding the model's config.json (weights not needed)")
    try:
        return shape_from_config(data)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"model.path={path}: {e}") from None


def seq_tokens(cfg: DictConfig) -> int:
    """The longest row a step holds: the prompt cap plus the response (multi-turn with a token budget: plus that
    budget, orchestrator.max_total_tokens)."""
    after = cfg.orchestrator.max_total_tokens or cfg.sampling.max_tokens
    return cfg.data.max_prompt_tokens + after


def trainer_settings(cfg: DictConfig) -> TrainerSettings:
    t = cfg.trainer
    attn = str(cfg.model.attn_impl)
    return TrainerSettings(
        dtype_bytes=DTYPE_BYTES[str(cfg.model.dtype)], world_size=t.world_size,
        context_parallel=t.context_parallel, checkpointing=bool(t.activation_checkpointing),
        prompts_per_step=cfg.run.prompts_per_step, group_size=cfg.run.group_size,
        micro_batch_groups=t.micro_batch_groups, seq_tokens=seq_tokens(cfg), chunk_tokens=t.logprob_chunk_tokens,
        sdpa_pack_tokens=t.pack_tokens if attn in ("sdpa", "eager") else 0,  # auto on a GPU: varlen, no mask
        reference=t.kl_coef > 0 and cfg.run.algorithm == "grpo", lora_rank=t.lora.rank)


def sampler_settings(cfg: DictConfig) -> SamplerSettings:
    s, v = cfg.sampler, cfg.sampler.vllm
    return SamplerSettings(engine=s.engine, dtype_bytes=DTYPE_BYTES[str(cfg.model.dtype)], slots=s.slots,
                           seq_tokens=seq_tokens(cfg), vllm_share=cfg.gpus.memory.sampler or v.gpu_memory_utilization,
                           vllm_kv_bytes=v.kv_cache_memory_bytes, vllm_margin=v.activation_margin_gib * GiB,
                           vllm_max_model_len=v.max_model_len)


def build(cfg: DictConfig, gpu: float, shape: ModelShape | None = None) -> dict:
    """Every role's plan: {"model": ..., "gpu_gib": ..., "roles": [RolePlan, ...]}."""
    shape = shape or load_shape(cfg.model.path)
    share = cfg.gpus.memory
    roles = []
    ts = trainer_settings(cfg)
    trainer = RolePlan("trainer", ts.world_size, (share.trainer or 1.0) * gpu,
                       trainer_terms(shape, ts))
    if not trainer.fits:
        trainer.advice = advise_trainer(shape, ts, trainer.budget)
    roles.append(trainer)
    ss = sampler_settings(cfg)
    budget = (ss.vllm_share if ss.engine == "vllm" else share.sampler or 1.0) * gpu
    sampler = RolePlan("sampler", cfg.sampler.count, budget, sampler_terms(shape, ss, gpu))
    if ss.engine == "sglang":
        sampler.notes.append("sglang: planned as the torch engine's cache (its server sizes its own pool with "
                             "sampler.sglang.mem_fraction_static)")
    if not sampler.fits or ss.engine == "vllm":
        sampler.advice = advise_sampler(shape, ss, gpu, budget)
    if ss.engine == "vllm" and ss.vllm_max_model_len and ss.vllm_max_model_len < ss.seq_tokens:
        sampler.notes.append(f"sampler.vllm.max_model_len={ss.vllm_max_model_len} < {ss.seq_tokens:,} tokens a row "
                             f"may take")
    roles.append(sampler)
    if cfg.run.algorithm == "mopd":
        n = len(teacher_groups(cfg.teacher.checkpoints)) or 1  # adapters of one base: one server
        tokens = max(cfg.teacher.max_batch_tokens, cfg.run.group_size * ts.seq_tokens)
        roles.append(RolePlan("teacher", n, (share.teacher or 1.0) * gpu,
                              teacher_terms(shape, ts.dtype_bytes, tokens, cfg.trainer.logprob_chunk_tokens),
                              notes=[] if cfg.teacher.checkpoints else ["one per distinct teaching checkpoint (the "
                                                                        "cascade runner's: one per domain; LoRA "
                                                                        "checkpoints of one base: one)"]))
    for role in roles[2:]:  # teachers
        if not role.fits:
            role.advice = ["a teacher server takes one group at once at least: shorter rows, or a GPU with more "
                           "memory"]
    notes = []
    if shape.max_context and ts.seq_tokens > shape.max_context:
        notes.append(f"rows of {ts.seq_tokens:,} tokens exceed the model's max_position_embeddings "
                     f"({shape.max_context:,}): the engines refuse them")
    return {"model": cfg.model.path, "model_type": shape.model_type, "params": shape.params(),
            "dtype": str(cfg.model.dtype), "seq_tokens": ts.seq_tokens, "gpu_gib": gpu / GiB, "notes": notes,
            "roles": roles}


def to_json(plan: dict) -> dict:
    def role(r: RolePlan) -> dict:
        return {"role": r.role, "gpus": r.gpus, "budget_gib": round(r.budget / GiB, 3),
                "total_gib": round(r.total / GiB, 3), "fits": r.fits, "notes": r.notes, "advice": r.advice,
                "terms": [{"name": t.name, "gib": round(t.bytes / GiB, 4), "formula": t.formula} for t in r.terms]}
    return {**plan, "fits": all(r.fits for r in plan["roles"]), "roles": [role(r) for r in plan["roles"]]}


def to_text(plan: dict) -> str:
    """The plan as plain text: one table per role, its verdict and what to change."""
    lines = [f"model {plan['model']} ({plan['model_type']}, {plan['params'] / 1e9:.3g} B parameters, "
             f"{plan['dtype']}); rows up to {plan['seq_tokens']:,} tokens; GPUs of {plan['gpu_gib']:g} GiB"]
    lines += [f"note: {n}" for n in plan["notes"]]
    for r in plan["roles"]:
        verdict = "fits" if r.fits else "DOES NOT FIT"
        lines.append(f"\n{r.role} (x{r.gpus} GPU{'s' if r.gpus != 1 else ''}): {r.total / GiB:,.2f} GiB of "
                     f"{r.budget / GiB:,.1f} per GPU: {verdict}")
        width = max(len(t.name) for t in r.terms)
        for t in r.terms:
            lines.append(f"  {t.name:<{width}}  {t.bytes / GiB:>10,.2f} GiB  {t.formula}")
        lines += [f"  note: {n}" for n in r.notes]
        lines += [f"  change: {a}" for a in r.advice]
    return "\n".join(lines)


def plan_command(preset: str | None, overrides: list[str], gpu_memory: str, as_json: bool, check: bool) -> int:
    """Print the plan; 0, or 3 with ``check`` when a role does not fit."""
    from .config import compose

    if preset and "=" in preset:  # `cascade-rl plan stage=code_rl`: no run preset, the paper's scale
        overrides, preset = [preset, *overrides], None
    cfg = compose(preset, overrides, check=False)
    plan = build(cfg, gpu_bytes(gpu_memory))
    print(json.dumps(to_json(plan), indent=1) if as_json else to_text(plan))
    return 3 if check and not all(r.fits for r in plan["roles"]) else 0

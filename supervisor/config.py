"""Hydra composition of the launch schema (supervisor/schema.py) and the cross-process rules.

    cascade-rl launch tiny run_dir=/tmp/r run.steps=3 sampler.count=2

``compose`` merges, in order: the schema's defaults, ``configs/config.yaml``,
the named preset ``configs/run/<name>.yaml`` (or a YAML file path) and the
command-line overrides; validates cross-process rules once; and returns a
plain ``DictConfig``. The supervisor writes the resolved config (with the
run's endpoints) to ``<run_dir>/config.yaml``; every worker reads that file, so
workers never re-implement defaults.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from cascade_rl.environments.base import EnvSettings
from cascade_rl.orchestrator.trackers import problems as tracker_problems
from cascade_rl.protocol.devices import GPU_KEYS, uses_gpus

from . import judge
from .config_errors import ConfigError, explain, renamed_overrides, unknown_keys
from .launchers.rules import launch_problems
from .schema import LaunchConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
FREE_DICTS = ("data.domain_map=",)  # schema fields whose keys are the user's (see compose)
if not CONFIG_DIR.is_dir():  # installed as a wheel: configs is the cascade_rl.configs package
    import cascade_rl.configs as _configs

    CONFIG_DIR = Path(_configs.__file__).parent


ConfigStore.instance().store(name="launch_schema", node=LaunchConfig)


def compose(preset: str | None, overrides: list[str], check: bool = True) -> DictConfig:
    """Resolve a launch config from a preset name (configs/run/NAME.yaml) or a YAML path."""
    # a free-form mapping set whole (data.domain_map={openai/gsm8k: math}): Hydra merges a dict into the node,
    # whose struct flag refuses every new key; "++" adds them
    overrides = [f"++{o}" if o.startswith(FREE_DICTS) else o for o in overrides]
    if renamed := renamed_overrides(overrides):
        raise ConfigError("; ".join(renamed))
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
    if cfg.resume and not cfg.run.resume_from:
        cfg.run.resume_from = "latest"
    if cfg.trainer.routing_replay:  # the trainer replays the routes the samplers return: they read only their own
        cfg.sampler.return_routes = True
    judge.apply_defaults(cfg.verifier.judge)  # a served judge's name, which the verifiers send
    if check:
        validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Cross-process rules, checked once at launch with a message that says what to change. Rules that need
    the data (the domains it holds) are checked when it is prepared (supervisor/run_data.py). Fixed choices are
    typed in the schema; names of implementations are checked here against their registries."""
    problems = []
    r, t, o, s, v = cfg.run, cfg.trainer, cfg.orchestrator, cfg.sampler, cfg.verifier
    for key, value, registry in _registered_names(cfg):
        if value not in registry:
            problems.append(f"{key}={value!r}: choose one of {', '.join(sorted(registry))}")
    if not 0 < t.eps_low <= 1 <= t.eps_high:
        problems.append("need 0 < trainer.eps_low <= 1 <= trainer.eps_high (the band must hold ratio 1)")
    if t.kl_coef < 0 or t.entropy_coef < 0:
        problems.append("trainer.kl_coef and trainer.entropy_coef must be >= 0")
    cp = t.context_parallel
    if cp < 1 or t.world_size < 1 or t.world_size % cp:
        problems.append(f"trainer.context_parallel={cp} must divide trainer.world_size={t.world_size} (both >= 1)")
    elif r.prompts_per_step % (t.world_size // cp):
        problems.append("run.prompts_per_step must be a multiple of trainer.world_size / trainer.context_parallel "
                        "(the ranks that split the batch)")
    if cp > 1 and not t.pack:
        problems.append("trainer.context_parallel splits packed sequences: set trainer.pack=true")
    if o.max_staleness < 0:
        problems.append("orchestrator.max_staleness must be >= 0 (0: strictly on-policy)")
    if o.max_staleness > 0 and r.algorithm == "grpo" and t.correction == "none":
        problems.append("orchestrator.max_staleness > 0 trains on rollouts of older weights: set "
                        "trainer.correction (icepop, the paper's truncated weights, or tis, seq_tis, mis, geo_mask)")
    if len(t.geo_band) != 2 or not 0 < t.geo_band[0] <= 1 <= t.geo_band[1]:
        problems.append("trainer.geo_band must be [low, high] with 0 < low <= 1 <= high")
    if r.group_size < 2 and r.algorithm == "grpo":
        problems.append("run.group_size must be >= 2 for GRPO (advantages are group-normalised)")
    if t.micro_batch_groups and r.prompts_per_step % t.micro_batch_groups:
        problems.append("run.prompts_per_step must be a multiple of trainer.micro_batch_groups")
    if o.over_dispatch < 1:
        problems.append(f"orchestrator.over_dispatch={o.over_dispatch} must be >= 1 (1: dispatch what a step needs)")
    if o.max_inflight_groups < 1 or o.stream_tokens < 0:
        problems.append("orchestrator.max_inflight_groups must be >= 1 and orchestrator.stream_tokens >= 0 (0: the "
                        "whole step in one part)")
    if s.count < 1 or v.count < 1:
        problems.append("sampler.count and verifier.count must be >= 1")
    if s.slots < 1 or v.procs < 1 or v.depth < 1 or v.slots < 0 or cfg.teacher.slots < 1:
        problems.append("sampler.slots, verifier.procs, verifier.depth and teacher.slots must be >= 1 "
                        "(verifier.slots >= 0)")
    if min(s.batch_window_s, cfg.teacher.batch_window_s, cfg.supervisor.drain_quiet_s) < 0:
        problems.append("sampler.batch_window_s, teacher.batch_window_s and supervisor.drain_quiet_s must be >= 0")
    if cfg.sampling.max_tokens < 1:
        problems.append("sampling.max_tokens must be >= 1")
    e, o = cfg.environment, cfg.orchestrator
    if min(e.count, e.slots, e.threads, o.max_turns) < 1 or min(e.batch_window_s, o.max_total_tokens) < 0:
        problems.append("environment.count, slots, threads and orchestrator.max_turns must be >= 1, "
                        "environment.batch_window_s and orchestrator.max_total_tokens >= 0")
    try:
        EnvSettings.from_config(e)
    except ValueError as err:  # a tool limit that is not a positive number
        problems.append(str(err))
    if not Path(cfg.model.path).is_dir():
        problems.append(f"model.path={cfg.model.path} is not a directory (an HF model directory; a tiny one: "
                        f"cascade-rl make-tiny-model --out DIR)")
    if s.engine == "torch" and (unserved := _unserved_model_type(cfg.model.path)):
        problems.append(unserved)
    if s.engine == "vllm" and not uses_gpus(cfg, "sampler") and (refused := _vllm_cpu_refusal(cfg.model.path)):
        problems.append(refused)
    if not cfg.data.files and not cfg.data.get("verifiers_env"):
        problems.append("data.files is empty: name the training prompts, e.g. data.files=[prompts.jsonl] "
                        "(built-in miniature sets: cascade-rl make-data NAME --out DIR)")
    from cascade_rl.verifiers.registry import GROUP_VERIFIERS, VERIFIERS, load_plugins

    try:
        load_plugins(list(v.plugins))
    except Exception as e:  # the user's module: its import error is the message
        problems.append(str(e))
    known = set(VERIFIERS) | set(GROUP_VERIFIERS)
    if unknown := [d for d in v.domains if d not in known]:
        problems.append(f"verifier.domains: no verifier for {unknown} (registered: {sorted(known)})")
    problems += judge.problems(v.judge)
    teachers = cfg.teacher.checkpoints
    if teachers and r.algorithm != "mopd":
        problems.append("teacher.checkpoints are used by run.algorithm=mopd only")
    if missing := [p for p in teachers.values() if not Path(p).is_dir()]:
        problems.append(f"teacher.checkpoints: {missing} are not directories")
    triton = [k for k, val in (("model.moe_impl", cfg.model.moe_impl), ("trainer.logprob_impl", t.logprob_impl))
              if val == "triton"]
    on_cpu = [f"gpus.{GPU_KEYS[r]}" for r in ("trainer", "teacher") if not uses_gpus(cfg, r) and (r == "trainer" or teachers)]
    if triton and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        problems.append(f"{' and '.join(triton)}=triton run on GPUs, but {' and '.join(on_cpu)} name none: give them "
                        f"GPUs (e.g. gpus.trainer=[0]), or choose {'hf' if triton[0] == 'model.moe_impl' else 'torch'} "
                        f"(TRITON_INTERPRET=1 runs Triton's interpreter on the CPU, for tests only)")
    if t.routing_replay or cfg.sampler.return_routes:
        engine = cfg.sampler.engine
        if engine == "sglang" or (engine == "vllm" and not uses_gpus(cfg, "sampler")):
            problems.append(f"trainer.routing_replay / sampler.return_routes need an engine that returns routes: the "
                            f"torch engine, or vllm on GPUs (gpus.samplers); {engine}"
                            f"{' on the CPU' if engine == 'vllm' else ''} does not")
    if t.router_bias_update_rate != 0:
        problems.append(f"trainer.router_bias_update_rate={t.router_bias_update_rate}: only 0 is served (MoE "
                        f"correction biases stay frozen during RL, so the sampler's routes are the trainer's; see "
                        f"its docstring in supervisor/schema.py)")
    if cfg.sampler.inflight_updates:
        if o.max_staleness < 1:
            problems.append("sampler.inflight_updates needs orchestrator.max_staleness >= 1 (strictly on-policy, no "
                            "weights arrive while a batch is sampled)")
        if cfg.sampler.engine != "torch":
            problems.append(f"sampler.inflight_updates: the {cfg.sampler.engine} engine cannot take weights between "
                            "decode steps here; use sampler.engine=torch or drop inflight_updates")
    problems += lora_problems(cfg)
    try:
        OmegaConf.to_object(cfg.weights_options)  # each transport's options check themselves (schema_weights.py)
    except ValueError as err:
        problems.append(str(err))
    problems += launch_problems(cfg) + tracker_problems(cfg)
    if r.algorithm == "mopd" and (t.kl_coef or t.entropy_coef):
        problems.append("trainer.kl_coef / entropy_coef apply to grpo only")
    if problems:
        raise ConfigError("invalid launch config:\n  " + "\n  ".join(problems))


ADAPTER_TRANSPORTS = ("shm", "stream")  # transports that ship an adapter's file (cuda_ipc lays out full weights)


def lora_problems(cfg: DictConfig) -> list[str]:
    """``trainer.lora``'s rules across processes (the model's own are checked when the trainer attaches it)."""
    from cascade_rl.weights import adapters

    lora = cfg.trainer.lora
    try:
        OmegaConf.to_object(lora)  # the section checks its own values (schema_lora.py)
    except ValueError as err:
        return [str(err)]
    if not lora.rank:
        return []
    problems = []
    from cascade_rl.samplers.engine import ENGINES

    takes = sorted(name for name, engine in ENGINES.items() if hasattr(engine, "load_adapter"))
    if cfg.sampler.engine in ENGINES and cfg.sampler.engine not in takes:  # learner/lora.py ships adapters only
        problems.append(f"trainer.lora: the {cfg.sampler.engine} engine does not load adapters (load_adapter); "
                        f"sample with sampler.engine={' or '.join(takes)}")
    if cfg.weights_transport not in ADAPTER_TRANSPORTS:
        problems.append(f"trainer.lora: weights_transport={cfg.weights_transport} ships full weights only; use "
                        f"{' or '.join(ADAPTER_TRANSPORTS)} (an adapter is megabytes: any transport is fast enough)")
    if adapters.is_adapter(cfg.model.path):
        problems.append(f"trainer.lora with model.path={cfg.model.path}: that is already a LoRA adapter (of "
                        f"{adapters.base_of(cfg.model.path) or 'another base'}); merge it first (cascade-rl export "
                        "--merge) and train a new adapter on the merged model")
    if cfg.sampler.engine == "vllm" and not uses_gpus(cfg, "sampler"):
        from cascade_rl.samplers.vllm_engine import CPU_LORA_MOE, is_moe

        if is_moe(cfg.model.path):
            problems.append(f"trainer.lora with sampler.engine=vllm on the CPU: {CPU_LORA_MOE}; sample with "
                            "sampler.engine=torch (it merges each adapter)")
    return problems


def _registered_names(cfg: DictConfig) -> list[tuple[str, str, dict]]:
    """(key, value, registry) of every setting that names a registered implementation."""
    from cascade_rl.learner.losses import CORRECTIONS
    from cascade_rl.learner.objectives import OBJECTIVES
    from cascade_rl.modeling.policy import LOGPROB_IMPLS
    from cascade_rl.samplers.engine import ENGINES, register_builtin_engines
    from cascade_rl.weights.registry import TRANSPORTS

    register_builtin_engines()
    return [("run.algorithm", cfg.run.algorithm, OBJECTIVES),
            ("trainer.logprob_impl", cfg.trainer.logprob_impl, LOGPROB_IMPLS),
            ("trainer.correction", cfg.trainer.correction, CORRECTIONS),
            ("weights_transport", cfg.weights_transport, TRANSPORTS),
            ("sampler.engine", cfg.sampler.engine, ENGINES)]


def _vllm_cpu_refusal(path: str) -> str:
    """vLLM's CPU build's refusal of the model's layers (samplers/vllm_engine.py CPU_REFUSALS: Nemotron-H's MoE
    layers), found before any process starts ("" if it can run them)."""
    from cascade_rl.samplers.vllm_engine import cpu_refusal

    if not (reason := cpu_refusal(path)):
        return ""
    return f"sampler.engine=vllm on the CPU (no gpus.samplers): {reason}: sample with sampler.engine=torch"


def _unserved_model_type(path: str) -> str:
    """The torch engine's refusal of the model's architecture, found before any process starts ("" if served)."""
    import json

    from cascade_rl.samplers.torch_model import SERVED_MODEL_TYPES

    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type is None or model_type in SERVED_MODEL_TYPES:
        return ""
    return (f"model_type {model_type!r} is not served by the torch engine (it serves {', '.join(SERVED_MODEL_TYPES)}): "
            f"sample with sampler.engine=vllm")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


"""What a launcher refuses before any process starts, each with what to change (pure: the config in, lines out).

    problems = launch_problems(cfg)      # [] or one line per problem (supervisor/config.py ``validate``)
"""

from __future__ import annotations

from cascade_rl.protocol.devices import GPU_KEYS

from .placement_rules import RAY_ROLES


def launch_problems(cfg) -> list[str]:
    if cfg.launcher != "ray":
        return []
    problems = []
    if cfg.weights_transport not in ("stream", "delta", "nccl"):  # the transports over the network
        problems.append(f"launcher=ray: weights_transport={cfg.weights_transport} reaches processes of one machine "
                        f"only, and Ray may place samplers on any node: set weights_transport=stream (or delta, nccl)")
    if named := [f"gpus.{key}" for key in GPU_KEYS.values() if cfg.gpus[key]]:
        problems.append(f"launcher=ray: {', '.join(named)} name one machine's GPUs; Ray gives each process its own: "
                        f"empty them and ask per process with ray.<role>.gpus (e.g. ray.trainer.gpus=1)")
    if cfg.sampler.launcher:
        problems.append("launcher=ray places the samplers itself: drop sampler.launcher")
    if cfg.sampler.engine == "sglang" and not cfg.sampler.sglang.url:
        problems.append("launcher=ray does not start SGLang servers (each must sit beside its sampler): start them "
                        "yourself and set sampler.sglang.url, or use sampler.engine=torch or vllm")
    if cfg.verifier.judge.serve != "none":
        problems.append(f"launcher=ray does not start the judge's server (verifier.judge.serve="
                        f"{cfg.verifier.judge.serve}): serve it where every node reaches it and set "
                        f"verifier.judge.serve=none with verifier.judge.base_url")
    for role in RAY_ROLES:
        spec = cfg.ray[role]
        if spec.cpus < 0 or spec.gpus < 0 or any(v < 0 for v in spec.resources.values()):
            problems.append(f"ray.{role}: cpus, gpus and resources must be >= 0")
        if spec.gpus > 1 and spec.gpus != int(spec.gpus):
            problems.append(f"ray.{role}.gpus={spec.gpus}: a fraction of one GPU, or a whole number")
    if cfg.ray.trainer.gpus > 1:
        problems.append(f"ray.trainer.gpus={cfg.ray.trainer.gpus}: one GPU per rank; more GPUs are more ranks "
                        f"(trainer.world_size)")
    return problems

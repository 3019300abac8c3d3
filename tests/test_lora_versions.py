"""A LoRA run's weight versions at a real sampler worker process, driven over a real ROUTER socket (the orchestrator's
seat): adapters published by the real shm transport arrive out of order, one fails its checksum, the worker is
SIGKILLed while a version is being loaded and restarted. Whatever happens, a rollout tagged with version v was sampled
with exactly v's adapter over the base: its log-probs are peft's for that adapter (1e-4, fp32)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import torch
import zmq
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_lora_engines import TARGETS, PeftModel
from test_sampler_worker import collect, receive, request

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.protocol.messages import Ready
from cascade_rl.protocol.sockets import bind_router, send
from cascade_rl.supervisor.config import compose
from cascade_rl.weights.shm import ShmTransport


@torch.no_grad()
def max_error(peft: PeftModel, rollouts) -> float:
    """The largest |engine − peft| log-prob over the rollouts' response tokens (teacher-forced, T = 1)."""
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor(np.concatenate([r.prompt_ids, r.response_ids]).astype(np.int64))[None]
        lp = token_logprobs(peft.model(input_ids=ids).logits, ids, temperature=1.0)[0, len(r.prompt_ids):]
        worst = max(worst, (lp - torch.from_numpy(r.inf_logprobs)).abs().max().item())
    return worst


def test_adapter_versions_out_of_order_torn_and_killed_mid_load(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    cfg = compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}", "trainer.lora.rank=8",
                           f"trainer.lora.targets=[{','.join(TARGETS)}]"], check=False)
    cfg.endpoints.update({"orchestrator": f"ipc://{tmp_path}/orch"})
    config = tmp_path / "config.yaml"
    config.write_text(OmegaConf.to_yaml(cfg))
    router = bind_router(zmq.Context.instance(), cfg.endpoints.orchestrator)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    transport = ShmTransport(run_id=f"lora-versions-{os.getpid()}", keep=4)
    peft = PeftModel(tiny_model)
    adapters, notices = {}, {}
    for version in (1, 2, 3):  # each version's adapter, published as the trainer publishes one (its state dict)
        peft.set_b(version)
        path = peft.save(tmp_path / f"v{version}.safetensors")
        adapters[version] = load_file(str(path))
        notices[version] = dataclasses.replace(transport.publish(adapters[version], version), adapter=peft.config)

    def start():
        proc = subprocess.Popen([sys.executable, "-P", "-m", "cascade_rl.samplers.worker", "--config", str(config),
                                 "--worker-id", "sampler-l"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ident, ready = receive(router)
        assert isinstance(ready, Ready) and ready.version == 0
        return proc, ident

    def sampled_with(version: int, ident, group: str):
        send(router, request(tok, group, n=2, min_version=version), identity=ident)
        rollouts = collect(router, 2)
        assert all(r.policy_version == version and len(r.response_ids) for r in rollouts), rollouts
        peft.set_b(version)
        err = max_error(peft, rollouts)
        assert err < 1e-4, f"rollouts of version {version}: max |engine - peft| log-prob {err:.2e}"

    proc, ident = start()
    try:
        # out of order: v2, then v1 (older: ignored), then a request that needs v2
        send(router, notices[2], identity=ident)
        send(router, notices[1], identity=ident)
        sampled_with(2, ident, "a")
        # a notice whose file fails its checksum is refused: the worker stays on v2, v2's adapter whole
        send(router, dataclasses.replace(notices[3], checksum="0" * 32), identity=ident)
        send(router, request(tok, "b", n=2), identity=ident)
        rollouts = collect(router, 2)
        assert {r.policy_version for r in rollouts} == {2}
        peft.set_b(2)
        assert max_error(peft, rollouts) < 1e-4
        # killed while v3 loads: the restarted worker is the base again (version 0), and v3, handed to it as the
        # orchestrator hands a late joiner the newest weights, is merged over the base, not over v2
        send(router, notices[3], identity=ident)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, ident = start()
        send(router, notices[3], identity=ident)
        sampled_with(3, ident, "c")
        assert proc.poll() is None, "the sampler worker died"
    finally:
        proc.kill()
        proc.wait()
        transport.close()
        router.close(linger=0)


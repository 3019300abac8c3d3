"""A real sampler worker process, driven over a real ROUTER socket by the test (in the orchestrator's seat):
bad requests get error rollouts, malformed frames are dropped, weights announced over the wire are
applied before the requests that need them, and the worker lives on through all of it. Weights are applied by
the notice's format; a torn ``cuda_ipc`` load serves nothing until the next notice's weights are in."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq
from omegaconf import OmegaConf
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.protocol.messages import PromptRequest, Ready, Rollout, SamplingParams, WeightsReady, WorkKey
from cascade_rl.protocol.sockets import bind_router, recv_routed, send
from cascade_rl.samplers.worker import Sampler
from cascade_rl.supervisor.config import compose
from cascade_rl.weights import cuda_ipc
from cascade_rl.weights.common import TornRead, WeightsError, file_checksum
from cascade_rl.weights.registry import RECEIVERS, Receiver

EXPECT = (Ready, Rollout)


@pytest.fixture(params=[False, True], ids=["whole-batch", "streamed-groups"])
def worker(tiny_model, tmp_path, request):
    cfg = compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}",
                           f"sampler.stream_groups={str(request.param).lower()}"], check=False)
    cfg.endpoints.update({"orchestrator": f"ipc://{tmp_path}/orch"})
    config = tmp_path / "config.yaml"
    config.write_text(OmegaConf.to_yaml(cfg))
    router = bind_router(zmq.Context.instance(), cfg.endpoints.orchestrator)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cascade_rl.samplers.worker", "--config", str(config),
                             "--worker-id", "sampler-t"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield router, proc, AutoTokenizer.from_pretrained(tiny_model)
    proc.kill()
    proc.wait()
    router.close(linger=0)


def receive(router, timeout_s: float = 60.0):
    assert router.poll(int(timeout_s * 1000)), "no reply from the sampler worker"
    return recv_routed(router, EXPECT)


def request(tok, group_id: str, prompt_ids=None, n=2, min_version=0) -> PromptRequest:
    if prompt_ids is None:
        text = tok.apply_chat_template([{"role": "user", "content": "Calculate 1 + 2 + 3."}], tokenize=False,
                                       add_generation_prompt=True)
        prompt_ids = np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)
    return PromptRequest(WorkKey.sample(group_id, 0), "math", prompt_ids, n, SamplingParams(max_tokens=8), min_version)


def collect(router, n: int) -> list[Rollout]:
    return [receive(router)[1] for _ in range(n)]


def test_worker_survives_bad_input_and_applies_weights(worker, tiny_model, tmp_path):
    router, proc, tok = worker
    ident, ready = receive(router)
    assert isinstance(ready, Ready) and ready.role == "sampler" and ready.version == 0

    # malformed frames: dropped and counted, no reply, no crash
    router.send_multipart([ident, b"\x00garbage"])
    router.send_multipart([ident, b"\x81\xa1t\xa3bad", b"extra"])

    # bad requests: an error rollout with the reason, for each
    send(router, request(tok, "empty", prompt_ids=np.zeros(0, np.int32)), identity=ident)
    err = receive(router)[1]
    assert err.key == WorkKey.sample("empty", 0) and err.finish_reason == "error" and "empty prompt" in err.error
    send(router, request(tok, "oov", prompt_ids=np.array([1, 10**6], np.int32)), identity=ident)
    assert "out of range" in receive(router)[1].error

    # a good request still works: n rollouts with log-probs, version 0
    send(router, request(tok, "good", n=3), identity=ident)
    rollouts = collect(router, 3)
    assert sorted(r.key.index for r in rollouts) == [0, 1, 2] and {r.key.kind for r in rollouts} == {"sample"}
    assert all(r.finish_reason in ("stop", "length") and r.policy_version == 0 for r in rollouts)
    assert all(len(r.response_ids) == len(r.inf_logprobs) > 0 for r in rollouts)

    # a request that needs version 1 waits for the weights; the weights come over the wire
    send(router, request(tok, "v1", n=2, min_version=1), identity=ident)
    assert not router.poll(1500), "the worker sampled before it had the weights the request needs"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    path = tmp_path / "policy-v1.safetensors"
    save_model(model, str(path))
    send(router, WeightsReady(1, f"file://{path}", nbytes=path.stat().st_size, checksum=file_checksum(path)),
         identity=ident)
    rollouts = collect(router, 2)
    assert all(r.key.group == "v1" and r.policy_version == 1 for r in rollouts)

    # a notice whose file fails its checksum is refused; the worker stays on version 1
    send(router, WeightsReady(2, f"file://{path}", nbytes=path.stat().st_size, checksum="0" * 32), identity=ident)
    send(router, request(tok, "after", n=1), identity=ident)
    assert receive(router)[1].policy_version == 1
    time.sleep(0.2)
    assert proc.poll() is None, "the sampler worker died"


class _Engine:
    """An engine of the interface's weight methods only: records what it was given."""

    def __init__(self) -> None:
        self.version, self.loaded = 0, []

    def load_weights(self, path: str, version: int) -> None:
        self.loaded.append(("file", path))
        self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        self.loaded.append(("tensors", sorted(tensors)))
        self.version = version


def _bare_sampler(engine) -> Sampler:
    """A Sampler without sockets: only what ``_maybe_load_weights`` and ``version`` use."""
    s = Sampler.__new__(Sampler)
    s.engine, s.latest, s.torn, s.state, s.run_id = engine, None, False, "idle", "t"
    s.counters = {"weight_loads": 0}
    return s


def test_weights_load_by_format_and_a_torn_load_serves_nothing_until_the_next(monkeypatch):
    calls = []

    def torn_then_fine(engine, notice, run_id):
        calls.append(notice.version)
        engine.load_tensors({"w": None}, notice.version)  # the engine copied (a mix of two versions)...
        if len(calls) == 1:
            raise TornRead("rewritten during the copy")  # ...and the seqlock says so afterwards

    monkeypatch.setitem(RECEIVERS, "cuda_ipc", Receiver(cuda_ipc.FORMAT, cuda_ipc.SCHEME, torn_then_fine))
    s = _bare_sampler(_Engine())
    s.latest = WeightsReady(3, "file:///x.json", format="cuda_ipc")
    s._maybe_load_weights()
    assert s.torn and s.version() == -1 and s.engine.version == 3  # no request is served on the mix
    assert s.counters["torn_loads"] == 1 and s.latest is None
    s.latest = WeightsReady(4, "file:///y.json", format="cuda_ipc")
    s._maybe_load_weights()
    assert not s.torn and s.version() == 4 and s.counters["weight_loads"] == 1
    # an unknown format is refused (logged); the engine keeps its weights
    s.latest = WeightsReady(5, "file:///z", format="pickle")
    s._maybe_load_weights()
    assert s.version() == 4 and s.latest is None
    # cuda_ipc to an engine that loads files only: refused with what to change
    with pytest.raises(WeightsError, match="weights_transport=shm"):
        cuda_ipc.load(object(), WeightsReady(1, "file:///x.json", format="cuda_ipc"), "t")

"""The ``nccl`` weight transport (weights/nccl.py) with real processes: a trainer-side publisher here, samplers in
spawned processes with a real torch engine of the tiny model, gloo on the CPU. Bit-exact after many versions, two
samplers served by one broadcast, a late sampler served the newest version in a new group, a sampler that does not
ask delays no one, malformed requests refused with the thread still serving, an asker that never joins failing
its round only, a tiny launch (slow). On CUDA: the trainer's GPU weights staged on the host for gloo; NCCL itself
from cuda:0 to a sampler on cuda:1 (2 GPUs). In one process (options, refusals, headers, staging):
tests/test_nccl_checks.py.

    .venv/bin/pytest tests/test_nccl_weights.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import torch
import xxhash
import zmq
from transformers import AutoModelForCausalLM

from cascade_rl.protocol.codec import PROTOCOL_VERSION, decode, encode
from cascade_rl.protocol.messages import Ready, WeightsRefused
from cascade_rl.protocol.weights_group import WeightsGroup, WeightsJoin
from cascade_rl.weights.layout import named_tensors
from cascade_rl.weights.registry import TRANSPORTS, load

RUN = f"test-nccl-{uuid.uuid4().hex[:6]}"
GATHER_MS, TIMEOUT_S = 300, 10.0
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's bits, hashed (what crosses the pipe instead of the tensors)."""
    return {k: xxhash.xxh3_64(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()
            for k, t in state.items()}


def sampler(conn, model_path: str, device: str) -> None:
    """A sampler's seat: ("load", notice) -> the engine loads it by the registry; replies its version, the seconds
    it took and the digests of its weights in HF names (or the error); ("new",) -> a fresh engine (a restarted
    sampler: a new member id)."""
    torch.set_num_threads(1)
    import cascade_rl.weights.registry  # noqa: F401  (what the first load would import)
    from cascade_rl.samplers.torch_engine import TorchEngine

    def fresh():
        return TorchEngine(model_path, dtype="bfloat16", device=device)

    engine = fresh()
    conn.send("ready")  # imports and the engine done: asks now come within gather_ms of each other
    while (cmd := conn.recv()) is not None:
        try:
            if cmd[0] == "new":
                engine = fresh()
                conn.send("ok")
            elif cmd[0] == "load":
                t0 = time.monotonic()
                load(engine, cmd[1], RUN)
                conn.send({"version": engine.version, "seconds": time.monotonic() - t0,
                           "bits": digests(engine.model.hf_state_dict())})
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")


class Seat:
    """A sampler process and its pipe."""

    def __init__(self, model_path: str, device: str = "cpu") -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=sampler, args=(child, model_path, device), daemon=True)
        self.proc.start()

    def ready(self) -> None:
        assert self.reply(120) == "ready"

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def reply(self, timeout_s: float = 60.0):
        assert self.conn.poll(timeout_s), "the sampler process did not answer"
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def seats(tiny_model):
    pair = [Seat(tiny_model), Seat(tiny_model)]
    for s in pair:
        s.ready()
    yield pair
    for s in pair:
        s.close()


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).to(torch.bfloat16)


@pytest.fixture
def publisher():
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", host="127.0.0.1", gather_ms=GATHER_MS,
                           timeout_s=TIMEOUT_S, backend="gloo", chunk_mb=1)
    yield t
    t.close()


def step(model, seed: int) -> dict[str, str]:
    """Change every weight (as an optimizer step does); the digests of what the transport publishes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return digests(named_tensors(model)[0])


def served(reply, version: int, expected: dict[str, str]) -> None:
    assert isinstance(reply, dict), reply
    assert reply["version"] == version
    assert {k: reply["bits"][k] for k in expected} == expected  # tied lm_head: the engine has it under both names


def settled(t, rounds: int):
    """``t`` once its thread has finished ``rounds`` rounds (ok or failed): the receivers have their bytes a
    moment before the publisher's broadcast returns and its books are written."""
    deadline = time.monotonic() + 10
    while t.counts["rounds"] + t.counts["failed"] < rounds:
        assert time.monotonic() < deadline, f"{t.counts}: not {rounds} rounds"
        time.sleep(0.01)
    return t


def load_all(seats, notice, timeout_s: float = 60.0) -> list:
    for s in seats:
        s.send("load", notice)
    return [s.reply(timeout_s) for s in seats]


# --------------------------------------------------------------------------- samplers in other processes


def test_two_samplers_are_bit_exact_after_many_versions_each_served_by_one_broadcast(publisher, seats, model):
    for version in range(1, 5):
        expected = step(model, version)
        notice = publisher.publish(model, version)
        assert notice.format == "nccl" and notice.uri.endswith(f"/{version}?timeout=10")
        for reply in load_all(seats, notice):
            served(reply, version, expected)
        last = settled(publisher, version).last_round
        assert last["version"] == version and len(last["members"]) == 2
    assert publisher.counts == {"rounds": 4, "groups": 1, "failed": 0, "malformed": 0, "refused": 0}


def test_a_sampler_that_joins_later_gets_the_newest_version_in_a_new_group(publisher, seats, model):
    a, b = seats
    notice = publisher.publish(model, 1)
    served(load_all([a], notice)[0], 1, digests(named_tensors(model)[0]))
    old = publisher.publish(model, 2)
    expected = step(model, 30)
    newest = publisher.publish(model, 3)
    b.send("new")
    assert b.reply() == "ok"
    served(load_all([b], old)[0], 3, expected)  # asked for v2, broadcast v3: the engine says 3
    assert settled(publisher, 2).counts["groups"] == 2
    for reply in load_all(seats, newest):  # both at once: a group of the two, new again
        served(reply, 3, expected)
    assert settled(publisher, 3).counts["groups"] == 3 and publisher.last_round["new_group"]


def test_a_sampler_that_does_not_ask_does_not_block_the_others(publisher, seats, model):
    a, b = seats
    for reply in load_all(seats, publisher.publish(model, 1)):
        assert isinstance(reply, dict), reply
    expected = step(model, 40)
    notice = publisher.publish(model, 2)
    (alone,) = load_all([a], notice)  # b is busy generating: it never asks for v2
    served(alone, 2, expected)
    assert alone["seconds"] < TIMEOUT_S / 2  # served after gather_ms, not after b's timeout
    last = settled(publisher, 2).last_round
    assert last["new_group"] and len(last["members"]) == 1
    served(load_all([b], notice)[0], 2, expected)  # b asks later: its own round
    assert settled(publisher, 3).counts["failed"] == 0 and publisher.counts["groups"] == 3


def test_malformed_requests_are_refused_and_the_thread_keeps_serving(publisher, seats, model):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{publisher.port}")

    def ask(frames: list):
        dealer.send_multipart(frames)
        assert dealer.poll(5000), f"no answer to {frames}"
        return decode(dealer.recv_multipart(copy=False), (WeightsRefused, WeightsGroup))

    try:
        malformed = [[b"\x00garbage"], [b""], [b"one", b"two"], encode(Ready("w", "sampler", 1)),
                     [msgpack.packb({"t": "weights_join", "v": PROTOCOL_VERSION, "version": 1})],
                     encode(WeightsJoin(1, "no spaces allowed")), encode(WeightsJoin(-1, "m"))]
        for frames in malformed:
            reply = ask(frames)
            assert isinstance(reply, WeightsRefused) and reply.version == -1, (frames, reply)
            assert reply.reason.startswith("malformed request: "), reply.reason
        assert publisher.counts["malformed"] == len(malformed)
        nothing = ask(encode(WeightsJoin(1, "m")))
        assert isinstance(nothing, WeightsRefused) and "not published (nothing yet)" in nothing.reason
        expected = step(model, 50)
        notice = publisher.publish(model, 1)
        future = ask(encode(WeightsJoin(9, "m")))
        assert isinstance(future, WeightsRefused) and "version 9 is not published (v1)" in future.reason
        cannot = ask(encode(WeightsJoin(1, "m", backends=["nccl"])))
        assert isinstance(cannot, WeightsRefused) and "broadcasts over gloo, which the asker cannot" in cannot.reason
        assert publisher.counts["refused"] == 3
        for reply in load_all(seats, notice):  # the thread still serves
            served(reply, 1, expected)
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("ghost", ["silent", "gone"])
def test_an_asker_that_never_joins_fails_its_round_and_not_the_next(seats, model, ghost):
    """A member that asks, then never joins: told its rank and silent (the rendezvous times out), or gone before the
    round (its socket closed: the publisher does not even try). The others in that round get a WeightsError and
    keep their weights; the next round goes without it."""
    short = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", host="127.0.0.1", gather_ms=1000,
                               timeout_s=2.0, backend="gloo")  # both asks in one round, however slow the machine
    a = seats[0]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{short.port}")
    try:
        notice = short.publish(model, 1)
        dealer.send_multipart(encode(WeightsJoin(1, "ghost")))
        a.send("load", notice)
        if ghost == "gone":
            time.sleep(0.2)
            dealer.close(linger=0)
        else:
            assert dealer.poll(5000)
            told = decode(dealer.recv_multipart(copy=False), (WeightsGroup,))
            assert told.size == 3 and told.rank in (1, 2)  # in a's round; never joins
        failed = a.reply()
        assert isinstance(failed, str) and failed.startswith("WeightsError") and "broadcast failed" in failed
        served(load_all([a], notice)[0], 1, digests(named_tensors(model)[0]))
        assert settled(short, 2).counts["failed"] == 1 and len(short.last_round["members"]) == 1
        assert short.counts["groups"] == 1  # the failed round built none (gone) or failed building it (silent)
    finally:
        dealer.close(linger=0)
        short.close()


@pytest.mark.slow
def test_a_launch_with_the_nccl_transport(tiny_model, math_data, tmp_path):
    """The tiny run through every real process: the CPU trainer's versions broadcast over gloo to the sampler."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"run_dir={run_dir}",
                        f"model.path={tiny_model}", *math_data, "weights_transport=nccl",
                        "weights_options.nccl.host=127.0.0.1", "supervisor.progress=none"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, XDG_STATE_HOME=str(tmp_path)))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    log = (run_dir / "logs" / "sampler-0.log").read_text()
    assert "v1: received by gloo broadcast" in log and "cannot load weights" not in log


# --------------------------------------------------------------------------- CUDA


@needs_cuda
def test_gpu_weights_staged_on_the_host_for_gloo(seats, model):
    gpu_model = model.to("cuda")
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", host="127.0.0.1", gather_ms=GATHER_MS,
                           timeout_s=TIMEOUT_S, backend="gloo")
    try:
        expected = step(gpu_model, 60)
        for reply in load_all(seats, t.publish(gpu_model, 1)):
            served(reply, 1, expected)
    finally:
        t.close()
        model.to("cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the sampler on two GPUs")
def test_nccl_broadcast_from_cuda0_to_a_sampler_on_cuda1(tiny_model):
    gpu_model = AutoModelForCausalLM.from_pretrained(tiny_model).to("cuda:0", torch.bfloat16)
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", host="127.0.0.1", gather_ms=GATHER_MS,
                           timeout_s=30.0)  # auto: NCCL, the weights are on CUDA
    seat = Seat(tiny_model, "cuda:1")
    try:
        seat.ready()
        for version in (1, 2, 3):
            expected = step(gpu_model, 70 + version)
            served(load_all([seat], t.publish(gpu_model, version), 120)[0], version, expected)
        assert t.backend == "nccl" and settled(t, 3).counts["groups"] == 1
    finally:
        seat.close()
        t.close()

"""Weight transports end to end: a real tiny model published by ``shm`` and ``stream`` (ROUTER on
127.0.0.1), resolved and loaded in other processes (spawned, as samplers are), two at once; evicted
versions, bad checksums, dead publishers and malformed requests end in a ``WeightsError`` or a
refusal, and the stream server keeps serving through all of it."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import time
import uuid

import msgpack
import pytest
import torch
import zmq
from safetensors.torch import load_file, save_model

from cascade_rl.learner.weights import TRANSPORTS
from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.weights import (
    STREAM_PROTOCOL,
    WeightsError,
    file_checksum,
    receive_dir,
    resolve,
    shm_dir,
    stream_request,
)

RUN = f"test-wt-{uuid.uuid4().hex[:8]}"  # receivers' run id: files land in shm_dir(RUN)/stream-<pid>


def fetch(notice: WeightsReady, run_id: str, start_at: float = 0.0, timeout_s: float = 10.0):
    """In a sampler's seat: resolve ``notice`` and load the file; (path, tensors) or the error's text."""
    torch.set_num_threads(1)
    time.sleep(max(0.0, start_at - time.time()))  # line up concurrent fetchers
    try:
        path = resolve(notice, run_id, timeout_s)
    except WeightsError as e:
        return str(e)
    return path, load_file(path)


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def pool():
    with mp.get_context("spawn").Pool(2) as p:
        yield p
    shutil.rmtree(shm_dir(RUN), ignore_errors=True)  # pool workers exit without running atexit


def make(name: str, keep: int = 2):
    kwargs = {"endpoint": "tcp://127.0.0.1:0", "chunk_mb": 1} if name == "stream" else {}
    return TRANSPORTS[name](run_id=f"{RUN}-pub-{uuid.uuid4().hex[:8]}", keep=keep, **kwargs)


@pytest.fixture(params=["shm", "stream"])
def transport(request):
    t = make(request.param)
    yield t
    t.close()


def assert_same(loaded: dict[str, torch.Tensor], model) -> None:
    """Every tensor of the model's state dict is in the file (tied ones once) with equal values."""
    state = model.state_dict()
    assert set(loaded) <= set(state)
    assert {state[k].data_ptr() for k in loaded} == {t.data_ptr() for t in state.values()}  # tied: stored once
    for name, t in loaded.items():
        assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name


def test_two_fetchers_in_other_processes_load_the_published_tensors(transport, model, pool):
    notice = transport.publish(model, 1)
    assert notice.nbytes > 0 and len(notice.checksum) == 32
    start = time.time() + 1.0
    jobs = [pool.apply_async(fetch, (notice, RUN, start)) for _ in range(2)]
    results = [j.get(timeout=60) for j in jobs]
    for result in results:
        assert not isinstance(result, str), result
        assert_same(result[1], model)
    if notice.uri.startswith("stream"):
        assert results[0][0] != results[1][0]  # each process writes its own file


def test_both_transports_publish_the_same_file(model, tmp_path):
    shm, stream = make("shm"), make("stream")
    try:
        a, b = shm.publish(model, 3), stream.publish(model, 3)
        assert (a.nbytes, a.checksum) == (b.nbytes, b.checksum)
        save_model(model, str(tmp_path / "ref.safetensors"))  # byte for byte what safetensors writes
        assert file_checksum(tmp_path / "ref.safetensors") == a.checksum
        assert b.uri == f"stream+tcp://127.0.0.1:{stream.port}/3"
        path = resolve(b, RUN)
        assert file_checksum(path) == b.checksum
        # a full state dict in HF names (the distributed trainer's form): tied weights copied, same values
        c = stream.publish({k: v.detach().clone() for k, v in model.state_dict().items()}, 4)
        loaded = load_file(resolve(c, RUN))
        assert set(loaded) == set(model.state_dict())
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    finally:
        shm.close()
        stream.close()


def test_evicted_version_is_refused(transport, model, pool):
    notices = [transport.publish(model, v) for v in (1, 2, 3)]  # keep=2: v1 is evicted
    error = pool.apply(fetch, (notices[0], RUN))
    assert isinstance(error, str) and ("evicted" in error or "gone" in error), error
    with pytest.raises(WeightsError):
        resolve(notices[0], RUN)
    assert_same(load_file(resolve(notices[2], RUN)), model)


def test_bad_checksum_is_refused(transport, model):
    notice = transport.publish(model, 1)
    bad = WeightsReady(notice.version, notice.uri, notice.format, notice.nbytes, "0" * 32)
    with pytest.raises(WeightsError, match="checksum"):
        resolve(bad, RUN)
    assert not list(receive_dir(RUN).glob("*.tmp"))  # nothing half-verified left behind
    short = WeightsReady(notice.version, notice.uri, notice.format, notice.nbytes + 1, notice.checksum)
    with pytest.raises(WeightsError, match="bytes"):
        resolve(short, RUN)
    assert resolve(notice, RUN)  # the good notice still resolves


def test_stream_publisher_that_does_not_answer_times_out():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match="no reply"):
        resolve(WeightsReady(1, f"stream+tcp://127.0.0.1:{port}/1", nbytes=10, checksum="0" * 32), RUN, 0.3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(WeightsError, match="want stream"):
        resolve(WeightsReady(2, f"stream+tcp://127.0.0.1:{port}/1"), RUN, 0.3)


def test_stream_server_survives_malformed_requests(model, pool):
    stream = make("stream")
    try:
        notice = stream.publish(model, 1)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{stream.port}")
        bad = [
            [b"\x00garbage"],
            [b"one", b"two"],
            [msgpack.packb([1, 2, 3])],
            [msgpack.packb({"t": "weights_get", "v": STREAM_PROTOCOL + 1, "version": 1, "chunk": 0})],
            [msgpack.packb({"t": "weights_get", "v": STREAM_PROTOCOL, "version": "1", "chunk": 0})],
            [msgpack.packb({"t": "weights_get", "v": STREAM_PROTOCOL, "version": 1, "chunk": -1})],
            [stream_request(99, 0)],  # well-formed: a version never published
            [stream_request(1, 10**6)],  # well-formed: a chunk out of range
        ]
        for frames in bad:
            dealer.send_multipart(frames)
            assert dealer.poll(5000), f"no answer to {frames}"
            reply = dealer.recv_multipart()
            assert len(reply) == 1 and msgpack.unpackb(reply[0])["t"] == "weights_error"
        assert stream.malformed == 6
        # a fetcher that asks for chunks and vanishes before reading them
        for chunk in range(4):
            dealer.send(stream_request(1, chunk))
        dealer.close(linger=0)
        time.sleep(0.2)
        result = pool.apply(fetch, (notice, RUN))
        assert not isinstance(result, str), result
        assert_same(result[1], model)
    finally:
        stream.close()


def test_stream_uri_host():
    explicit = TRANSPORTS["stream"](run_id=RUN, endpoint="tcp://127.0.0.1:0", host="trainer-7")
    wildcard = TRANSPORTS["stream"](run_id=RUN)
    try:
        assert explicit.publish({"w": torch.ones(2)}, 1).uri == f"stream+tcp://trainer-7:{explicit.port}/1"
        assert wildcard.host in (socket.gethostname(), "127.0.0.1") and wildcard.port > 0
        assert resolve(wildcard.publish({"w": torch.ones(2)}, 5), RUN)  # reachable by that name
    finally:
        explicit.close()
        wildcard.close()


def test_stream_receiver_keeps_two_files_and_the_one_it_returns(model):
    stream = make("stream", keep=3)
    try:
        notices = [stream.publish({"w": torch.full((4,), float(v))}, v) for v in (1, 2, 3)]
        run = f"{RUN}-keep"  # a folder of its own: other tests' publishers reuse these version numbers
        paths = [resolve(n, run) for n in notices]
        assert sorted(p.name for p in receive_dir(run).glob("policy-v*")) == [
            "policy-v000002.safetensors", "policy-v000003.safetensors"]
        again = resolve(notices[0], run)  # an older version again: kept while it is the one returned
        assert again == paths[0] and torch.equal(load_file(again)["w"], torch.full((4,), 1.0))
    finally:
        stream.close()

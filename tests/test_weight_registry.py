"""The weight transports' registry (weights/registry.py): each name has both sides, a notice finds its receiver by
format and URI scheme (the errors name what is known), a second transport of a name or of a notice kind is refused;
and the trainer's weights PUB on its IO thread (weights/notices.py): what it is handed arrives at a SUB byte for
byte as ``send`` on the socket would put it, and a bind that fails raises in the caller."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from cascade_rl.protocol.codec import decode
from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.registry import Registry
from cascade_rl.weights import cuda_ipc, delta, nccl, nccl_receiver, registry, shm, stream
from cascade_rl.weights.common import WeightsError
from cascade_rl.weights.notices import NoticePublisher
from cascade_rl.weights.registry import RECEIVERS, TRANSPORTS, Receiver, receiver, resolve


def test_every_transport_registers_both_sides():
    assert TRANSPORTS == {"shm": shm.ShmTransport, "stream": stream.StreamTransport,
                          "cuda_ipc": cuda_ipc.CudaIpcTransport, "delta": delta.DeltaTransport,
                          "nccl": nccl.NcclTransport}
    assert sorted(RECEIVERS) == sorted(TRANSPORTS)
    assert RECEIVERS["shm"].resolve is shm.resolve and RECEIVERS["stream"].resolve is stream.resolve
    assert RECEIVERS["cuda_ipc"].load is cuda_ipc.load and RECEIVERS["cuda_ipc"].resolve is None
    assert RECEIVERS["delta"].load is delta.load and RECEIVERS["delta"].resolve is None  # it applies, not resolves
    assert RECEIVERS["nccl"].load is nccl_receiver.load and RECEIVERS["nccl"].resolve is None  # tensors, not a file


@pytest.mark.parametrize("notice, name", [
    (WeightsReady(1, "file:///dev/shm/x/policy-v000001.safetensors"), "shm"),
    (WeightsReady(1, "stream+tcp://host:5555/1"), "stream"),
    (WeightsReady(1, "file:///dev/shm/x/policy-v000001.cuda_ipc.json", format="cuda_ipc"), "cuda_ipc"),
    (WeightsReady(2, "delta+tcp://host:5555/2?base=1", format="delta"), "delta"),
    (WeightsReady(2, "nccl+tcp://host:5555/2?timeout=60", format="nccl"), "nccl"),
])
def test_a_notice_finds_its_transports_receiver(notice, name):
    assert receiver(notice) is RECEIVERS[name]


def test_notices_no_transport_sends_are_refused_with_what_is_known():
    with pytest.raises(WeightsError, match=r"format 'pickle' not supported; known: \['cuda_ipc', 'delta', 'nccl', 'safetensors'\]"):
        receiver(WeightsReady(1, "file:///x", format="pickle"))
    with pytest.raises(WeightsError, match=r"scheme not resolvable here; known: \['file', 'stream\+tcp'\]"):
        receiver(WeightsReady(1, "http://host/x"))
    with pytest.raises(WeightsError, match="format 'cuda_ipc' not supported"):  # no file to resolve
        resolve(WeightsReady(1, "file:///x.json", format="cuda_ipc"))


def test_a_second_transport_of_a_name_or_of_a_notice_kind_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "TRANSPORTS", Registry("weight transport"))
    monkeypatch.setattr(registry, "RECEIVERS", Registry("weight transport"))
    registry.register("shm", shm.ShmTransport, RECEIVERS["shm"])
    with pytest.raises(ValueError, match="'shm' registered twice"):
        registry.register("shm", shm.ShmTransport, Receiver("other", "other", registry.load_file))
    with pytest.raises(ValueError, match="another transport's"):
        registry.register("nfs", shm.ShmTransport, Receiver("safetensors", "file", registry.load_file))


def test_the_notice_publisher_sends_from_its_own_thread():
    notices = NoticePublisher("tcp://127.0.0.1:0", "trainer-t").start()
    try:
        endpoint = notices._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        assert notices._pub.getsockopt(zmq.LINGER) == 0
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(endpoint)
        try:
            notice = WeightsReady(3, "file:///dev/shm/x/policy-v000003.safetensors", nbytes=10, checksum="ab" * 16)
            deadline = time.monotonic() + 10
            while not sub.poll(100):  # a SUB joins a moment after connect: PUB drops what it sent before
                assert time.monotonic() < deadline, "no notice arrived"
                notices.send(notice)
            assert decode(sub.recv_multipart(copy=False), (WeightsReady,)) == notice
        finally:
            sub.close(linger=0)
        assert any(t.name == "trainer-t-weights-io" for t in threading.enumerate())
    finally:
        notices.close()


def test_a_notice_publisher_that_cannot_bind_raises_in_the_caller():
    first = NoticePublisher("tcp://127.0.0.1:0").start()
    try:
        taken = first._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        with pytest.raises(zmq.ZMQError):
            NoticePublisher(taken).start()
    finally:
        first.close()

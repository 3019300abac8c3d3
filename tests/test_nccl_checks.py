"""The ``nccl`` weight transport (weights/nccl.py, nccl_receiver.py) in one process: registered with its options,
notices it cannot honour and an ask nobody answers end in a WeightsError, headers that do not add up are refused,
staging buffers are reused but never one being broadcast, no thread outlives ``close``. With samplers in other
processes: tests/test_nccl_weights.py.

    .venv/bin/pytest tests/test_nccl_checks.py
"""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import zmq

from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.weights_group import WeightsGroup
from cascade_rl.supervisor.schema_weights import NcclOptions, WeightsOptions
from cascade_rl.weights import nccl, nccl_receiver
from cascade_rl.weights.common import WeightsError
from cascade_rl.weights.registry import RECEIVERS, TRANSPORTS, load, receiver

RUN = f"test-nccl-{uuid.uuid4().hex[:6]}"
STATE = {"w": torch.randn(64, 33).to(torch.bfloat16), "b": torch.arange(33, dtype=torch.int64)}


class NoEngine:
    """An engine the test never reaches (the receiver refuses before handing it anything)."""


# --------------------------------------------------------------------------- registry, options, refusals


def test_registered_with_its_options():
    assert TRANSPORTS["nccl"] is nccl.NcclTransport and RECEIVERS["nccl"].load is nccl_receiver.load
    assert receiver(WeightsReady(3, "nccl+tcp://h:1/3?timeout=60", format="nccl")) is RECEIVERS["nccl"]
    assert WeightsOptions().nccl == NcclOptions()
    for bad in ({"keep": 1}, {"backend": "mpi"}, {"timeout_s": 0}, {"gather_ms": -1}, {"chunk_mb": 0}):
        with pytest.raises(ValueError, match="weights_options.nccl"):
            NcclOptions(**bad)


def test_notices_it_cannot_honour_are_refused():
    with pytest.raises(WeightsError, match="LoRA"):
        load(NoEngine(), WeightsReady(1, "nccl+tcp://h:1/1?timeout=5", format="nccl", adapter={"r": 4}), RUN)
    with pytest.raises(WeightsError, match="want nccl"):
        load(NoEngine(), WeightsReady(2, "nccl+tcp://h:1/1?timeout=5", format="nccl"), RUN)


def test_an_ask_nobody_answers_times_out_with_a_weights_error():
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightsError, match=r"not served by 127.0.0.1:\d+ within 1s"):  # twice the URI's
            load(NoEngine(), WeightsReady(1, f"nccl+tcp://127.0.0.1:{port}/1?timeout=0.5", format="nccl"), RUN)
        assert time.monotonic() - t0 < 4
    finally:
        silent.close(linger=0)


def _group(header: bytes, nbytes: int = 16) -> WeightsGroup:
    return WeightsGroup(1, "h:1", "g", 1, 2, "gloo", nbytes, 8, "", np.frombuffer(header, np.uint8))


def _header(entries: dict) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("header, why", [
    (b"", "header refused"),
    (struct.pack("<Q", 10) + b"{", "header refused"),
    (_header({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}), "F99"),
    (_header({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), r"F32 \[3\] at \[0, 8\)"),
    (_header({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}), "of 16 bytes"),
    (_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}), r"at \[2, 6\)"),
    (_header({"w": {"dtype": "F32", "shape": [1]}}), "data_offsets"),
])
def test_a_header_that_does_not_add_up_is_refused(header, why):
    with pytest.raises(WeightsError, match=why):
        nccl_receiver.parse_header(_group(header))
    ok = _header({"__metadata__": {"a": "w"}, "w": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]}})
    assert nccl_receiver.parse_header(_group(ok)) == {"w": (torch.bfloat16, (2, 4), 0, 16)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_backend_nccl_without_cuda_is_refused_at_the_first_publish():
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", backend="nccl")
    try:
        with pytest.raises(WeightsError, match="backend=nccl needs CUDA"):
            t.publish(STATE, 1)
    finally:
        t.close()


def test_staging_buffers_are_reused_but_never_one_being_broadcast():
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", backend="gloo")
    try:
        ptrs = []
        for v in range(1, 5):
            t.publish(STATE, v)
            ptrs.append(t._newest.buf.data_ptr())
            assert len(t._staged) <= t.keep
        assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]  # two buffers, alternating
        busy = t._newest
        busy.busy = True  # v4 is being broadcast
        t.publish(STATE, 5)
        assert t._newest.buf.data_ptr() == ptrs[2]  # v3's buffer
        t.publish(STATE, 6)  # v4 busy, v5 the newest (the thread may start on it): a third buffer, v5's let go
        assert [s.version for s in t._staged] == [4, 6] and t._newest.buf.data_ptr() not in ptrs[:2]
        busy.busy = False
        t.publish(STATE, 7)
        assert t._newest.buf.data_ptr() == ptrs[1] and [s.version for s in t._staged] == [6, 7]  # v4's again
        data = t._newest.buf  # file order: the 8-byte ints first, then the bf16 weights
        assert torch.equal(data[: 33 * 8].view(torch.int64), STATE["b"])
        assert torch.equal(data[33 * 8 :].view(torch.bfloat16).reshape(64, 33), STATE["w"])
    finally:
        t.close()


def test_no_thread_is_left_behind():
    t = TRANSPORTS["nccl"](run_id=RUN, endpoint="tcp://127.0.0.1:0", backend="gloo")
    t.close()
    assert not any(th.name == "weights-nccl" for th in threading.enumerate())

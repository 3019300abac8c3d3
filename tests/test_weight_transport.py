"""Weight transports end to end: a real tiny model published by ``shm`` and ``stream`` (ROUTER on
127.0.0.1), resolved and loaded in other processes (spawned, as samplers are), two at once; evicted
versions, bad checksums, dead publishers and malformed requests end in a ``WeightsError`` or a
refusal, and the stream server keeps serving through all of it; the stream's messages are the codec's
(``WeightsGet``/``WeightsChunk``/``WeightsRefused``), read and written here on real sockets. ``cuda_ipc``: its tensor table,
double buffering, seqlock and refusals on the CPU; the handle opened in another process (bitwise),
a torn read across processes and the torch engine loading from the buffer on a GPU."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import xxhash
import zmq
from safetensors.torch import load_file, save_model
from transformers import AutoModelForCausalLM

from cascade_rl.protocol.codec import PROTOCOL_VERSION, decode, encode
from cascade_rl.protocol.messages import Ready, WeightsChunk, WeightsGet, WeightsReady, WeightsRefused
from cascade_rl.weights import cuda_ipc
from cascade_rl.weights.common import WeightsError, file_checksum, receive_dir, shm_dir
from cascade_rl.weights.layout import named_tensors
from cascade_rl.weights.registry import TRANSPORTS, resolve

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


def get(version: int, chunk: int) -> list:
    return encode(WeightsGet(version=version, chunk=chunk))


def dealer_to(port: int) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return dealer


def ask(dealer: zmq.Socket, frames: list):
    """Send ``frames`` to the publisher; its reply, decoded (a WeightsChunk or WeightsRefused)."""
    dealer.send_multipart(frames)
    assert dealer.poll(5000), f"no answer to {frames}"
    return decode(dealer.recv_multipart(copy=False), (WeightsChunk, WeightsRefused))


def test_stream_server_survives_malformed_requests(model, pool):
    stream = make("stream")
    try:
        notice = stream.publish(model, 1)
        dealer = dealer_to(stream.port)
        malformed = [
            [b"\x00garbage"],
            [b""],
            [b"one", b"two"],
            [msgpack.packb([1, 2, 3])],
            encode(Ready(worker_id="w", role="sampler", slots=1)),  # valid, but not a request of this socket
            [*get(1, 0), b"extra"],  # a frame nothing references
            [msgpack.packb({"t": "weights_get", "v": PROTOCOL_VERSION + 1, "version": 1, "chunk": 0})],
            [msgpack.packb({"t": "weights_get", "v": PROTOCOL_VERSION, "version": "1", "chunk": 0})],
            [msgpack.packb({"t": "weights_get", "v": PROTOCOL_VERSION, "version": 1})],
            get(1, -1),  # validate: chunk >= 0
            get(-3, 0),
        ]
        for frames in malformed:
            reply = ask(dealer, frames)
            assert isinstance(reply, WeightsRefused) and reply.version == -1, (frames, reply)
            assert reply.reason.startswith("malformed request: "), reply.reason
        assert stream.malformed == len(malformed)
        assert "unexpected message type 'ready'" in ask(dealer, encode(Ready("w", "sampler", 1))).reason
        # well-formed requests it cannot serve: refused with the reason, not counted as malformed
        never = ask(dealer, get(99, 0))
        assert isinstance(never, WeightsRefused) and never.version == 99 and "not served" in never.reason
        far = ask(dealer, get(1, 10**6))
        assert isinstance(far, WeightsRefused) and far.version == 1 and "out of range" in far.reason
        assert stream.malformed == len(malformed) + 1
        assert isinstance(ask(dealer, get(1, 0)), WeightsChunk)  # the same connection is still served
        # a fetcher that asks for chunks and vanishes before reading them
        for chunk in range(4):
            dealer.send_multipart(get(1, chunk))
        dealer.close(linger=0)
        time.sleep(0.2)
        result = pool.apply(fetch, (notice, RUN))
        assert not isinstance(result, str), result
        assert_same(result[1], model)
    finally:
        stream.close()


def test_stream_round_trip_through_the_codec():
    """Chunks read by hand over a DEALER are ``WeightsChunk`` messages whose data frames, in order, are the
    file; ``resolve`` writes the same file (its checksum the notice's), with or without a checksum in the
    notice (then the publisher's is checked)."""
    weights = {"a": torch.arange(600_000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    stream = make("stream")  # 1 MiB chunks: this file is 3 of them
    try:
        notice = stream.publish(weights, 2)
        dealer = dealer_to(stream.port)
        try:
            first = ask(dealer, get(2, 0))
            assert isinstance(first, WeightsChunk) and first.chunks == 3 and first.nbytes == notice.nbytes
            assert first.checksum == notice.checksum and first.data.dtype == np.uint8 and len(first.data) == 1 << 20
            parts = [first.data.tobytes()] + [ask(dealer, get(2, i)).data.tobytes() for i in (1, 2)]
        finally:
            dealer.close(linger=0)
        assert len(parts[2]) == notice.nbytes - (2 << 20)
        assert xxhash.xxh3_128_hexdigest(b"".join(parts)) == notice.checksum
        path = resolve(notice, RUN)
        assert Path(path).read_bytes() == b"".join(parts) and file_checksum(path) == notice.checksum
        bare = WeightsReady(notice.version, notice.uri)  # no size, no checksum: the publisher's are checked
        assert file_checksum(resolve(bare, RUN)) == notice.checksum
        assert torch.equal(load_file(path)["a"], weights["a"])
    finally:
        stream.close()


class FakePublisher:
    """A ROUTER on 127.0.0.1 that answers each request with ``answer(request) -> frames``, in a thread."""

    def __init__(self, answer) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.answer, self.requests = answer, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                identity, *frames = self.sock.recv_multipart()
                request = decode(frames, (WeightsGet,))
                self.requests.append(request)
                self.sock.send_multipart([identity, *self.answer(request)])

    def notice(self, version: int = 5) -> WeightsReady:
        return WeightsReady(version, f"stream+tcp://127.0.0.1:{self.port}/{version}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


def chunk_of(request: WeightsGet, **kw) -> list:
    fields = dict(version=request.version, chunk=request.chunk, chunks=2, nbytes=8, checksum="0" * 32,
                  data=np.arange(4, dtype=np.uint8))
    return encode(WeightsChunk(**(fields | kw)))


@pytest.mark.parametrize("answer, match", [
    (lambda r: encode(WeightsRefused(version=r.version, reason="the trainer is shutting down")),
     r"^weights v5: publisher refused: the trainer is shutting down$"),
    (lambda r: [b"\xc1"], "malformed reply: header is not msgpack"),
    (lambda r: encode(Ready(worker_id="x", role="sampler", slots=1)), "malformed reply: unexpected message type"),
    (lambda r: chunk_of(r, chunk=2), "malformed reply: weights_chunk: chunk 2 of 2"),  # validate
    (lambda r: [chunk_of(r)[0]], "malformed reply: weights_chunk.data"),  # the data frame missing
    (lambda r: chunk_of(r, version=4), "sent v4 chunk 0, expected v5 chunk 0"),
    (lambda r: chunk_of(r, chunk=1 - r.chunk), "sent v5 chunk 1, expected v5 chunk 0"),
    (lambda r: chunk_of(r, data=np.arange(3, dtype=np.uint8)), "6 bytes, publisher says 8"),
])
def test_stream_receiver_turns_bad_replies_into_weights_errors(answer, match):
    """What a publisher answers that is not the chunk asked for ends the fetch with a WeightsError saying what,
    and leaves no partial file behind."""
    with FakePublisher(answer) as pub:
        with pytest.raises(WeightsError, match=match):
            resolve(pub.notice(), RUN, timeout_s=5.0)
        assert pub.requests and pub.requests[0] == WeightsGet(version=5, chunk=0)
    assert not list(receive_dir(RUN).glob("*.tmp"))


def test_stream_receiver_accepts_a_well_formed_publisher():
    """The fake publisher, answering correctly, yields the file: the receiver needs nothing but the codec's
    messages (the window: both chunks are asked for before the second reply)."""
    data = bytes(range(8))
    checksum = xxhash.xxh3_128_hexdigest(data)

    def answer(r: WeightsGet) -> list:
        part = np.frombuffer(data, np.uint8)[r.chunk * 4 : r.chunk * 4 + 4]
        return encode(WeightsChunk(version=r.version, chunk=r.chunk, chunks=2, nbytes=8, checksum=checksum, data=part))

    with FakePublisher(answer) as pub:
        path = resolve(pub.notice(), RUN, timeout_s=5.0)
        assert [r.chunk for r in pub.requests] == [0, 1]
    assert Path(path).read_bytes() == data


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


# --------------------------------------------------------------------------- cuda_ipc
# On the CPU, the transport and the receiver run for real except the two CUDA IPC calls (share a buffer's
# storage, open it in another process), replaced by a registry of this process's storages: the layout, the
# sidecar, the tensor table, double buffering and the seqlock are the code a GPU runs. The tests that need a
# GPU (the handle opened in another process, bitwise; a torn read across processes; the torch engine loading
# from the buffer) skip without one.

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="cuda_ipc shares GPU memory between processes: needs a CUDA device")
_SHARED: dict[str, torch.UntypedStorage] = {}


def share_here(storage: torch.UntypedStorage) -> dict:
    """The CPU stand-in for ``share_storage``: the handle is a key into this process's registry."""
    key = uuid.uuid4().hex
    _SHARED[key] = storage
    return {"key": key}


def open_here(sidecar: dict) -> torch.Tensor:
    """The CPU stand-in for ``open_buffer``."""
    storage = _SHARED[sidecar["handle"]["key"]]
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def ipc_transport(**kwargs):
    return TRANSPORTS["cuda_ipc"](run_id=f"{RUN}-ipc-{uuid.uuid4().hex[:8]}", **kwargs)


def bitwise(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def versioned(v: int) -> dict[str, torch.Tensor]:
    """A state dict whose every value says which version it is (several dtypes, a scalar, an empty tensor)."""
    return {"w": torch.full((3, 4), float(v)), "b": torch.full((5,), v, dtype=torch.int64),
            "h": torch.full((7,), v, dtype=torch.bfloat16), "s": torch.tensor(float(v)), "e": torch.zeros(0, 2)}


def test_cuda_ipc_tensor_table_is_the_safetensors_layout(model):
    """The buffer holds the bytes of the file's data section: the sidecar's table is the file's header, and the
    views read back every tensor the file holds (tied weights once), bitwise."""
    ipc, shm = ipc_transport(share=share_here), make("shm")
    try:
        notice, file_notice = ipc.publish(model, 1), shm.publish(model, 1)
        path = file_notice.uri[len("file://"):]
        with open(path, "rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(header_len))
        sidecar_bytes = open(notice.uri[len("file://"):], "rb").read()
        sidecar = json.loads(sidecar_bytes)
        assert notice.format == "cuda_ipc" and notice.checksum == xxhash.xxh3_128_hexdigest(sidecar_bytes)
        assert sidecar["tensors"] == {k: v for k, v in header.items() if k != "__metadata__"}
        assert sidecar["metadata"] == header.get("__metadata__", {})
        assert notice.nbytes == file_notice.nbytes - 8 - header_len  # the file less its header
        loaded = load_file(path)
        with cuda_ipc.reading(notice, open_here) as tensors:
            assert set(tensors) == set(loaded)
            for name, t in tensors.items():
                assert t.dtype == loaded[name].dtype and t.shape == loaded[name].shape
                assert bitwise(t) == bitwise(loaded[name]), name
    finally:
        ipc.close()
        shm.close()


def test_cuda_ipc_double_buffers_and_retires_replaced_versions():
    ipc = ipc_transport(share=share_here)
    try:
        notices = [ipc.publish(versioned(v), v) for v in (1, 2, 3)]  # v1 -> buffer 1, v2 -> 0, v3 -> 1 again
        assert [json.loads(open(n.uri[7:]).read())["buffer"] for n in notices[1:]] == [0, 1]
        with pytest.raises(WeightsError, match="gone"):
            cuda_ipc.open_weights(notices[0], open_here)  # its buffer now holds v3
        for n, v in zip(notices[1:], (2, 3), strict=True):
            tensors = cuda_ipc.open_weights(n, open_here)
            assert all(bitwise(tensors[k]) == bitwise(x) for k, x in versioned(v).items())
        assert cuda_ipc.read_seq(cuda_ipc.seq_path(ipc.dir, 1)) == cuda_ipc.holding(3)
        assert cuda_ipc.read_seq(cuda_ipc.seq_path(ipc.dir, 0)) == cuda_ipc.holding(2)
        assert sorted(p.name for p in ipc.dir.glob("*.json")) == [
            "policy-v000002.cuda_ipc.json", "policy-v000003.cuda_ipc.json"]
        # other weights (another layout): new buffers, new handles; what the old ones held is withdrawn
        old_handle = json.loads(open(notices[2].uri[7:]).read())["handle"]
        v4 = ipc.publish({"x": torch.arange(6.0)}, 4)
        assert json.loads(open(v4.uri[7:]).read())["handle"] != old_handle
        assert [p.name for p in ipc.dir.glob("*.json")] == ["policy-v000004.cuda_ipc.json"]
        with pytest.raises(WeightsError):
            cuda_ipc.open_weights(notices[2], open_here)
        assert bitwise(cuda_ipc.open_weights(v4, open_here)["x"]) == bitwise(torch.arange(6.0))
    finally:
        ipc.close()
    assert not ipc.dir.exists()


def test_cuda_ipc_torn_read_is_refused_and_the_other_buffer_is_not():
    ipc = ipc_transport(share=share_here)
    try:
        v1, v2 = ipc.publish(versioned(1), 1), ipc.publish(versioned(2), 2)
        with pytest.raises(cuda_ipc.TornRead, match="rewritten during the copy"):
            with cuda_ipc.reading(v1, open_here) as tensors:
                copy = {k: t.clone() for k, t in tensors.items()}
                v3 = ipc.publish(versioned(3), 3)  # the trainer reuses buffer 1 while a sampler copies v1
        assert bitwise(copy["w"]) == bitwise(versioned(1)["w"])  # (here the copy came first; on a GPU it may not)
        with cuda_ipc.reading(v2, open_here) as tensors:  # double buffering: v3 went to the other buffer
            ipc.publish(versioned(3), 3)
            assert bitwise(tensors["h"]) == bitwise(versioned(2)["h"])
        with cuda_ipc.reading(v3, open_here) as tensors:
            assert bitwise(tensors["b"]) == bitwise(versioned(3)["b"])
    finally:
        ipc.close()


def test_cuda_ipc_seqlock_is_checked_before_the_copy():
    """A buffer marked "writing" (odd), or holding another version, refuses before anything is copied: a plain
    WeightsError (the engine was not touched), not a TornRead."""
    ipc = ipc_transport(share=share_here)
    try:
        notice = ipc.publish(versioned(1), 1)
        seq = cuda_ipc.seq_path(ipc.dir, 1)
        cuda_ipc.write_seq(seq, cuda_ipc.writing(3))
        with pytest.raises(WeightsError, match="version 3 being written") as e:
            cuda_ipc.open_weights(notice, open_here)
        assert not isinstance(e.value, cuda_ipc.TornRead)
        cuda_ipc.write_seq(seq, cuda_ipc.holding(3))
        with pytest.raises(WeightsError, match="now holds version 3"):
            cuda_ipc.open_weights(notice, open_here)
        seq.unlink()
        with pytest.raises(WeightsError, match="holds nothing"):
            cuda_ipc.open_weights(notice, open_here)
    finally:
        ipc.close()


def test_cuda_ipc_refuses_bad_notices_and_sidecars():
    ipc = ipc_transport(share=share_here)
    try:
        notice = ipc.publish(versioned(1), 1)
        path = Path(notice.uri[len("file://"):])
        for bad, match in [
            (WeightsReady(1, notice.uri, "cuda_ipc", notice.nbytes, "0" * 32), "checksum"),
            (WeightsReady(2, notice.uri, "cuda_ipc", notice.nbytes), "notice says v2"),
            (WeightsReady(1, notice.uri, "cuda_ipc", notice.nbytes + 1), "bytes"),
            (WeightsReady(1, notice.uri, "safetensors", notice.nbytes), "not a cuda_ipc notice"),
        ]:
            with pytest.raises(WeightsError, match=match):
                cuda_ipc.open_weights(bad, open_here)
        sidecar = json.loads(path.read_text())
        for change, match in [({"protocol": 99}, "protocol 99"), ({"seq_file": "../x.seq"}, "bad seq_file"),
                              ({"tensors": {"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}},
                               "does not fit"),
                              ({"tensors": {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}}, "bad entry")]:
            path.write_text(json.dumps(sidecar | change))
            with pytest.raises(WeightsError, match=match):
                cuda_ipc.open_weights(WeightsReady(1, notice.uri, "cuda_ipc"), open_here)
        # the default share refuses CPU memory with what to change
        default = ipc_transport()
        with pytest.raises(WeightsError, match="gpus.trainer"):
            default.publish(versioned(1), 1)
        default.close()
    finally:
        ipc.close()


def test_cuda_ipc_handle_encoding_round_trips_and_refuses_other_shapes():
    # the 8 values of UntypedStorage._share_cuda_(), typed as torch 2.11-2.13 return them
    values = (0, b"\x02c" + bytes(range(64)), 1 << 30, 512, b"/torch_123_456_0", 3, bytes(64), True)
    encoded = cuda_ipc.encode_handle(values)
    assert json.loads(json.dumps(encoded)) == encoded  # primitives only
    assert cuda_ipc.decode_handle(encoded) == values
    for bad in [values[:7], (*values[:2], "1024", *values[3:]), (*values[:7], 1), (True, *values[1:]),
                (*values[:6], None, True)]:
        with pytest.raises(WeightsError, match=r"expected \('int', 'bytes', 'int', 'int', 'bytes', 'int', 'bytes'"):
            cuda_ipc.encode_handle(bad)
    for broken in [{k: v for k, v in encoded.items() if k != "ref_counter"}, encoded | {"handle": "zz"},
                   encoded | {"size": 1.5}]:
        with pytest.raises(WeightsError):
            cuda_ipc.decode_handle(broken)
    assert cuda_ipc.same_torch("2.11.0+cu130", "2.11.1") and not cuda_ipc.same_torch("2.11.0", "2.13.0+cpu")
    with pytest.raises(WeightsError, match="gpus.trainer"):
        cuda_ipc.share_storage(torch.UntypedStorage(8))


def test_cuda_ipc_views_match_the_table_byte_for_byte():
    buf = torch.arange(64, dtype=torch.uint8)
    table = {"a": {"dtype": "I32", "shape": [2, 2], "data_offsets": [0, 16]},
             "b": {"dtype": "BF16", "shape": [], "data_offsets": [16, 18]},
             "c": {"dtype": "U8", "shape": [0], "data_offsets": [18, 18]}}
    out = cuda_ipc.views(buf, table, 18)
    assert out["a"].shape == (2, 2) and bitwise(out["a"]) == bytes(range(16))
    assert out["b"].shape == () and bitwise(out["b"]) == bytes([16, 17])
    assert out["a"].data_ptr() == buf.data_ptr()  # views, not copies
    with pytest.raises(WeightsError, match="buffer has 64 bytes"):
        cuda_ipc.views(buf, table, 65)
    with pytest.raises(WeightsError, match="does not fit"):  # misaligned for its dtype
        cuda_ipc.views(buf, {"a": {"dtype": "I32", "shape": [1], "data_offsets": [2, 6]}}, 64)


# --- on a GPU: the trainer in this process, the sampler in another (spawned, as samplers are)


def ipc_sampler(conn, model_path: str) -> None:
    """In a sampler's seat on the same GPU. Commands over ``conn``: ("load", notice) -> name -> bytes;
    ("hold", notice) -> copy inside ``reading``, reply "copied", wait for "release", reply "ok" or the
    error; ("engine", notice, path) -> the torch engine loads the notice, then the file at ``path``: are its
    parameters bitwise the same both ways?"""
    torch.set_num_threads(1)
    engine = None
    while (cmd := conn.recv()) is not None:
        try:
            if cmd[0] == "load":
                with cuda_ipc.reading(cmd[1]) as tensors:
                    conn.send({k: bitwise(t) for k, t in tensors.items()})
            elif cmd[0] == "hold":
                with cuda_ipc.reading(cmd[1]) as tensors:
                    copy = {k: t.clone() for k, t in tensors.items()}
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()  # the copy is done before the trainer is let go
                    conn.send("copied")
                    assert conn.recv() == ("release",)
                del copy
                conn.send("ok")
            elif cmd[0] == "engine":
                from cascade_rl.samplers.torch_engine import TorchEngine

                engine = engine or TorchEngine(model_path, dtype="bfloat16", device="cuda")
                cuda_ipc.load(engine, cmd[1], "")
                via_ipc = {n: bitwise(p) for n, p in engine.model.named_parameters()}
                engine.load_weights(cmd[2], cmd[1].version)
                conn.send(engine.version == cmd[1].version and via_ipc == {
                    n: bitwise(p) for n, p in engine.model.named_parameters()})
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")


@pytest.fixture
def gpu_sampler(tiny_model):
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=ipc_sampler, args=(child_conn, tiny_model), daemon=True)
    proc.start()

    def ask(*cmd, timeout_s: float = 120.0):
        conn.send(cmd)
        assert conn.poll(timeout_s), f"the sampler process did not answer {cmd[0]}"
        return conn.recv()

    yield ask
    conn.send(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@needs_cuda
def test_cuda_ipc_loads_bitwise_in_another_process(tiny_model, gpu_sampler):
    gpu_model = AutoModelForCausalLM.from_pretrained(tiny_model).to("cuda", torch.bfloat16)
    ipc, shm = ipc_transport(), make("shm")
    try:
        for v in (1, 2, 3):  # both buffers, then the first one again (opened once, reused)
            with torch.no_grad():
                for p in gpu_model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            notice = ipc.publish(gpu_model, v)
            got = gpu_sampler("load", notice)
            assert isinstance(got, dict), got
            expected, _ = named_tensors(gpu_model)
            assert got == {k: bitwise(t) for k, t in expected.items()}, f"v{v} differs"
        # a state dict of several dtypes on the GPU
        state = {k: t.cuda() for k, t in versioned(7).items()}
        got = gpu_sampler("load", ipc.publish(state, 4))
        assert got == {k: bitwise(t) for k, t in state.items()}
        # the torch engine applies it as it applies the same weights from a file
        ok = gpu_sampler("engine", ipc.publish(gpu_model, 5), shm.publish(gpu_model, 5).uri[len("file://"):])
        assert ok is True, ok
    finally:
        ipc.close()
        shm.close()


@needs_cuda
def test_cuda_ipc_torn_read_across_processes(gpu_sampler):
    ipc = ipc_transport()
    try:
        v1 = ipc.publish({k: t.cuda() for k, t in versioned(1).items()}, 1)
        v2 = ipc.publish({k: t.cuda() for k, t in versioned(2).items()}, 2)
        assert gpu_sampler("hold", v1) == "copied"
        v3 = ipc.publish({k: t.cuda() for k, t in versioned(3).items()}, 3)  # buffer 1 again, mid-copy
        reply = gpu_sampler("release")
        assert isinstance(reply, str) and reply.startswith("TornRead"), reply
        assert gpu_sampler("hold", v2) == "copied"
        assert gpu_sampler("release") == "ok"  # v3 went to the other buffer
        assert "gone" in gpu_sampler("load", v1)
        got = gpu_sampler("load", v3)
        assert got == {k: bitwise(t) for k, t in versioned(3).items()}
    finally:
        ipc.close()


def test_device_path_through_the_reused_staging_buffers_publishes_the_same_bytes(model, monkeypatch):
    """The pinned staging path (device tensors, here CPU ones forced through it): small chunks, two buffers reused
    while the checksum thread still hashes, and both transports publish save_model's file byte for byte; at most
    ``keep`` files are in the run's folder, the one being written included."""
    from cascade_rl.weights import shm as shm_module
    from cascade_rl.weights.layout import Staging

    big = {"a.weight": torch.randn(1024, 300), "b.weight": torch.randn(7, 5), "c.bias": torch.randn(70000)}
    shm, stream = make("shm"), make("stream")
    try:
        for t in (shm, stream):
            t._staging = Staging(chunk=1 << 16, copy_cpu=True)  # 64 KiB: every tensor in several chunks
        direct = make("shm")
        try:
            expected = direct.publish(big, 1)
            tied = direct.publish(model, 2)
        finally:
            direct.close()
        for t in (shm, stream):
            got = t.publish(big, 1)
            assert (got.nbytes, got.checksum) == (expected.nbytes, expected.checksum)
            assert t.publish(model, 2).checksum == tied.checksum
        assert shm._staging._buffers and all(len(b) == 1 << 16 for b in shm._staging._buffers)
        seen = []
        real_replace = shm_module.os.replace

        def spy(src, dst):  # the moment the new file is committed: how many files the folder holds
            seen.append(len(list(shm.dir.iterdir())))
            real_replace(src, dst)

        monkeypatch.setattr(shm_module.os, "replace", spy)
        for v in (3, 4, 5):
            shm.publish(big, v)
        monkeypatch.undo()
        assert seen == [2, 2, 2]  # keep=2: the newest previous version and the one being written
        assert sorted(p.name for p in shm.dir.iterdir()) == ["policy-v000004.safetensors", "policy-v000005.safetensors"]
    finally:
        shm.close()
        stream.close()


@needs_cuda
def test_a_gpu_model_publishes_the_cpu_models_bytes_through_pinned_buffers(model):
    """On a GPU: the trainer's model on CUDA (bf16, as a GPU run holds it) reaches the file through the pinned
    staging buffers, and both transports publish exactly the bytes of the same weights on the CPU."""
    import copy

    cpu = copy.deepcopy(model).to(torch.bfloat16)
    gpu = copy.deepcopy(cpu).to("cuda")
    direct = make("shm")
    try:
        expected = direct.publish(cpu, 1)
    finally:
        direct.close()
    for name in ("shm", "stream"):
        t = make(name)
        try:
            got = t.publish(gpu, 1)
            assert (got.nbytes, got.checksum) == (expected.nbytes, expected.checksum), name
            assert t._staging._buffers and all(b.is_pinned() for b in t._staging._buffers), "staging buffers must be page-locked on CUDA"
        finally:
            t.close()

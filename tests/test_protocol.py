"""Wire codec: round trips, ZeroMQ zero-copy, rejection of malformed frames, mutation fuzzing."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from cascade_rl.protocol import codec
from cascade_rl.protocol.agents import (
    AgentDone,
    AgentRequest,
    GatewayEnded,
    GatewayGenerate,
    GatewayRefused,
    GatewayReward,
)
from cascade_rl.protocol.codec import MAX_HEADER_BYTES, PROTOCOL_VERSION, ProtocolError, decode, encode
from cascade_rl.protocol.messages import (
    Control,
    ControlReply,
    EnvReply,
    EnvRequest,
    GroupScoreRequest,
    Heartbeat,
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    StepDone,
    TeacherLogprobs,
    TeacherRequest,
    TrainBatch,
    WeightsChunk,
    WeightsGet,
    WeightsReady,
    WeightsRefused,
    WorkKey,
)
from cascade_rl.protocol.weights_group import WeightsGroup, WeightsJoin

K = WorkKey.score("k", 0, 0)  # a key for messages whose key does not matter

# --------------------------------------------------------------------------- helpers


def _train_batch(n: int = 4, length: int = 6, group_size: int = 2, teacher: bool = True, seed: int = 0) -> TrainBatch:
    """``n`` rows of ``length`` tokens (row 0 one shorter), packed: 4 x 6 - 1 = 23 tokens by default."""
    rng = np.random.default_rng(seed)
    lengths = np.full(n, length, np.int32)
    if n:
        lengths[0] -= 1  # one shorter row
    tokens = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if n else np.zeros(0, int)
    mask = np.zeros(tokens, dtype=bool)
    for start, size in zip(starts, lengths):
        mask[start + length // 2 : start + size] = True  # the second half of each row: its response
    return TrainBatch(
        step=17,
        group_size=group_size,
        input_ids=rng.integers(0, 151_936, size=tokens, dtype=np.int32),
        response_mask=mask,
        inf_logprobs=-rng.random(tokens, dtype=np.float32) * 5,
        rewards=np.array([1.0, 0.0, 0.5, -1.0][:n] + [0.25] * max(0, n - 4), dtype=np.float32),
        versions=np.arange(n, dtype=np.int32) + 40,
        lengths=lengths,
        teacher_logprobs=(-rng.random(tokens, dtype=np.float32)) if teacher else None,
        loss_masked=(np.arange(n) % 3 == 0) if teacher else None,
        routes=rng.integers(-1, 128, size=(tokens, 3, 8), dtype=np.int16) if teacher else None,  # R3
        part=1 if teacher else 0, last=not teacher, step_groups=8 if teacher else 0,  # a step's second part of several
    )


def _rollout(n_prompt: int = 9, n_resp: int = 5, **kw: Any) -> Rollout:
    fields: dict[str, Any] = dict(
        key=WorkKey.sample("g-000042", 1).answer(3),
        domain="math",
        prompt_ids=np.arange(100, 100 + n_prompt, dtype=np.int32),
        response_ids=np.arange(7, 7 + n_resp, dtype=np.int32) * 11,
        inf_logprobs=np.linspace(-3.0, 0.0, n_resp, dtype=np.float32),
        finish_reason="length",
        policy_version=12,
        sampler_id="sampler-1",
        t_gen=0.731,
        error="",
    )
    fields.update(kw)
    return Rollout(**fields)


def _teacher_request(lens: tuple[int, ...] = (3, 1, 4), **kw: Any) -> TeacherRequest:
    fields: dict[str, Any] = dict(
        key=WorkKey.teacher("g-7", 0),
        domain="math",
        prompt_ids=np.array([151644, 872, 198, 3838], dtype=np.int32),
        response_lens=np.array(lens, dtype=np.int32),
        temperature=0.7,
        deadline_s=30.0,
    )
    fields.update(kw)
    if "response_ids" not in fields:
        fields["response_ids"] = np.arange(sum(lens), dtype=np.int32) + 500
    return TeacherRequest(**fields)


def sample_messages() -> list[Any]:
    """Realistic instances covering every registered type, with edge cases."""
    return [
        Ready(worker_id="sampler-0", role="sampler", slots=8, version=3, domains=[]),
        Ready(worker_id="verifier-2", role="verifier", slots=0, domains=["math", "code", "ifeval"]),
        Ready(worker_id="trainer-0.rank1", role="trainer", slots=1, version=7, rank=1),  # a trainer's second rank
        PromptRequest(
            key=WorkKey.sample("g-1", 2),
            domain="math",
            prompt_ids=np.array([151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30], dtype=np.int32),
            n=8,
            sampling=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512, stop=["</answer>", "\n\n"], seed=1234),
            min_version=5,
        ),
        PromptRequest(key=WorkKey.sample("g-empty", 0), domain="code", prompt_ids=np.array([], np.int32)),  # 0-length
        _rollout(),
        _rollout(n_resp=0, finish_reason="error", error="CUDA OOM"),  # 0-length arrays
        _rollout(n_resp=3, finish_reason="error", inf_logprobs=np.zeros(0, dtype=np.float32), error="killed"),
        _rollout(inf_logprobs=np.array([-np.inf, -0.0, np.nan, 1e-30, -1e30], dtype=np.float32)),  # special floats
        _rollout(key=WorkKey.step("g-1", 3, "gen", 2, 0),
                 loss_mask=np.array([True, True, False, False, True])),  # a multi-turn trajectory
        _rollout(routes=np.arange(13 * 48 * 8, dtype=np.int16).reshape(13, 48, 8) % 128),  # R3: 48 layers, top-8
        PromptRequest(key=WorkKey.step("g-1", 3, "gen", 2, 1), domain="tool_use",
                      prompt_ids=np.arange(12, dtype=np.int32), n=1, keep=True),  # a multi-turn row's next turn
        EnvRequest(key=WorkKey.step("g-1", 3, "env", 1, 0), env="python", domain="tool_use",
                   messages=[{"role": "user", "content": "2*3?"},
                             {"role": "assistant", "content": '<tool_call>{"name": "python"}</tool_call>'}],
                   state={"cells": ["x = 1"]}, metadata={"k": 1}, deadline_s=30.0),
        EnvReply(key=WorkKey.step("g-1", 3, "env", 1, 0), done=False, tool_messages=[{"role": "tool", "content": "6\n"}],
                 state={"cells": ["x = 1", "print(2*3)"]}, tool_calls=1, worker_id="environment-0", t_env=0.2),
        EnvReply(key=WorkKey.step("g-1", 3, "env", 2, 0), done=True),
        EnvReply(key=WorkKey.step("g-1", 3, "env", 2, 1), done=False, ok=False, error="no environment 'pythn'"),
        # users' agents (protocol/agents.py)
        AgentRequest(key=WorkKey("g-1", "agent", 3, 0, 1), domain="math",
                     row={"id": "r7", "messages": [{"role": "user", "content": "2*3?"}], "answer": "6", "metadata": {}},
                     base_url="http://127.0.0.1:8000/v1", api_key="cr-g-1.3.1.0123abcd", deadline_s=60.0),
        AgentDone(key=WorkKey("g-1", "agent", 3, 0, 1), reward=0.5, t_agent=2.5, worker_id="environment-0"),
        AgentDone(key=WorkKey("g-1", "agent", 3, 0, 1)),  # reward None: the domain's verifier scores
        AgentDone(key=WorkKey("g-1", "agent", 3, 0, 1), ok=False, error="agent_timeout: no end after 60 s"),
        GatewayGenerate(key=WorkKey.step("g-1", 3, "gen", 2, 1), prompt_ids=np.arange(30, dtype=np.int32), segment=1,
                        max_tokens=64, stop=["</answer>"]),
        GatewayRefused(key=WorkKey.step("g-1", 3, "gen", 2, 1), status=409, error="one call at a time"),
        GatewayEnded(key=WorkKey.step("g-1", 3, "gen", 4, 1), reason="orchestrator.max_turns=4 model calls"),
        GatewayReward(key=WorkKey("g-1", "agent", 3, 0, 1), reward=-1.0),
        _rollout(key=WorkKey.step("g-1", 3, "gen", 2, 0), prompt_ids=np.zeros(0, np.int32), n_resp=5,
                 loss_mask=np.array([False, True, False, False, True]),
                 segment_starts=np.array([2], np.int32)),  # an agent's row of two segments
        ScoreRequest(
            key=WorkKey.score("g-1", 3, 0),
            domain="math",
            text="The answer is \\boxed{4}. 日本語 ✓",
            reference="4",
            metadata={"tolerance": 1e-6, "tags": ["algebra", "easy"], "nested": {"k": [1, 2, None]}, "flag": True},
            deadline_s=12.5,
        ),
        ScoreRequest(key=K, domain="code", text=""),
        GroupScoreRequest(keys=[WorkKey.score("g-1", 0, 0), WorkKey.score("g-1", 1, 0)], domain="genrm", prompt="Write a haiku.",
                          texts=["an old pond", "frog jumps in"], metadata={"lang": "en"}, deadline_s=90.0),
        Score(key=WorkKey.score("g-1", 3, 0), reward=1.0, ok=True, reason="match", t_verify=0.012, worker_id="verifier-2"),
        Score(key=WorkKey.score("g-1", 4, 2), reward=-0.5, ok=False),
        _teacher_request(),
        TeacherRequest(key=WorkKey.teacher("g-one", 1), domain="code", prompt_ids=np.array([1], np.int32),
                       response_ids=np.array([2], np.int32), response_lens=np.array([1], np.int32)),  # defaults
        TeacherLogprobs(key=WorkKey.teacher("g-7", 0), logprobs=np.array([-0.5, -np.inf, -0.0, -12.25, -1e-30, -3.0, -1.0, -2.0],
                                                     dtype=np.float32), worker_id="teacher-0", t_teacher=0.031),
        TeacherLogprobs(key=WorkKey.teacher("g-8", 3), logprobs=np.zeros(0, np.float32), ok=False, error="domain 'x' is not served"),
        _train_batch(),
        _train_batch(teacher=False),
        _train_batch(n=0, length=7, group_size=4),  # 0 rows, empty arrays
        dataclasses.replace(_train_batch(), segment_starts=np.array([[3], [-1], [2], [-1]], np.int32)),  # agents' rows
        StepDone(step=17, version=18, metrics={"loss": 0.4375, "kl": 1e-3, "grad_norm": 2.0}),
        StepDone(step=0, version=1),
        WeightsReady(version=18, uri="file:///tmp/weights/v18", format="safetensors", nbytes=1 << 33, checksum="ab12"),
        WeightsGet(version=18, chunk=3),
        WeightsGet(version=18, chunk=0, part="delta"),
        WeightsChunk(version=18, chunk=2, chunks=3, nbytes=40, checksum="ab12", data=np.arange(8, dtype=np.uint8) * 31),
        WeightsChunk(version=0, chunk=0, chunks=1, nbytes=0, checksum="", data=np.zeros(0, np.uint8)),  # an empty file
        WeightsRefused(version=18, reason="version 18 is not served (evicted or never published); serving [19, 20]"),
        WeightsRefused(version=-1, reason="malformed request: header is not msgpack"),
        WeightsJoin(version=18, member="4242-0a1b2c3d4e5f"),
        WeightsJoin(version=18, member="4242-0a1b2c3d4e5f", group="run-1a2b3c4d-7", backends=["gloo", "nccl"]),
        WeightsGroup(version=19, store="10.0.0.1:29500", group="run-1a2b3c4d-7", rank=2, size=3, backend="nccl",
                     nbytes=1 << 33, chunk=64 << 20, checksum="", header=np.arange(16, dtype=np.uint8)),
        Heartbeat(
            role="trainer",
            worker_id="trainer-0",
            pid=4242,
            state="running",
            version=18,
            counters={"steps": 17, "tokens": 123456789, "lr": 1e-6, "last_error": None},
        ),
        Control(op="scale", args={"role": "sampler", "n": 4}),
        Control(op="status"),
        ControlReply(ok=True, result={"workers": [{"id": "s0", "state": "up"}], "n": 2}),
        ControlReply(ok=False, result=None, error="no such role"),
        ControlReply(ok=True, result=[1, "two", 3.0, None, True]),
    ]


def _assert_same(original: Any, decoded: Any) -> None:
    assert type(decoded) is type(original)
    for f in dataclasses.fields(original):
        a, b = getattr(original, f.name), getattr(decoded, f.name)
        spec = f.metadata.get("array")
        if spec is not None:
            if a is None:
                assert b is None, f.name
                continue
            assert isinstance(b, np.ndarray), f.name
            assert b.dtype == np.dtype(spec.dtype), (f.name, b.dtype)
            assert b.ndim == spec.ndim, f.name
            assert b.shape == np.shape(a), (f.name, b.shape, np.shape(a))
            np.testing.assert_array_equal(b, np.asarray(a, dtype=spec.dtype), err_msg=f.name)
            if spec.dtype.startswith("float"):  # bit-exact, including -0.0 and NaN payloads
                assert np.asarray(a, dtype=spec.dtype).tobytes() == b.tobytes(), f.name
        else:
            assert b == a, (f.name, a, b)
            assert type(b) is type(a), (f.name, type(a), type(b))


def _bytes_frames(msg: Any) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _header(frames: list) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def _with_header(frames: list, header: Any) -> list:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _edit(msg: Any, edit: Callable[[dict], Any]) -> list:
    """Frames of ``msg`` with the header changed in place by ``edit`` (its return value is ignored)."""
    frames = _bytes_frames(msg)
    header = _header(frames)
    edit(header)
    return _with_header(frames, header)


def _reject(frames: list, *fragments: str, expect: tuple | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, expect=expect)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return info.value


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_registered_type_and_array_dtype():
    registered = codec.registered_types()
    assert set(registered.values()) == {type(m) for m in sample_messages()}
    assert registered == {cls.TYPE: cls for cls in registered.values()}
    declared = {
        (f.metadata["array"].dtype, f.metadata["array"].ndim)
        for cls in registered.values()
        for f in dataclasses.fields(cls)
        if "array" in f.metadata
    }
    assert declared == {("int32", 1), ("float32", 1), ("int32", 2), ("bool", 1), ("uint8", 1), ("int16", 3)}


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: m.TYPE)
def test_round_trip(msg):
    frames = encode(msg)
    n_arrays = sum(1 for f in dataclasses.fields(msg) if "array" in f.metadata and getattr(msg, f.name) is not None)
    assert len(frames) == 1 + n_arrays
    header = _header(frames)
    assert header["t"] == msg.TYPE and header["v"] == PROTOCOL_VERSION
    decoded = decode(frames)
    _assert_same(msg, decoded)
    _assert_same(msg, decode(frames, expect=(type(msg),)))  # expect accepts its own type
    _assert_same(msg, decode(encode(decoded)))  # a decoded message re-encodes identically
    for f in dataclasses.fields(msg):
        if "array" in f.metadata and getattr(decoded, f.name) is not None:
            assert not getattr(decoded, f.name).flags.writeable, f.name


def test_train_batch_arrays_keep_dtype_shape_and_optional_teacher():
    with_teacher, without = _train_batch(), _train_batch(teacher=False)
    a, b = decode(encode(with_teacher)), decode(encode(without))
    assert a.response_mask.dtype == np.bool_ and a.response_mask.shape == (23,)  # packed: 5 + 6 + 6 + 6 tokens
    np.testing.assert_array_equal(a.response_mask, with_teacher.response_mask)
    assert a.input_ids.dtype == np.int32 and a.input_ids.shape == (23,) and a.lengths.tolist() == [5, 6, 6, 6]
    assert a.teacher_logprobs.dtype == np.float32 and a.teacher_logprobs.shape == (23,)
    assert a.routes.dtype == np.int16 and a.routes.shape == (23, 3, 8)
    np.testing.assert_array_equal(a.teacher_logprobs, with_teacher.teacher_logprobs)
    assert a.loss_masked.dtype == np.bool_ and a.loss_masked.tolist() == [True, False, False, True]
    assert b.teacher_logprobs is None and b.loss_masked is None
    assert len(encode(without)) == len(encode(with_teacher)) - 3  # no frame for an absent optional array
    assert _header(encode(without))["teacher_logprobs"] is None

    # An absent key for an optional array decodes to its default, too.
    frames = _edit(without, lambda h: h.pop("teacher_logprobs"))
    assert decode(frames).teacher_logprobs is None


def test_encode_converts_and_compacts_arrays():
    # Non-contiguous views and other dtypes/lists are converted to the declared dtype, C order.
    base = np.arange(64, dtype=np.int64)
    tb = _train_batch()
    tb.lengths = [4, 4, 4, 4]  # a plain list
    tb.input_ids = base[::4]  # a strided view, int64
    tb.response_mask = np.ones(16, dtype=np.int8)
    tb.inf_logprobs = np.full(16, -0.5)  # float64
    tb.teacher_logprobs = tb.routes = None
    tb.segment_starts = np.asfortranarray(np.array([[1, -1], [2, 3], [-1, -1], [0, 1]], np.int64))  # Fortran order
    tb.rewards = [1, 0, 1, 0]  # a plain list
    tb.versions = np.array([1, 1, 2, 2], dtype=np.uint8)
    out = decode(encode(tb))
    assert out.input_ids.dtype == np.int32 and out.lengths.dtype == np.int32
    np.testing.assert_array_equal(out.input_ids, base[::4])
    np.testing.assert_array_equal(out.segment_starts, [[1, -1], [2, 3], [-1, -1], [0, 1]])
    assert out.response_mask.dtype == np.bool_ and out.response_mask.all()
    assert out.inf_logprobs.dtype == np.float32 and (out.inf_logprobs == -0.5).all()
    assert out.rewards.dtype == np.float32 and out.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.versions.dtype == np.int32 and out.versions.tolist() == [1, 1, 2, 2]


def test_encode_rejects_wrong_rank():
    bad = _rollout(prompt_ids=np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ProtocolError, match="rank 2, declared 1"):
        encode(bad)


def test_int_and_float_field_conversions():
    # Python ints (large, negative) and numpy scalars go through int fields unchanged.
    big = WeightsReady(version=np.int64(7), uri="u", nbytes=2**62 + 1)
    out = decode(encode(big))
    assert out.version == 7 and type(out.version) is int
    assert out.nbytes == 2**62 + 1 and type(out.nbytes) is int
    neg = decode(encode(Ready(worker_id="w", role="sampler", slots=0, version=-3)))
    assert neg.version == -3 and type(neg.version) is int

    # Float fields accept ints (and numpy floats) and come back as Python floats.
    score = decode(encode(Score(key=K, reward=1, ok=True, t_verify=np.float32(0.5))))
    assert score.reward == 1.0 and type(score.reward) is float
    assert score.t_verify == 0.5 and type(score.t_verify) is float
    done = decode(encode(StepDone(step=1, version=2, metrics={"loss": 3, "kl": 0.25})))
    assert done.metrics == {"loss": 3.0, "kl": 0.25}
    assert all(type(v) is float for v in done.metrics.values())
    req = decode(
        encode(
            PromptRequest(
                key=WorkKey.sample("g", 0),
                domain="d",
                prompt_ids=np.array([1], np.int32),
                sampling=SamplingParams(temperature=1, top_p=1, seed=None),
            )
        )
    )
    assert type(req.sampling.temperature) is float and type(req.sampling.top_p) is float
    assert req.sampling.seed is None

    # The same through a hand-written header: int into float fields.
    frames = _edit(Score(key=K, reward=0.5, ok=True), lambda h: h.update(reward=-2, t_verify=0))
    out = decode(frames)
    assert out.reward == -2.0 and type(out.reward) is float and type(out.t_verify) is float


def test_missing_optional_fields_take_defaults_and_unknown_keys_are_ignored():
    frames = [
        msgpack.packb(
            {"t": "score", "v": PROTOCOL_VERSION, "key": {"group": "k", "kind": "score"}, "reward": 0.5, "ok": False,
             "from_the_future": [1, 2]}
        )
    ]
    out = decode(frames)
    assert out == Score(key=K, reward=0.5, ok=False)
    frames = [
        msgpack.packb(
            {
                "t": "prompt_request",
                "v": PROTOCOL_VERSION,
                "key": {"group": "g", "kind": "sample"},
                "domain": "d",
                "prompt_ids": {"__nd__": 1, "dtype": "int32", "shape": [2]},
                "sampling": {"temperature": 0.5},
            }
        ),
        np.array([5, 6], np.int32).tobytes(),
    ]
    out = decode(frames)
    assert out.sampling == SamplingParams(temperature=0.5)
    assert out.prompt_ids.tolist() == [5, 6] and out.n == 1


# --------------------------------------------------------------------------- ZeroMQ


@pytest.fixture(params=["inproc", "ipc"])
def socket_pair(request, tmp_path):
    ctx = zmq.Context()
    if request.param == "inproc":
        address = f"inproc://protocol-test-{id(request)}"
    else:
        path = tmp_path / "p.sock"
        if len(str(path)) > 100:
            pytest.skip("ipc path too long for AF_UNIX")
        address = f"ipc://{path}"
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    pull.bind(address)
    push.connect(address)
    yield push, pull
    push.close()
    pull.close()
    ctx.term()


def test_zmq_round_trip_zero_copy(socket_pair):
    push, pull = socket_pair
    messages = [
        _train_batch(n=64, length=512, group_size=8),
        _rollout(n_prompt=3000, n_resp=4000),
        _rollout(n_resp=0, finish_reason="error"),
        Score(key=K, reward=1.0, ok=True),
        Control(op="stop", args={"graceful": True}),
    ]
    for msg in messages:
        push.send_multipart(encode(msg), copy=False)
    for msg in messages:
        frames = pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        out = decode(frames, expect=tuple(codec.registered_types().values()))
        _assert_same(msg, out)
        array_fields = [
            f.name for f in dataclasses.fields(msg) if "array" in f.metadata and getattr(msg, f.name) is not None
        ]
        assert len(frames) == 1 + len(array_fields)
        refs = _header(frames)
        for name in array_fields:
            arr = getattr(out, name)
            assert not arr.flags.writeable, name
            with pytest.raises(ValueError):
                arr[...] = 0
            frame = frames[refs[name]["__nd__"]]
            if arr.nbytes:  # the decoded array is a view of the received frame, not a copy
                raw = np.frombuffer(frame.buffer, dtype=np.uint8)
                assert np.shares_memory(arr, raw), name
                assert arr.__array_interface__["data"][0] == raw.__array_interface__["data"][0], name


def test_zmq_expect_rejects_other_types(socket_pair):
    push, pull = socket_pair
    push.send_multipart(encode(Score(key=K, reward=0.0, ok=False)), copy=False)
    frames = pull.recv_multipart(copy=False)
    _reject(frames, "unexpected message type 'score'", expect=(Rollout, TrainBatch))
    push.send_multipart([b"\xc1\xc1", b"junk"], copy=False)
    _reject(pull.recv_multipart(copy=False), "not msgpack")


# --------------------------------------------------------------------------- rejection


def test_reject_empty_and_non_msgpack():
    _reject([], "empty message")
    _reject([b"\xc1 not msgpack at all"], "header is not msgpack")
    _reject([b""], "header is not msgpack")
    good = _bytes_frames(Score(key=K, reward=1.0, ok=True))[0]
    _reject([good[:-3]], "header is not msgpack")  # truncated
    _reject([good + b"\x00"], "header is not msgpack")  # trailing data
    ext = msgpack.packb({"t": "score", "v": 1, "key": msgpack.ExtType(5, b"xx"), "reward": 1.0, "ok": True})
    _reject([ext], "header is not msgpack")
    int_keys = msgpack.packb({"t": "control", "v": 1, "op": "status", "args": {1: 2}})
    _reject([int_keys], "header is not msgpack")


def test_reject_non_map_header():
    _reject([msgpack.packb(["t", "score", "v", 1])], "header is not a map")
    _reject([msgpack.packb("score")], "header is not a map")
    _reject([msgpack.packb(None)], "header is not a map")


def test_reject_header_too_large():
    big = Score(key=K, reward=1.0, ok=True, reason="x" * MAX_HEADER_BYTES)
    frames = encode(big)
    assert len(frames[0]) > MAX_HEADER_BYTES
    _reject(frames, "exceeds", str(MAX_HEADER_BYTES))
    # Just under the limit is fine.
    fits = Score(key=K, reward=1.0, ok=True, reason="x" * (MAX_HEADER_BYTES - 1000))
    assert decode(encode(fits)).reason == fits.reason


def test_reject_version_and_type():
    score = Score(key=K, reward=1.0, ok=True)
    _reject(_edit(score, lambda h: h.update(v=PROTOCOL_VERSION + 1)), f"protocol version {PROTOCOL_VERSION + 1}")
    _reject(_edit(score, lambda h: h.update(v=2)), "protocol version 2, this peer speaks 3")  # padded TrainBatch rows
    _reject(_edit(score, lambda h: h.update(v="1")), "protocol version '1'")
    _reject(_edit(score, lambda h: h.pop("v")), "protocol version None")
    _reject(_edit(score, lambda h: h.update(t="scores")), "unknown message type 'scores'")
    _reject(_edit(score, lambda h: h.update(t=3)), "unknown message type 3")
    _reject(_edit(score, lambda h: h.pop("t")), "unknown message type None")
    _reject(_edit(score, lambda h: h.update(t="SamplingParams")), "unknown message type")  # structs are not messages
    _reject(encode(score), "unexpected message type 'score'", expect=(Rollout,))
    _reject(encode(score), "unexpected message type", expect=())
    assert decode(encode(score), expect=(Rollout, Score)) == score


def test_reject_missing_required_fields():
    _reject(_edit(Score(key=K, reward=1.0, ok=True), lambda h: h.pop("key")), "score.key: required field missing")
    _reject(_edit(_rollout(), lambda h: h.pop("key")), "rollout.key: required field missing")
    _reject(_edit(_rollout(), lambda h: h["key"].pop("group")), "rollout.key.group: required field missing")
    tb = _train_batch()
    frames = _edit(tb, lambda h: h.pop("input_ids"))
    _reject(frames, "train_batch.input_ids: required field missing")
    frames = _edit(
        PromptRequest(key=WorkKey.sample("g", 0), domain="d", prompt_ids=np.array([1], np.int32)),
        lambda h: h["sampling"].clear(),
    )  # nested struct: all fields have defaults
    assert decode(frames).sampling == SamplingParams()


WRONG_SCALARS = [
    # (message, field path, bad value, expected reason fragment)
    (_rollout(), ("key", "index"), "3", "rollout.key.index: expected int, got str"),
    (_rollout(), ("key", "index"), True, "rollout.key.index: expected int, got bool"),
    (_rollout(), ("key", "index"), 3.0, "rollout.key.index: expected int, got float"),
    (_rollout(), ("policy_version",), None, "expected int, got NoneType"),
    (_rollout(), ("key", "group"), 7, "rollout.key.group: expected str, got int"),
    (_rollout(), ("finish_reason",), b"stop", "expected str, got bytes"),
    (Score(key=K, reward=1.0, ok=True), ("key",), 1.5, "score.key: expected map for WorkKey, got float"),
    (Score(key=K, reward=1.0, ok=True), ("key",), "k/0/0", "score.key: expected map for WorkKey, got str"),
    (Score(key=K, reward=1.0, ok=True), ("key", "attempt"), "0", "score.key.attempt: expected int, got str"),
    (EnvReply(key=WorkKey.step("g", 1, "env", 2, 0), done=True), ("key", "turn"), 2.0,
     "env_reply.key.turn: expected int, got float"),
    (Score(key=K, reward=1.0, ok=True), ("reward",), "1.0", "score.reward: expected float, got str"),
    (Score(key=K, reward=1.0, ok=True), ("reward",), True, "score.reward: expected float, got bool"),
    (Score(key=K, reward=1.0, ok=True), ("ok",), 1, "score.ok: expected bool, got int"),
    (Ready(worker_id="w", role="sampler", slots=2), ("domains",), "math", "ready.domains: expected list, got str"),
    (Ready(worker_id="w", role="sampler", slots=2), ("domains",), ["math", 2], "ready.domains[1]: expected str"),
    (ScoreRequest(key=K, domain="d", text="t"), ("metadata",), [1, 2], "score_request.metadata: expected map"),
    (StepDone(step=1, version=1), ("metrics",), {"loss": "low"}, "step_done.metrics['loss']: expected float"),
    (Heartbeat(role="r", worker_id="w", pid=1, state="s"), ("pid",), "1", "heartbeat.pid: expected int"),
    (Control(op="status"), ("args",), None, "control.args: expected map"),
    (
        PromptRequest(key=WorkKey.sample("g", 0), domain="d", prompt_ids=np.array([1], np.int32)),
        ("sampling",),
        [],
        "prompt_request.sampling: expected map for SamplingParams",
    ),
    (
        PromptRequest(key=WorkKey.sample("g", 0), domain="d", prompt_ids=np.array([1], np.int32)),
        ("sampling", "max_tokens"),
        "64",
        "prompt_request.sampling.max_tokens: expected int, got str",
    ),
    (
        PromptRequest(key=WorkKey.sample("g", 0), domain="d", prompt_ids=np.array([1], np.int32)),
        ("sampling", "seed"),
        1.5,
        "prompt_request.sampling.seed: 1.5 matches none of",
    ),
    (
        PromptRequest(key=WorkKey.sample("g", 0), domain="d", prompt_ids=np.array([1], np.int32)),
        ("sampling", "stop"),
        [None],
        "prompt_request.sampling.stop[0]: expected str",
    ),
    (
        TrainBatch(
            step=0,
            group_size=1,
            input_ids=np.zeros(1, np.int32),
            response_mask=np.zeros(1, bool),
            inf_logprobs=np.zeros(1, np.float32),
            rewards=np.zeros(1, np.float32),
            versions=np.zeros(1, np.int32),
            lengths=np.ones(1, np.int32),
        ),
        ("group_size",),
        False,
        "train_batch.group_size: expected int, got bool",
    ),
]


@pytest.mark.parametrize(
    ("msg", "path", "value", "fragment"),
    WRONG_SCALARS,
    ids=[f"{m.TYPE}.{'.'.join(p)}={v!r}" for m, p, v, _ in WRONG_SCALARS],
)
def test_reject_wrong_scalar_type(msg, path, value, fragment):
    def edit(h):
        target = h
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    _reject(_edit(msg, edit), fragment)


def _ref(header: dict, name: str) -> dict:
    ref = header[name]
    assert set(ref) == {"__nd__", "dtype", "shape"}
    return ref


def test_reject_bad_array_references():
    r = _rollout(n_prompt=4, n_resp=3)

    def set_ref(name, **kw):
        return _edit(r, lambda h: _ref(h, name).update(kw))

    # dtype: same itemsize, so only the dtype check can catch it
    _reject(set_ref("response_ids", dtype="float32"), "rollout.response_ids: dtype 'float32', expected 'int32'")
    _reject(set_ref("inf_logprobs", dtype="float64", shape=[3]), "dtype 'float64', expected 'float32'")
    _reject(set_ref("inf_logprobs", dtype="object"), "dtype 'object'")
    # rank / shape
    _reject(set_ref("prompt_ids", shape=[2, 2]), "rollout.prompt_ids: bad shape [2, 2] for rank 1")
    _reject(set_ref("prompt_ids", shape=[]), "bad shape [] for rank 1")
    _reject(set_ref("prompt_ids", shape=[-4]), "bad shape [-4]")
    _reject(set_ref("prompt_ids", shape=[True]), "bad shape [True]")
    _reject(set_ref("prompt_ids", shape=4), "bad shape 4")
    _reject(set_ref("prompt_ids", shape=[4.0]), "bad shape [4.0]")
    _reject(set_ref("prompt_ids", shape=[2**41]), "bad shape")
    tb = _train_batch()
    _reject(
        _edit(tb, lambda h: _ref(h, "input_ids").update(shape=[4, 6])), "train_batch.input_ids: bad shape [4, 6] for rank 1"
    )
    _reject(_edit(tb, lambda h: _ref(h, "routes").update(shape=[23, 24])), "bad shape [23, 24] for rank 3")
    # byte length vs shape
    _reject(set_ref("prompt_ids", shape=[5]), "rollout.prompt_ids: 16 bytes for shape [5] int32 (20 expected)")
    _reject(set_ref("prompt_ids", shape=[0]), "16 bytes for shape [0]")
    _reject(
        _edit(tb, lambda h: _ref(h, "input_ids").update(shape=[20])), "92 bytes for shape [20] int32 (80 expected)"
    )
    # right byte count, wrong split: caught later by validate, not by the codec
    _reject(_edit(tb, lambda h: _ref(h, "routes").update(shape=[46, 3, 4])), "routes for 46 tokens, not 23")
    frames = _bytes_frames(r)
    idx = _header(frames)["prompt_ids"]["__nd__"]
    frames[idx] = frames[idx][:-1]
    _reject(frames, "15 bytes for shape [4] int32 (16 expected)")
    frames[idx] = frames[idx] + b"\x00\x00"
    _reject(frames, "17 bytes")
    # frame index
    _reject(set_ref("prompt_ids", __nd__=99), "rollout.prompt_ids: array frame index 99 out of range")
    _reject(set_ref("prompt_ids", __nd__=0), "array frame index 0 out of range")  # the header is not an array
    _reject(set_ref("prompt_ids", __nd__=-1), "out of range")
    _reject(set_ref("prompt_ids", __nd__=True), "array frame index True out of range")
    _reject(set_ref("prompt_ids", __nd__="1"), "out of range")
    # not a reference at all
    _reject(_edit(r, lambda h: h.update(prompt_ids=[1, 2, 3, 4])), "rollout.prompt_ids: expected an array reference")
    _reject(_edit(r, lambda h: h.update(prompt_ids=None)), "expected an array reference")  # required array
    _reject(set_ref("prompt_ids", extra=1), "expected an array reference")
    _reject(_edit(r, lambda h: _ref(h, "prompt_ids").pop("dtype")), "expected an array reference")


def test_reject_frame_referenced_twice_and_unreferenced_frames():
    r = _rollout(n_prompt=3, n_resp=3)

    def alias(h):
        h["response_ids"] = dict(h["prompt_ids"])

    frames = _edit(r, alias)
    _reject(frames, "array frame", "referenced twice")
    _reject(_bytes_frames(r) + [b"extra"], "rollout: 1 unreferenced array frame(s)")
    _reject(_bytes_frames(r) + [b"", b""], "2 unreferenced array frame(s)")
    _reject(_bytes_frames(Score(key=K, reward=1.0, ok=True)) + [b""], "1 unreferenced")
    tb = _train_batch(teacher=False)
    _reject(_bytes_frames(tb) + [np.zeros((4, 6), np.float32).tobytes()], "unreferenced")
    # Dropping a frame shifts the indices: caught as out of range, not mis-decoded.
    _reject(_bytes_frames(tb)[:-1], "out of range")


def test_huge_shape_does_not_overflow_byte_count():
    # 2**32 * 2**32 wraps to 0 in int64; the byte count must not, or an empty frame would "match".
    tb = dataclasses.replace(_train_batch(n=0, length=0, group_size=1, teacher=False),
                             segment_starts=np.zeros((0, 0), np.int32), routes=np.zeros((0, 0, 0), np.int16))
    frames = _edit(tb, lambda h: _ref(h, "segment_starts").update(shape=[2**32, 2**32]))
    _reject(frames, "train_batch.segment_starts: 0 bytes for shape [4294967296, 4294967296]")
    frames = _edit(tb, lambda h: _ref(h, "routes").update(shape=[2**39, 2**39, 2**39]))
    _reject(frames, "bytes for shape")


ONE = np.array([1], np.int32)  # a one-token prompt


VALIDATION_FAILURES = [
    (_rollout(n_resp=3, inf_logprobs=np.zeros(2, np.float32)), "rollout: 3 response ids but 2 log-probs"),
    (_rollout(n_resp=0, inf_logprobs=np.zeros(1, np.float32), finish_reason="stop"), "0 response ids but 1 log-probs"),
    (_rollout(finish_reason="eos"), "rollout: finish_reason 'eos'"),
    (_rollout(key=WorkKey.score("g", 3, 0)), "rollout: a score key answers no sampling"),
    (PromptRequest(WorkKey.teacher("g", 0), "d", ONE), "prompt_request: a teacher key asks for no sampling"),
    (PromptRequest(WorkKey.step("g", 1, "gen", 1, 0), "d", ONE, n=2), "a continuation (kind gen) samples n=1"),
    (PromptRequest(WorkKey("g", "sample", 0, 2, 0), "d", ONE), "prompt_request.key: a sample key has no turn"),
    (_train_batch(n=6, group_size=4), "train_batch: 6 rows is not a whole number of groups of 4"),
    (_train_batch(n=4, group_size=0), "rows is not a whole number of groups of 0"),
    (_train_batch(n=4, group_size=-2), "groups of -2"),
    (dataclasses.replace(_train_batch(), response_mask=np.ones(22, bool)), "response_mask shape (22,) != (23,)"),
    (dataclasses.replace(_train_batch(), inf_logprobs=np.ones(24, np.float32)), "inf_logprobs shape (24,)"),
    (dataclasses.replace(_train_batch(), lengths=np.array([5, 6, 6, 7], np.int32)), "lengths sum to 24 but there are 23"),
    (dataclasses.replace(_train_batch(), lengths=np.array([6, 0, 11, 6], np.int32)), "a row of 0 tokens"),
    (dataclasses.replace(_train_batch(), lengths=np.array([6, 6, 11], np.int32)), "3 rows is not a whole number"),
    (dataclasses.replace(_train_batch(), segment_starts=np.array([[5], [-1], [2], [-1]], np.int32)),
     "each start inside its row"),
    (dataclasses.replace(_train_batch(), rewards=np.ones(3, np.float32)), "one entry per row"),
    (dataclasses.replace(_train_batch(), versions=np.ones(5, np.int32)), "one entry per row"),
    (dataclasses.replace(_train_batch(), teacher_logprobs=np.ones(7, np.float32)), "teacher_logprobs shape"),
    (_teacher_request(response_ids=np.zeros(7, np.int32)), "teacher_request: response_lens sum to 8 but there are 7 ids"),
    (_teacher_request(lens=()), "response_lens must hold at least one response"),
    (_teacher_request(lens=(2, 0, 3)), "each of >= 1 token"),
    (_teacher_request(lens=(2, -1, 3)), "each of >= 1 token"),
    (_teacher_request(temperature=0.0), "teacher_request: temperature 0.0"),
    (_teacher_request(temperature=-1.0), "temperature -1.0"),
    (_teacher_request(temperature=float("nan")), "temperature nan"),
    (_teacher_request(temperature=float("inf")), "temperature inf"),
    (_teacher_request(deadline_s=0.0), "teacher_request: deadline_s 0.0"),
    (_teacher_request(deadline_s=float("inf")), "deadline_s inf"),
    (Control(op="reboot"), "control: unknown op 'reboot'"),
    (Ready(worker_id="w", role="sampler", slots=-1), "ready: slots must be >= 0"),
    (WeightsGet(version=-1, chunk=0), "weights_get: version -1, chunk 0"),
    (WeightsGet(version=3, chunk=-2), "weights_get: version 3, chunk -2"),
    (WeightsGet(version=3, chunk=0, part="d" * 33), "weights_get: part name of 33 characters"),
    (WeightsChunk(3, 3, 3, 40, "", np.zeros(4, np.uint8)), "weights_chunk: chunk 3 of 3"),
    (WeightsChunk(3, -1, 3, 40, "", np.zeros(4, np.uint8)), "weights_chunk: chunk -1 of 3"),
    (WeightsChunk(3, 0, 0, 0, "", np.zeros(0, np.uint8)), "weights_chunk: chunk 0 of 0"),
    (WeightsChunk(-1, 0, 1, 4, "", np.zeros(4, np.uint8)), "weights_chunk: version -1, nbytes 4"),
    (WeightsChunk(3, 0, 1, -4, "", np.zeros(0, np.uint8)), "weights_chunk: version 3, nbytes -4"),
    (WeightsChunk(3, 0, 5, 4, "", np.zeros(1, np.uint8)), "weights_chunk: 5 chunks of a 4-byte file"),
    (WeightsChunk(3, 0, 1, 4, "", np.zeros(5, np.uint8)), "weights_chunk: 5 bytes in one chunk of a 4-byte file"),
    (WeightsRefused(version=-2, reason="x"), "weights_refused: version -2"),
    (WeightsJoin(version=-1, member="m"), "weights_join: version -1"),
    (WeightsJoin(version=1, member="a b"), "weights_join: member id 'a b'"),
    (WeightsJoin(version=1, member=""), "weights_join: member id ''"),
    (WeightsJoin(version=1, member="m", group="g" * 65), "weights_join: group name of 65 characters"),
    (WeightsJoin(version=1, member="m", backends=["gloo"] * 5), "weights_join: 5 backends"),
    (WeightsGroup(1, "h:1", "g", 0, 2, "gloo", 8, 8, "", np.zeros(8, np.uint8)), "weights_group: rank 0 of 2"),
    (WeightsGroup(1, "h:1", "g", 2, 2, "gloo", 8, 8, "", np.zeros(8, np.uint8)), "weights_group: rank 2 of 2"),
    (WeightsGroup(1, "h:1", "g", 1, 2, "mpi", 8, 8, "", np.zeros(8, np.uint8)), "weights_group: backend 'mpi'"),
    (WeightsGroup(1, "h:1", "g", 1, 2, "gloo", 8, 0, "", np.zeros(8, np.uint8)), "weights_group: version 1, nbytes 8, chunk 0"),
    (WeightsGroup(1, "h:1", "", 1, 2, "gloo", 8, 8, "", np.zeros(8, np.uint8)), "weights_group: group name of 0"),
]


@pytest.mark.parametrize(("msg", "fragment"), VALIDATION_FAILURES, ids=[f[1][:40] for f in VALIDATION_FAILURES])
def test_reject_failed_validate(msg, fragment):
    frames = encode(msg)  # encode does not validate; the receiver must
    _reject(frames, fragment)


def test_validate_allows_mismatch_only_for_errors():
    out = decode(encode(_rollout(n_resp=4, inf_logprobs=np.zeros(0, np.float32), finish_reason="error")))
    assert out.finish_reason == "error" and len(out.response_ids) == 4 and len(out.inf_logprobs) == 0
    for op in ("status", "scale", "swap", "stop"):
        assert decode(encode(Control(op=op))).op == op


# --------------------------------------------------------------------------- mutation fuzzing

_RANDOM_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    2**31,
    2**63 - 1,
    -(2**63),
    0.5,
    float("nan"),
    "",
    "x",
    "score",
    "rollout",
    "int32",
    "float32",
    "bool",
    b"\x00\x01",
    [],
    [1],
    [0, 0],
    [2**32, 2**32],
    {},
    {"a": 1},
]


def _random_value(rng: random.Random, header: dict) -> Any:
    choice = rng.random()
    if choice < 0.15:  # a plausible array reference
        return {
            "__nd__": rng.randint(-1, 6),
            "dtype": rng.choice(codec.ALLOWED_DTYPES + ("int16",)),
            "shape": [rng.randint(0, 10) for _ in range(rng.randint(0, 3))],
        }
    if choice < 0.25:  # a value taken from elsewhere in the header
        return copy.deepcopy(header[rng.choice(list(header))])
    return copy.deepcopy(rng.choice(_RANDOM_VALUES))


def _mutate_structure(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    header = msgpack.unpackb(frames[0], raw=False)
    target = header
    while True:  # descend into a random nested map now and then
        key = rng.choice(list(target))
        if isinstance(target[key], dict) and target[key] and rng.random() < 0.5:
            target = target[key]
            continue
        break
    op = rng.random()
    if op < 0.2:
        del target[key]
    elif op < 0.3:
        target[rng.choice(["extra", "__nd__", "t", "v", "shape"])] = _random_value(rng, header)
    else:
        target[key] = _random_value(rng, header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(5)
    if op == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:  # overwrite a byte
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:  # truncate
        del b[rng.randint(0, len(b)) :]
    elif op == 3:  # insert random bytes
        at = rng.randint(0, len(b))
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:  # delete a slice
        if b:
            at = rng.randrange(len(b))
            del b[at : at + rng.randint(1, 4)]
    return bytes(b)


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.random()
        if op < 0.35 and frames:
            frames[0] = _mutate_bytes(rng, frames[0])
        elif op < 0.5 and len(frames) > 1:
            i = rng.randrange(1, len(frames))
            frames[i] = _mutate_bytes(rng, frames[i])
        elif op < 0.6 and frames:
            del frames[rng.randrange(len(frames))]
        elif op < 0.7:
            frames.insert(rng.randint(0, len(frames)), bytes(rng.randrange(256) for _ in range(rng.choice([0, 4, 8]))))
        elif op < 0.75 and len(frames) > 2:
            i, j = rng.sample(range(len(frames)), 2)
            frames[i], frames[j] = frames[j], frames[i]
        elif frames:
            try:
                frames = _mutate_structure(rng, frames)
            except Exception:  # header already garbled by an earlier step: mutate bytes instead
                frames[0] = _mutate_bytes(rng, frames[0])
    return frames


def test_random_mutations_raise_only_protocol_error():
    rng = random.Random(20240607)
    corpus = [_bytes_frames(m) for m in sample_messages()]
    registered = set(codec.registered_types().values())
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for iteration in range(2000):
        original = rng.choice(corpus)
        frames = _mutate(rng, original)
        try:
            msg = decode(frames)
        except ProtocolError as e:
            outcomes["rejected"] += 1
            reasons[str(e).split(":")[0] if ":" in str(e) else str(e)] += 1
            assert str(e), "a ProtocolError must say why"
            continue
        except Exception as e:  # pragma: no cover - this is the failure being hunted
            raise AssertionError(f"iteration {iteration}: {type(e).__name__}: {e}\nframes={frames!r}") from e
        assert type(msg) in registered
        outcomes["accepted"] += 1
        if frames == original:
            outcomes["unchanged"] += 1
        # Whatever was accepted is a well-formed message: it re-encodes and decodes to the same thing.
        again = decode(encode(msg))
        assert type(again) is type(msg)
        assert encode(again)[0] == encode(msg)[0]
    assert outcomes["rejected"] >= 500, outcomes
    assert outcomes["accepted"] - outcomes["unchanged"] >= 50, outcomes
    assert len(reasons) >= 15, reasons  # the mutations reached many different checks


def test_work_key_round_trips_and_names_itself_as_before():
    keys = [WorkKey.score("s3g5", 2, 0), WorkKey.teacher("s3g5", 1), WorkKey.step("e4", 0, "env", 1, 2),
            WorkKey.step("e4", 3, "gen", 2, 0), WorkKey.sample("s3g5", 1).answer(2)]
    for key in keys:  # every kind, in every message that carries one; a frozen value, usable as a dict key
        assert decode(encode(Score(key, 1.0, True))).key == key
        assert {key: 1}[decode(encode(EnvReply(key, True))).key] == 1
    group = decode(encode(GroupScoreRequest(keys[:1] * 2, "genrm", "p", ["a", "b"])))
    assert group.keys == keys[:1] * 2 and all(type(k) is WorkKey for k in group.keys)
    # the text of logs and the stall report is the old string key's, and the ledger's rollout id too
    assert [str(k) for k in keys] == ["s3g5/2/0", "s3g5/teacher/1", "e4/0:env1/2", "e4/3:gen2/0", "s3g5/2:sample/1"]
    assert [k.rollout_id for k in keys] == ["s3g5/2", "s3g5/0", "e4/0", "e4/3", "s3g5/2"]
    assert keys[3].answer(0) == keys[3] and WorkKey.sample("g", 0).answer(5) == WorkKey("g", "sample", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys[0].attempt = 1


@pytest.mark.parametrize("edit, reason", [
    (lambda k: k.update(kind="bogus"), "score.key: kind 'bogus' is none of"),
    (lambda k: k.update(attempt=-1), "score.key: negative index, turn or attempt"),
    (lambda k: k.update(group=""), "score.key: empty group id"),
    (lambda k: k.update(turn=2), "score.key: a score key has no turn"),
    (lambda k: k.update(kind="teacher", index=3), "score.key: a teacher key has no row index"),
    (lambda k: k.pop("group"), "score.key.group: required field missing"),
    (lambda k: k.pop("kind"), "score.key.kind: required field missing"),
    (lambda k: k.update(index="2"), "score.key.index: expected int, got str"),
])
def test_malformed_work_key_is_refused(edit, reason):
    _reject(_edit(Score(WorkKey.score("g", 2, 0), 1.0, True), lambda h: edit(h["key"])), reason)
    # the same check inside a list of keys
    group = GroupScoreRequest([WorkKey.score("g", 0, 0), WorkKey.score("g", 2, 0)], "genrm", "p", ["a", "b"])
    _reject(_edit(group, lambda h: edit(h["keys"][1])), reason.replace("score.key", "group_score_request.keys[1]"))


def test_group_score_request_needs_one_key_per_text():
    with pytest.raises(ProtocolError, match="2 keys for 1 texts"):
        decode(encode(GroupScoreRequest(keys=[WorkKey.score("g", 0, 0), WorkKey.score("g", 1, 0)], domain="genrm", prompt="p", texts=["x"])))


def test_teacher_request_and_logprobs_round_trip_one_group():
    req = decode(encode(_teacher_request(lens=(2, 5))), expect=(TeacherRequest,))
    assert req.response_lens.tolist() == [2, 5] and req.response_ids.tolist() == list(range(500, 507))
    assert req.temperature == 0.7 and req.deadline_s == 30.0 and req.prompt_ids.dtype == np.int32
    # lens summing past 2**31 in int32 must not wrap around to a "matching" small sum
    wrapping = _teacher_request(lens=(2**31 - 1, 2**31 - 1, 2), response_ids=np.zeros(0, np.int32))
    _reject(encode(wrapping), "response_lens sum to 4294967296")
    reply = decode(encode(TeacherLogprobs(WorkKey.teacher("g-7", 0), np.full(7, -1.5, np.float32), worker_id="teacher-0")))
    assert reply.ok and reply.error == "" and reply.logprobs.dtype == np.float32 and len(reply.logprobs) == 7
    # a failed reply needs no array data but still declares the (empty) array
    failed = decode(encode(TeacherLogprobs(WorkKey.teacher("g-8", 0), np.zeros(0, np.float32), ok=False, error="too long")))
    assert not failed.ok and failed.error == "too long" and failed.logprobs.shape == (0,)
    _reject(_edit(_teacher_request(), lambda h: h.pop("response_lens")), "teacher_request.response_lens: required")
    _reject(_edit(_teacher_request(), lambda h: h.update(temperature="1")), "teacher_request.temperature: expected float")


def test_closing_a_link_whose_io_thread_has_already_ended():
    """close() sets stop, then wakes the IO thread; the thread can see stop on its own poll timeout in between and
    close its sockets, the waker among them (an orchestrator exited 1 after its run with ENOTSOCK from that wake-up).
    Here the thread ends first, deterministically; close() and a late send() must still return quietly."""
    from cascade_rl.protocol.sockets import RouterLink

    link = RouterLink("inproc://closing-after-the-io-thread", None, (), dict, heartbeat_s=0.05).start()
    link._stop.set()
    link._thread.join(5)
    assert not link._thread.is_alive() and link._wake_tx.closed
    link.close()
    link.send((b"gone", None))  # queued, never sent: the thread is gone

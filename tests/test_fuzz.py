"""Property-based fuzzing of the wire decoder, and of the sockets that count malformed input.

    .venv/bin/pytest tests/test_fuzz.py                              # ~30 s on 2 cores
    CASCADE_RL_FUZZ_SCALE=10 .venv/bin/pytest tests/test_fuzz.py     # a ten times longer hunt

The property, for every frame list thrown at it: ``decode`` either returns a message of a registered type
whose ``validate()`` passes (typed as declared, arrays read-only, re-encoding to the same header), or raises
``ProtocolError`` -- never another exception, never a hang (a hypothesis ``deadline`` per example, and a
faulthandler watchdog that kills a test stuck in C code).

Inputs start from valid messages of every registered type, generated from the dataclass declarations, and
are then broken in one family of ways per test:

* random frames: bytes, and msgpack of random values as the header;
* header edits: fields deleted, given values of the wrong type, extra keys, nested garbage in dict fields;
* raw splices: msgpack the encoder never writes (ext types, invalid UTF-8, non-str map keys, duplicate keys,
  declared lengths past the end, nesting deeper than the unpacker's stack);
* array references: bad ``__nd__`` indices, wrong dtypes, wrong ranks, huge shapes, byte lengths that do
  not match, aliased frames, references in non-array fields;
* frame lists: truncated, extended, duplicated, reordered, a header of one type over another's frames;
* type tags and versions;
* mutation bursts: stacked bit flips, byte edits, frame swaps/drops of valid encodings, many per example.

Volume (asserted by ``test_fuzz_volume``, which runs last): 11,570 hypothesis examples; 12,550 malformed
inputs per registered message type (213,350 in all), most of them from the bursts, >= 90 % of them rejected.
The hypothesis database is off, so runs do not depend on earlier ones.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import itertools
import os
import random
import time
import types
import typing
from collections import Counter
from datetime import timedelta
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cascade_rl.protocol import agents, codec, messages, weights_group  # noqa: F401  (each registers its wire types)
from cascade_rl.protocol.codec import ALLOWED_DTYPES, PROTOCOL_VERSION, ProtocolError, decode, encode, registered_types
from cascade_rl.protocol.messages import Heartbeat, PromptRequest, Ready, Score, WeightsReady, WorkKey
from cascade_rl.protocol.sockets import WorkerLink, recv_routed, send

REGISTERED = registered_types()
TYPES = sorted(REGISTERED)
SCALE = float(os.environ.get("CASCADE_RL_FUZZ_SCALE", "1"))

# --------------------------------------------------------------------------- budget

# Hypothesis examples per test; each test but random frames runs once per registered type (17):
#   5 single-input families x 110 + 60 bursts = 610 examples per type, 10,370 in all, + 1,200 random frames;
#   malformed inputs per type: 5 x 110 + 60 bursts x 200 mutants = 12,550 (213,350 over the 17 types).
EXAMPLES = int(110 * SCALE)
BURSTS = int(60 * SCALE)
RANDOM_FRAMES = int(1200 * SCALE)
BURST_SIZE = 200  # mutants decoded per burst example (cheap: the hypothesis draw is per example, not per mutant)
MIN_EXAMPLES = 8_000
MIN_INPUTS_PER_TYPE = 10_000

FUZZ = settings(
    database=None,  # no example database: nothing written to .hypothesis, runs independent of each other
    # An example costs ~3 ms (a decode ~20 us); 2 s is far above that, so a loaded CI box does not flake, and
    # still trips on a decode that loops or blows up quadratically. A true hang is the watchdog's (HANG_S).
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
HANG_S = 120  # a single test stuck this long (a hang even in C code) dumps every stack and exits

EXAMPLES_RUN: Counter[str] = Counter()  # family -> hypothesis examples run
INPUTS: Counter[str] = Counter()  # message type -> malformed inputs decoded
REJECTED: Counter[str] = Counter()  # message type -> inputs decode rejected
FAMILIES_RUN: set[tuple[str, str]] = set()
PER_TYPE_FAMILIES = ("header_edits", "raw_splices", "array_refs", "frame_lists", "type_version", "bursts")


@pytest.fixture(autouse=True)
def _hang_watchdog():
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _counted(family: str, type_name: str) -> None:
    EXAMPLES_RUN[family] += 1
    FAMILIES_RUN.add((family, type_name))


# --------------------------------------------------------------------------- the property

# Two codec bugs this file found, now fixed in protocol/codec.py (tests under "found bugs" below):
# * msgpack's max_ext_len=0 still admitted a zero-length ext value, so an ``Any`` field could hold an ExtType;
# * nesting was bounded only by msgpack's 1024-deep stack while ``encode`` recursed in Python and failed past
#   ~490 levels, so decode accepted messages that could not be sent on (the supervisor re-encodes heartbeat
#   counters). Free-form values are now refused past codec.MAX_DEPTH levels.
_TOLERATED_DEPTH = codec.MAX_DEPTH + 2  # the field itself and its container sit above a free-form value


def _plain(where: str, value: Any) -> bool:
    """Assert ``value`` holds only msgpack's plain types (walked without recursion: it may be 1000 deep).
    Returns False when it holds something a known bug lets through, so it need not round-trip."""
    ok, stack = True, [(where, value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if isinstance(v, msgpack.ExtType):
            raise AssertionError(f"{path}: decode accepted an ext value")
        elif depth > _TOLERATED_DEPTH:
            raise AssertionError(f"{path}: decode accepted a value nested {depth} deep")
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x, depth + 1) for i, x in enumerate(v))
        elif isinstance(v, dict):
            assert all(isinstance(k, (str, bytes)) for k in v), f"{path}: map keys {list(v)!r}"
            stack.extend((f"{path}[{k!r}]", x, depth + 1) for k, x in v.items())
        elif dataclasses.is_dataclass(v):
            stack.extend((f"{path}.{f.name}", getattr(v, f.name), depth + 1) for f in dataclasses.fields(v))
        else:
            assert v is None or isinstance(v, (bool, int, float, str, bytes)), f"{path}: decode built {v!r}"
    return ok


def _assert_valid(msg: Any) -> None:
    cls = type(msg)
    assert REGISTERED.get(getattr(cls, "TYPE", None)) is cls, f"decode built a {cls!r}"
    if hasattr(msg, "validate"):
        assert not msg.validate(), msg.validate()
    roundtrips = True
    for f in dataclasses.fields(msg):
        value, spec = getattr(msg, f.name), f.metadata.get("array")
        if spec is None:
            roundtrips &= _plain(f"{cls.TYPE}.{f.name}", value)
        elif value is None:
            assert f.default is None, f"{cls.TYPE}.{f.name}: a required array decoded to None"
        else:
            assert isinstance(value, np.ndarray) and value.dtype == np.dtype(spec.dtype), f.name
            assert value.ndim == spec.ndim and not value.flags.writeable, f.name
    if roundtrips:  # what was accepted is well-formed: it encodes and decodes to the same header
        again = decode(encode(msg))
        assert type(again) is cls and bytes(encode(again)[0]) == bytes(encode(msg)[0])


def _check(type_name: str, frames: list, expect: tuple[type, ...] | None = None) -> None:
    """Decode ``frames``: a ProtocolError or a valid message; anything else fails the property."""
    INPUTS[type_name] += 1
    try:
        msg = decode(frames, expect)
    except ProtocolError as e:
        assert str(e), "a ProtocolError must say why"
        REJECTED[type_name] += 1
        return
    if expect is not None:
        assert type(msg) in expect
    _assert_valid(msg)


# --------------------------------------------------------------------------- valid messages

_MSGPACK_INT = st.integers(-(2**63), 2**64 - 1)
_LEAVES = st.one_of(st.none(), st.booleans(), _MSGPACK_INT, st.floats(), st.text(max_size=8), st.binary(max_size=8))
_COUNT = st.integers(0, 2**64 - 1)
_GROUP = st.text(min_size=1, max_size=6)
_SAMPLING_KEYS = st.one_of(  # a PromptRequest's and its Rollouts' (a first turn's row, a multi-turn row's turn)
    st.builds(lambda group, attempt, index: WorkKey.sample(group, attempt).answer(index), _GROUP, _COUNT, _COUNT),
    st.builds(WorkKey.step, _GROUP, _COUNT, st.just("gen"), _COUNT, _COUNT),
)
_WORK_KEYS = st.one_of(  # every kind of key the orchestrator builds (WorkKey.validate refuses the rest)
    st.builds(WorkKey.score, _GROUP, _COUNT, _COUNT),
    st.builds(WorkKey.teacher, _GROUP, _COUNT),
    st.builds(WorkKey.step, _GROUP, _COUNT, st.just("env"), _COUNT, _COUNT),
    _SAMPLING_KEYS,
)
_ANY = st.recursive(
    _LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=5
)


def _hint_strategy(hint: Any) -> st.SearchStrategy:
    """Valid header values for a field's type hint (the hints the codec supports)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_hint_strategy(a) for a in args])
    if hint is type(None):
        return st.none()
    if hint is Any:
        return _ANY
    if hint is WorkKey:
        return _WORK_KEYS
    scalars = {bool: st.booleans(), int: _MSGPACK_INT, float: st.floats(), str: st.text(max_size=12)}
    if hint in scalars:
        return scalars[hint]
    if hint is dict or origin is dict:
        key, value = args or (str, Any)
        return st.dictionaries(_hint_strategy(key), _hint_strategy(value), max_size=3)
    if hint is list or origin is list:
        return st.lists(_hint_strategy(args[0] if args else Any), max_size=3)
    if dataclasses.is_dataclass(hint):
        fields = typing.get_type_hints(hint)
        return st.builds(hint, **{f.name: _hint_strategy(fields[f.name]) for f in dataclasses.fields(hint)})
    raise TypeError(f"test_fuzz does not know how to generate {hint!r}: teach _hint_strategy")


def _fix_ready(draw, kw: dict) -> None:
    kw["slots"], kw["rank"] = abs(kw["slots"]), abs(kw.get("rank", 0))


_AGENT_KEYS = st.builds(lambda group, index, attempt: WorkKey(group, "agent", index, 0, attempt), _GROUP, _COUNT,
                        _COUNT)  # a user's agent's run of one row (protocol/agents.py)
_GEN_KEYS = st.builds(WorkKey.step, _GROUP, _COUNT, st.just("gen"), _COUNT, _COUNT)  # an agent's model call


def _fix_segment_starts(starts, total: int):
    """Segment starts as validate() wants them: increasing, inside 1..total - 1 (None when none fit)."""
    if starts is None:
        return None
    kept = sorted({int(s) for s in np.asarray(starts).ravel() if 0 < int(s) < total})
    return np.array(kept, np.int32) if kept else None


def _fix_rollout(draw, kw: dict) -> None:  # arrays share one length, so response ids and log-probs match
    kw["key"] = draw(_SAMPLING_KEYS)
    kw["segment_starts"] = _fix_segment_starts(kw.get("segment_starts"),
                                               len(kw["prompt_ids"]) + len(kw["response_ids"]))
    kw["finish_reason"] = draw(st.sampled_from(["stop", "length", "error"]))
    if kw.get("routes") is not None:  # the experts of every token the engine ran: prompt + response - 1
        ran = len(kw["prompt_ids"]) + len(kw["response_ids"]) - 1
        ids = draw(st.lists(st.integers(0, 2**15 - 1), min_size=4 * ran, max_size=4 * ran)) if ran > 0 else []
        kw["routes"] = np.array(ids, np.int16).reshape(max(ran, 0), 2, 2) if ran >= 0 else None
    versions = kw.get("token_versions")
    if versions is not None and len(versions):  # the rollout's version is its oldest token's
        kw["policy_version"] = int(versions.min())


def _fix_deadline(draw, kw: dict) -> None:
    kw["deadline_s"] = draw(st.floats(min_value=0.001, max_value=1e6))


def _fix_prompt_request(draw, kw: dict) -> None:  # a multi-turn row's next turn samples one sequence
    kw["key"] = draw(_SAMPLING_KEYS)
    if kw["key"].kind == "gen":
        kw["n"] = 1


def _fix_env_request(draw, kw: dict) -> None:
    kw["messages"] = [*kw.get("messages", []), {"role": "assistant", "content": draw(st.text(max_size=6))}]
    _fix_deadline(draw, kw)


def _fix_group_score_request(draw, kw: dict) -> None:
    kw["keys"] = draw(st.lists(_WORK_KEYS, min_size=1, max_size=3))
    kw["texts"] = draw(st.lists(st.text(max_size=6), min_size=len(kw["keys"]), max_size=len(kw["keys"])))
    _fix_deadline(draw, kw)


def _fix_teacher_request(draw, kw: dict) -> None:  # response_lens split response_ids into >= 1-token parts
    lens = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    kw["response_ids"] = np.array(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=sum(lens),
                                                max_size=sum(lens))), np.int32)
    kw["response_lens"] = np.array(lens, np.int32)
    kw["temperature"] = draw(st.floats(min_value=1e-3, max_value=1e3))
    _fix_deadline(draw, kw)


def _fix_train_batch(draw, kw: dict) -> None:
    n = len(kw["rewards"])  # rows: each >= 1 token, every per-token array one entry per token (packed rows)
    lengths = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    kw["lengths"], tokens = np.array(lengths, np.int32), sum(lengths)
    for name, dtype, rest in (("input_ids", np.int32, ()), ("response_mask", np.bool_, ()),
                              ("inf_logprobs", np.float32, ()), ("teacher_logprobs", np.float32, ()),
                              ("routes", np.int16, (2, 2))):
        if name in ("input_ids", "response_mask", "inf_logprobs") or kw.get(name) is not None:
            size = tokens * int(np.prod(rest, dtype=np.int64)) * np.dtype(dtype).itemsize
            raw = draw(st.binary(min_size=size, max_size=size))
            kw[name] = (np.frombuffer(raw, np.uint8) & 1).astype(bool) if dtype is np.bool_ else \
                np.frombuffer(raw, dtype).reshape(tokens, *rest)
    kw["versions"] = kw["versions"][:n] if len(kw["versions"]) == n else np.zeros(n, np.int32)
    if kw.get("loss_masked") is not None:
        kw["loss_masked"] = np.zeros(n, bool)
    if kw.get("segment_starts") is not None:  # one row of starts per row, each inside the row (-1: none)
        starts = [draw(st.integers(-1, length - 1)) for length in lengths]
        kw["segment_starts"] = np.array(starts, np.int32).reshape(n, 1) if n else None
    kw["group_size"] = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0] or [1, 2, 3]))
    if kw.get("ids"):  # rollout ids: none, or one per row
        kw["ids"] = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n))
    kw["part"] = abs(kw.get("part", 0))  # a part of a step of at least its own groups (0: the whole step)
    kw["step_groups"] = draw(st.sampled_from([0, n // kw["group_size"] + abs(kw.get("step_groups", 0)) % 4]))


def _fix_agent_request(draw, kw: dict) -> None:
    kw["key"] = draw(_AGENT_KEYS)
    kw["base_url"], kw["api_key"] = "http://127.0.0.1:1/v1", draw(st.text(min_size=1, max_size=8))
    _fix_deadline(draw, kw)


def _fix_agent_done(draw, kw: dict) -> None:
    kw["key"] = draw(_AGENT_KEYS)
    if kw.get("reward") is not None:
        kw["reward"] = draw(st.floats(allow_nan=False, allow_infinity=False))


def _fix_gateway_generate(draw, kw: dict) -> None:
    kw["key"] = draw(_GEN_KEYS)
    kw["prompt_ids"] = np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4)), np.int32)
    kw["segment"], kw["max_tokens"] = abs(kw.get("segment", 0)), abs(kw.get("max_tokens", 0))


def _fix_gateway_reward(draw, kw: dict) -> None:
    kw["reward"] = draw(st.floats(allow_nan=False, allow_infinity=False))


def _fix_control(draw, kw: dict) -> None:
    kw["op"] = draw(st.sampled_from(["status", "scale", "swap", "stop"]))


def _fix_weights_get(draw, kw: dict) -> None:
    kw["version"], kw["chunk"] = abs(kw["version"]), abs(kw["chunk"])
    kw["part"] = kw.get("part", "")[:32]


def _fix_weights_chunk(draw, kw: dict) -> None:  # chunk < chunks, each chunk >= 1 byte, data within the file
    kw["version"] = abs(kw["version"])
    kw["chunks"] = draw(st.integers(1, 5))
    kw["chunk"] = draw(st.integers(0, kw["chunks"] - 1))
    kw["nbytes"] = draw(st.integers(max(len(kw["data"]), kw["chunks"] if kw["chunks"] > 1 else 0), 2**63 - 1))


def _fix_weights_join(draw, kw: dict) -> None:  # a member id the publisher can name a group member by
    kw["version"] = draw(st.integers(0, 2**63 - 1))
    kw["member"] = draw(st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True))
    kw["group"], kw["backends"] = kw.get("group", "")[:64], kw.get("backends", ["gloo"])[:4]


def _fix_weights_group(draw, kw: dict) -> None:  # rank 1.. of a group of size, a backend, a named group
    kw["version"], kw["nbytes"] = draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**63 - 1))
    kw["chunk"] = draw(st.integers(1, 2**63 - 1))
    kw["size"] = draw(st.integers(2, 64))
    kw["rank"] = draw(st.integers(1, kw["size"] - 1))
    kw["backend"] = draw(st.sampled_from(["gloo", "nccl"]))
    kw["group"] = draw(st.from_regex(r"[a-z0-9-]{1,64}", fullmatch=True))


def _fix_weights_refused(draw, kw: dict) -> None:
    kw["version"] = draw(st.integers(-1, 2**64 - 1))


# What each type's validate() needs; test_generator_makes_valid_messages fails for a new type that needs more.
FIXUPS = {
    "ready": _fix_ready,
    "rollout": _fix_rollout,
    "prompt_request": _fix_prompt_request,
    "env_request": _fix_env_request,
    "group_score_request": _fix_group_score_request,
    "score_request": _fix_deadline,
    "teacher_request": _fix_teacher_request,
    "train_batch": _fix_train_batch,
    "control": _fix_control,
    "weights_get": _fix_weights_get,
    "weights_chunk": _fix_weights_chunk,
    "weights_refused": _fix_weights_refused,
    "weights_join": _fix_weights_join,
    "weights_group": _fix_weights_group,
    "agent_request": _fix_agent_request,
    "agent_done": _fix_agent_done,
    "gateway_generate": _fix_gateway_generate,
    "gateway_reward": _fix_gateway_reward,
}


@st.composite
def valid_message(draw, type_name: str) -> Any:
    cls = REGISTERED[type_name]
    hints = typing.get_type_hints(cls)
    rows, cols = draw(st.integers(0, 4)), draw(st.integers(0, 5))  # every rank-1 array [rows], rank-2 [rows, cols]
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("array")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if has_default and draw(st.integers(0, 3)) == 0:
            continue  # leave it to the default (absent or null on the wire)
        if spec is not None:
            shape = (rows, cols, 2, 2)[: spec.ndim]
            nbytes = int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
            kw[f.name] = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), spec.dtype).reshape(shape)
        else:
            kw[f.name] = draw(_hint_strategy(hints[f.name]))
    if type_name in FIXUPS:
        FIXUPS[type_name](draw, kw)
    return cls(**kw)


def _frames(msg: Any) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _valid_frames(type_name: str) -> st.SearchStrategy:
    return valid_message(type_name).map(_frames)


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_generator_makes_valid_messages(type_name, data):
    """The starting points are valid: every mutation below starts from a message decode accepts."""
    msg = data.draw(valid_message(type_name))
    out = decode(encode(msg))
    _assert_valid(out)
    assert bytes(encode(out)[0]) == bytes(encode(msg)[0])


# --------------------------------------------------------------------------- garbage

_HUGE = [2**31, 2**32, 2**39, 2**40 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), -1]
_NAMES = [*TYPES, "SamplingParams", "", "ROLLOUT", "rollout ", "score\x00", "__nd__"]
_GARBAGE_LEAVES = st.one_of(
    _LEAVES,
    st.sampled_from([*_HUGE, float("nan"), float("inf"), -0.0, *ALLOWED_DTYPES, "object", "int16", *_NAMES]),
    st.fixed_dictionaries(
        {
            "__nd__": st.integers(-2, 6),
            "dtype": st.sampled_from(ALLOWED_DTYPES),
            "shape": st.lists(st.integers(0, 8), max_size=3),
        }
    ),  # a plausible array reference
)
_KEYS = st.one_of(
    st.text(max_size=5),
    st.sampled_from(["__nd__", "dtype", "shape", "t", "v"]),
    st.integers(0, 3),
    st.binary(max_size=3),
)  # int keys: msgpack packs them, decode must refuse them
GARBAGE = st.recursive(
    _GARBAGE_LEAVES, lambda c: st.lists(c, max_size=4) | st.dictionaries(_KEYS, c, max_size=4), max_leaves=12
)


def _paths(node: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every (container path, key) in a decoded header, a few levels deep."""
    out: list[tuple] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((prefix, key))
        if depth < 3:
            out.extend(_paths(value, (*prefix, key), depth + 1))
    return out


def _at(header: dict, prefix: tuple) -> Any:
    for key in prefix:
        header = header[key]
    return header


def _field_paths(header: dict) -> list[tuple]:
    return [p for p in _paths(header) if p[0] or p[1] not in ("t", "v")]


# --------------------------------------------------------------------------- families


@settings(FUZZ, max_examples=RANDOM_FRAMES)
@given(
    frames=st.one_of(
        st.lists(st.binary(max_size=64), max_size=5),
        st.tuples(GARBAGE.map(_pack), st.lists(st.binary(max_size=32), max_size=3)).map(lambda t: [t[0], *t[1]]),
    )
)
def test_random_frames(frames):
    _counted("random_frames", "-")
    _check("-", frames)


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=EXAMPLES)
@given(data=st.data())
def test_header_edits(type_name, data):
    """Fields missing, of the wrong type, extra keys, nested garbage in dict fields, or a header rebuilt with
    every field random."""
    _counted("header_edits", type_name)
    frames = data.draw(_valid_frames(type_name))
    header = _header(frames)
    if data.draw(st.integers(0, 9)) == 0:
        fields = [f.name for f in dataclasses.fields(REGISTERED[type_name])]
        chosen = data.draw(st.lists(st.sampled_from(fields), unique=True))
        header = {"t": type_name, "v": PROTOCOL_VERSION, **{k: data.draw(GARBAGE) for k in chosen}}
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _field_paths(header)
        op = data.draw(st.sampled_from(["delete", "retype", "extra"] if paths else ["extra"]))
        prefix, key = data.draw(st.sampled_from(paths)) if paths else ((), None)
        target = _at(header, prefix)
        if op == "delete":
            target.pop(key)
        elif op == "retype":
            target[key] = data.draw(GARBAGE)
        elif isinstance(target, dict):
            target[data.draw(_KEYS)] = data.draw(GARBAGE)
        else:
            target.append(data.draw(GARBAGE))
    _check(type_name, [_pack(header), *frames[1:]])


_SENTINEL = "\u2603 fuzz splice \u2603"
_RAW = [
    b"\xc1",  # the one byte msgpack never uses
    b"\xc7\x00\x05",  # ext 5, zero bytes (see test_zero_length_ext_type_is_rejected)
    b"\xc7\x00\xff",  # timestamp ext with no data
    b"\xd4\x05\x00",  # fixext 1
    b"\xd6\xff\x00\x00\x00\x00",  # timestamp 32
    b"\xa2\xff\xfe",  # str with invalid UTF-8
    b"\xc4\x02ab",  # bin where a str may be expected
    b"\x81\x01\x02",  # map with an int key
    b"\x81\xc0\x02",  # map with a nil key
    b"\x81\xca\x00\x00\x00\x00\x01",  # map with a float key
    b"\x81\xc4\x01k\x01",  # map with a bin key
    b"\x82\xa1k\x01\xa1k\xa1x",  # map with a duplicate key
    b"\xdb\xff\xff\xff\xff",  # str32 declaring 4 GiB, none present
    b"\xdd\xff\xff\xff\xff",  # array32 declaring 4 G items
    b"\xdf\xff\xff\xff\xff\xa1k",  # map32 declaring 4 G pairs
    b"\xc6\x7f\xff\xff\xff",  # bin32 declaring 2 GiB
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xca\x7f\xc0\x00\x00",  # float32 NaN
    b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",  # float64 inf
    b"\xcb\x00\x00",  # truncated float64
    b"\xdc\x00\x00",  # array16, empty
    b"\x92\xa1a",  # array missing an element
    b"",  # nothing where a value should be
]


def _splice(header: dict, raw: bytes) -> bytes:
    """``header`` packed, with the field set to _SENTINEL written as the raw msgpack ``raw``."""
    return _pack(header).replace(_pack(_SENTINEL), raw, 1)


def _nested(depth: int, kind: str) -> bytes:
    return (b"\x91" * depth + b"\xc0") if kind == "list" else (b"\x81\xa1k" * depth + b"\xc0")


_RAW_VALUES = st.one_of(
    st.sampled_from(_RAW),
    st.binary(max_size=12),
    st.builds(
        _nested, st.sampled_from([2, 100, 1000, 1021, 1022, 1023, 1024, 1025, 5000]), st.sampled_from(["list", "map"])
    ),
)


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=EXAMPLES)
@given(data=st.data())
def test_raw_splices(type_name, data):
    """Msgpack the encoder never writes, spliced in for a field, a nested value, the type tag or the version."""
    _counted("raw_splices", type_name)
    frames = data.draw(_valid_frames(type_name))
    header = _header(frames)
    prefix, key = data.draw(st.sampled_from(_paths(header)))
    _at(header, prefix)[key] = _SENTINEL
    _check(type_name, [_splice(header, data.draw(_RAW_VALUES)), *frames[1:]])


def _array_fields(type_name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(REGISTERED[type_name]) if "array" in f.metadata]


_INDICES = st.one_of(st.integers(-2, 8), st.sampled_from([*_HUGE, True, False, None, "1", 1.0, [1], {}]))
_DTYPES = st.one_of(
    st.sampled_from([*ALLOWED_DTYPES, "int16", "uint32", "object", "O", "<i4", ">i4", "f4", "S4", "V8", "int32 ", ""]),
    GARBAGE,
)
_SHAPES = st.one_of(
    st.lists(st.one_of(st.integers(-2, 8), st.sampled_from(_HUGE)), max_size=5),
    st.lists(st.sampled_from([2**32, 2**39, 2**40 - 1]), min_size=1, max_size=4),  # huge, right rank or not
    st.lists(st.sampled_from([True, 1.0, None, "2", [2]]), min_size=1, max_size=2),
    GARBAGE,
)


_ARRAY_OPS = ("index", "dtype", "shape", "keys", "replace", "alias", "null", "bytes", "inject")


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=EXAMPLES)
@given(data=st.data())
def test_array_refs(type_name, data):
    """Array references with out-of-range or aliased frame indices, wrong dtypes, wrong ranks, huge shapes,
    frames of the wrong byte length; in types without arrays, references in plain fields."""
    _counted("array_refs", type_name)
    frames = data.draw(_valid_frames(type_name))
    header = _header(frames)
    for _ in range(data.draw(st.integers(1, 3))):
        refs = [k for k in _array_fields(type_name) if isinstance(header.get(k), dict)]
        op = data.draw(st.sampled_from(_ARRAY_OPS))
        if op == "inject" or not refs:  # an array reference (and its frame) where no array belongs
            fields = [f.name for f in dataclasses.fields(REGISTERED[type_name]) if "array" not in f.metadata]
            name = data.draw(st.sampled_from(fields or ["extra"]))
            header[name] = {"__nd__": len(frames), "dtype": data.draw(st.sampled_from(ALLOWED_DTYPES)), "shape": [1]}
            frames = [*frames, data.draw(st.binary(max_size=8))]
            continue
        name = data.draw(st.sampled_from(refs))
        ref = header[name]
        if op == "index":
            ref["__nd__"] = data.draw(_INDICES)
        elif op == "dtype":
            ref["dtype"] = data.draw(_DTYPES)
        elif op == "shape":
            ref["shape"] = data.draw(_SHAPES)
        elif op == "keys":
            if data.draw(st.booleans()):
                ref.pop(data.draw(st.sampled_from(["__nd__", "dtype", "shape"])), None)
            else:
                ref[data.draw(_KEYS)] = data.draw(GARBAGE)
        elif op == "replace":
            header[name] = data.draw(GARBAGE)
        elif op == "alias":  # two fields on one frame
            header[name] = dict(header[data.draw(st.sampled_from(refs))])
        elif op == "null":
            header[name] = None
        elif op == "bytes" and isinstance(ref.get("__nd__"), int) and 0 < ref["__nd__"] < len(frames):
            i, cut = ref["__nd__"], data.draw(st.integers(-9, 9))
            frames = list(frames)
            frames[i] = frames[i][:cut] if cut < 0 else frames[i] + bytes(cut) if cut else data.draw(st.binary())
    _check(type_name, [_pack(header), *frames[1:]])


_FRAME_OPS = (
    "truncate",
    "sublist",
    "append",
    "duplicate",
    "permute",
    "insert_empty",
    "foreign_header",
    "foreign_arrays",
)


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=EXAMPLES)
@given(data=st.data())
def test_frame_lists(type_name, data):
    """Frames dropped, added, duplicated or reordered; another message's header over these frames."""
    _counted("frame_lists", type_name)
    frames = data.draw(_valid_frames(type_name))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(_FRAME_OPS))
        if op == "truncate":
            frames = frames[: data.draw(st.integers(0, max(0, len(frames) - 1)))]
        elif op == "sublist" and frames:
            keep = data.draw(st.lists(st.booleans(), min_size=len(frames), max_size=len(frames)))
            frames = [f for f, k in zip(frames, keep) if k]
        elif op == "append":
            frames = [*frames, *data.draw(st.lists(st.binary(max_size=24), min_size=1, max_size=3))]
        elif op == "duplicate" and frames:
            i = data.draw(st.integers(0, len(frames) - 1))
            frames = [*frames[: i + 1], frames[i], *frames[i + 1 :]]
        elif op == "permute":
            frames = data.draw(st.permutations(frames))
        elif op == "insert_empty":
            i = data.draw(st.integers(0, len(frames)))
            frames = [*frames[:i], b"", *frames[i:]]
        elif op == "foreign_header":  # type confusion: another type's header over these array frames
            other = data.draw(_valid_frames(data.draw(st.sampled_from(TYPES))))
            frames = [other[0], *frames[1:]]
        elif op == "foreign_arrays":
            other = data.draw(_valid_frames(data.draw(st.sampled_from(TYPES))))
            frames = [*frames[:1], *other[1:]]
    _check(type_name, list(frames))


_VERSIONS = st.one_of(
    st.sampled_from([0, 2, -1, 2**64 - 1, True, False, 1.0, "1", None, b"\x01", [1], {"v": 1}]), _MSGPACK_INT, GARBAGE
)


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=EXAMPLES)
@given(data=st.data())
def test_type_version(type_name, data):
    """Wrong, missing or mistyped type tags and versions; a right tag on another type's fields; decode told to
    expect only some types."""
    _counted("type_version", type_name)
    frames = data.draw(_valid_frames(type_name))
    header = _header(frames)
    change = data.draw(st.sampled_from(["t", "v", "both", "drop_t", "drop_v"]))
    if change in ("t", "both"):
        header["t"] = data.draw(st.one_of(st.sampled_from(_NAMES), st.text(max_size=8), GARBAGE))
    if change in ("v", "both"):
        header["v"] = data.draw(_VERSIONS)
    if change.startswith("drop_"):
        header.pop(change[-1])
    expect = data.draw(
        st.none() | st.lists(st.sampled_from(TYPES), unique=True).map(lambda names: tuple(REGISTERED[n] for n in names))
    )
    _check(type_name, [_pack(header), *frames[1:]], expect)


# --------------------------------------------------------------------------- mutation bursts


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.choice([0x00, 0xFF, 0xC1, 0xC7, 0xDD, 0xDF, rng.randrange(256)])
    elif op == 2:
        del b[rng.randint(0, len(b)) :]
    elif op == 3:
        at = rng.randint(0, len(b))
        b[at:at] = rng.randbytes(rng.randint(1, 6))
    elif op == 4 and b:
        at = rng.randrange(len(b))
        del b[at : at + rng.randint(1, 4)]
    else:
        b += rng.randbytes(rng.randint(1, 4))
    return bytes(b)


_PY_GARBAGE = [
    None,
    True,
    0,
    -1,
    2**40,
    2**64 - 1,
    1.5,
    float("nan"),
    "",
    "x",
    "int32",
    b"\x00",
    [],
    [0],
    [2**39, 2**39],
    {},
    {"__nd__": 1, "dtype": "int32", "shape": [1]},
    {"k": [{"k": None}]},
]


def _mutate_header(rng: random.Random, frame: bytes) -> bytes:
    header = msgpack.unpackb(frame, raw=False)
    paths = _paths(header)
    if not paths:
        return _mutate_bytes(rng, frame)
    prefix, key = rng.choice(paths)
    target = _at(header, prefix)
    if rng.random() < 0.3:
        target.pop(key)
    else:
        target[key] = rng.choice(_PY_GARBAGE)
    return _pack(header)


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        op = rng.random()
        if op < 0.3 and frames:
            frames[0] = _mutate_bytes(rng, frames[0])
        elif op < 0.45 and len(frames) > 1:
            i = rng.randrange(1, len(frames))
            frames[i] = _mutate_bytes(rng, frames[i])
        elif op < 0.55 and len(frames) > 1:
            i, j = rng.sample(range(len(frames)), 2)
            frames[i], frames[j] = frames[j], frames[i]
        elif op < 0.62 and frames:
            del frames[rng.randrange(len(frames))]
        elif op < 0.69:
            frames.insert(rng.randint(0, len(frames)), rng.randbytes(rng.choice([0, 1, 4, 8])))
        elif op < 0.74 and frames:
            i = rng.randrange(len(frames))
            frames.insert(i, frames[i])
        elif frames:
            try:
                frames[0] = _mutate_header(rng, frames[0])
            except Exception:  # the header is already garbled by an earlier step
                frames[0] = _mutate_bytes(rng, frames[0])
    return frames


@pytest.mark.parametrize("type_name", TYPES)
@settings(FUZZ, max_examples=BURSTS, deadline=timedelta(seconds=10))  # BURST_SIZE decodes per example
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_bursts(type_name, data, seed):
    """Stacked byte-level and structural mutations of one valid encoding, BURST_SIZE of them per example."""
    _counted("bursts", type_name)
    original = data.draw(_valid_frames(type_name))
    rng = random.Random(seed)
    for i in range(BURST_SIZE):
        mutant = _mutate(rng, original)
        try:
            _check(type_name, mutant)
        except Exception as e:
            raise AssertionError(f"mutant {i} of seed {seed}: {type(e).__name__}: {e}\nframes={mutant!r}") from e


# --------------------------------------------------------------------------- found bugs (fixed)


def test_zero_length_ext_type_is_rejected():
    header = {"t": "control_reply", "v": PROTOCOL_VERSION, "ok": True, "result": _SENTINEL}
    with pytest.raises(ProtocolError):
        decode([_splice(header, b"\xc7\x00\x05")])  # result = msgpack.ExtType(5, b"")


@pytest.mark.parametrize("kind", ["list", "map"])
def test_decode_accepts_only_what_encode_can_send_on(kind):
    header = {
        "t": "heartbeat",
        "v": PROTOCOL_VERSION,
        "role": "sampler",
        "worker_id": "w",
        "pid": 1,
        "state": "running",
        "counters": {"deep": _SENTINEL},
    }
    for depth in (100, 300, 480, 500, 700, 1000, 1021):
        try:
            msg = decode([_splice(header, _nested(depth, kind))])
        except ProtocolError:
            continue
        encode(msg)  # a supervisor does this with heartbeat counters, to answer `ctl status`


# --------------------------------------------------------------------------- over real sockets


def _malformed_burst(rng: random.Random, expect: tuple[type, ...], n: int) -> list[list[bytes]]:
    """``n`` multiparts each of which decode(frames, expect) rejects, of many kinds."""
    valid = [
        _frames(PromptRequest(key=WorkKey.sample("g", 0), domain="math", prompt_ids=np.arange(5, dtype=np.int32))),
        _frames(Score(key=WorkKey.score("k", 0, 0), reward=1.0, ok=True)),  # a valid message of a type the socket does not take
        _frames(Ready(worker_id="w", role="sampler", slots=2)),
        _frames(WeightsReady(version=3, uri="file:///w")),
    ]
    fixed = [
        [b""],
        [b"\xc1"],
        [b"\x80"],
        [_pack({"t": "rollout", "v": 2})],
        [_pack(["t", "score"])],
        [b"\x91" * 5000 + b"\xc0"],
        [_pack({"t": "score", "v": 1, "key": "k"}), b"extra"],
    ]
    out: list[list[bytes]] = []
    candidates = itertools.chain(fixed, (_mutate(rng, rng.choice(valid)) for _ in itertools.count()))
    while len(out) < n:
        frames = next(candidates)
        if not frames:
            continue  # zmq cannot send an empty multipart
        try:
            decode(frames, expect)
        except ProtocolError:
            out.append(frames)
    return out


def _poll_until(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout_s} s")


def test_worker_link_counts_malformed_bursts_and_keeps_serving():
    """A real WorkerLink over TCP: malformed bursts on its DEALER (from the orchestrator's ROUTER) and on its
    weights SUB are each counted once, dropped, reported in its heartbeat, and the valid messages after them
    still come through."""
    ctx = zmq.Context.instance()  # WorkerLink's context
    router, xpub, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
    for s in (router, xpub, pull):
        s.setsockopt(zmq.LINGER, 0)
    ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in (router, xpub, pull)]
    router_ep, pub_ep, beat_ep = (f"tcp://127.0.0.1:{p}" for p in ports)
    link = WorkerLink(
        "fuzz-sampler",
        "sampler",
        router_ep,
        beat_ep,
        pub_ep,
        expect=(PromptRequest,),
        status=lambda: {"state": "running"},
        heartbeat_s=0.05,
    ).start()
    try:
        link.send(Ready(worker_id="fuzz-sampler", role="sampler", slots=1))
        assert router.poll(10_000), "the worker never connected"
        ident, *ready = router.recv_multipart()
        assert isinstance(decode(ready), Ready)
        assert xpub.poll(10_000) and xpub.recv() == b"\x01", "the worker never subscribed to weights"

        rng = random.Random(7)
        dealer_burst = _malformed_burst(rng, (PromptRequest,), 300)
        sub_burst = _malformed_burst(rng, (WeightsReady,), 100)
        for frames in dealer_burst:
            router.send_multipart([ident, *frames])
        for frames in sub_burst:
            xpub.send_multipart(frames)
        request = PromptRequest(key=WorkKey.sample("after", 0), domain="math", prompt_ids=np.arange(3, dtype=np.int32))
        send(router, request, identity=ident)
        send(xpub, WeightsReady(version=9, uri="file:///w9"))

        received = [link.inbox.get(timeout=10), link.inbox.get(timeout=10)]
        by_type = {type(m): m for m in received}
        assert by_type[PromptRequest].key.group == "after" and by_type[PromptRequest].prompt_ids.tolist() == [0, 1, 2]
        assert by_type[WeightsReady].version == 9
        assert link.inbox.empty()
        assert link.malformed == len(dealer_burst) + len(sub_burst)

        def reported() -> bool:  # the count reaches the supervisor in the heartbeat
            while pull.poll(0):
                beat = decode(pull.recv_multipart(), (Heartbeat,))
                if beat.counters.get("malformed") == link.malformed:
                    return True
            return False

        _poll_until(reported)
    finally:
        link.close()
        for s in (router, xpub, pull):
            s.close(linger=0)


def test_router_path_counts_malformed_and_names_the_sender():
    """The orchestrator's side: a ROUTER reading with ``recv_routed`` (as ``Orchestrator._receive`` does)
    rejects every malformed multipart from a misbehaving DEALER with the sender's identity in the reason,
    then takes the peer's valid Ready."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"rogue-7")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    inbound = (Ready, Score, WeightsReady)
    burst = _malformed_burst(random.Random(11), inbound, 300)
    try:
        for frames in burst:
            dealer.send_multipart(frames)
        send(dealer, Ready(worker_id="rogue-7", role="verifier", slots=3))
        malformed, got = 0, None
        while got is None:
            assert router.poll(10_000), f"stalled after {malformed} malformed messages"
            try:
                ident, got = recv_routed(router, inbound)
            except ProtocolError as e:
                assert "from b'rogue-7'" in str(e)
                malformed += 1
        assert malformed == len(burst)
        assert ident == b"rogue-7" and got == Ready(worker_id="rogue-7", role="verifier", slots=3)
    finally:
        for s in (router, dealer):
            s.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- volume (runs last)


def test_fuzz_volume():
    expected = {(f, t) for f in PER_TYPE_FAMILIES for t in TYPES} | {("random_frames", "-")}
    if not expected <= FAMILIES_RUN or SCALE < 1:
        pytest.skip("volume is checked when the whole file runs in one process at scale >= 1")
    total = sum(EXAMPLES_RUN.values())
    print(f"\nfuzz: {total} hypothesis examples {dict(EXAMPLES_RUN)}")
    print(f"fuzz: inputs per type {dict(INPUTS)}; rejected {dict(REJECTED)}")
    assert total >= MIN_EXAMPLES, EXAMPLES_RUN
    for type_name in TYPES:
        assert INPUTS[type_name] >= MIN_INPUTS_PER_TYPE, (type_name, INPUTS[type_name])
        assert REJECTED[type_name] >= 0.9 * INPUTS[type_name], (type_name, REJECTED[type_name])  # malformed indeed

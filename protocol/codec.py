"""Wire codec: a msgpack header frame plus one raw frame per numeric array.

A message is a dataclass registered with :func:`message`. ``encode`` turns it
into ZeroMQ frames; ``decode`` validates type, protocol version, required
fields, field types, array dtypes, shapes and byte lengths, and raises
:class:`ProtocolError` with the reason on anything malformed. Arrays are
decoded zero-copy (``np.frombuffer`` over the received frame, read-only).

Pickle is never used: a peer can only make us build the registered types.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 3  # 2: PromptRequest and Rollout carry a WorkKey (issue 34); 3: TrainBatch rows packed
MAX_HEADER_BYTES = 4 << 20  # a header is metadata; arrays travel in their own frames
MAX_ARRAY_DIMS = 4
ALLOWED_DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")

_REGISTRY: dict[str, type] = {}


class ProtocolError(ValueError):
    """A frame sequence that is not a valid message of this protocol."""


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Declared dtype and rank of an array field."""

    dtype: str
    ndim: int


def array(dtype: str, ndim: int = 1, **kwargs: Any) -> Any:
    """Declare an ``np.ndarray`` field of a message with its dtype and rank."""
    assert dtype in ALLOWED_DTYPES, dtype
    return dataclasses.field(metadata={"array": ArraySpec(dtype, ndim)}, **kwargs)


def message(type_name: str):
    """Register a dataclass as a wire message called ``type_name``."""

    def wrap(cls: type) -> type:
        if type_name in _REGISTRY:
            raise ValueError(f"message type {type_name!r} registered twice")
        cls = dataclasses.dataclass(cls)
        cls.TYPE = type_name
        _REGISTRY[type_name] = cls
        return cls

    return wrap


def struct(cls: type | None = None, *, frozen: bool = False):
    """A dataclass that travels nested inside a message header (no arrays); its ``validate``, if it has one, is
    checked where it is decoded, like a message's. ``frozen``: a value type (hashable: a dict key)."""
    if cls is None:
        return lambda c: dataclasses.dataclass(c, frozen=frozen)
    return dataclasses.dataclass(cls, frozen=frozen)


# --------------------------------------------------------------------------- encode


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def encode(msg: Any) -> list:
    """Frames for ``msg``: header first, then each array's bytes (no copy)."""
    header: dict[str, Any] = {"t": msg.TYPE, "v": PROTOCOL_VERSION}
    frames: list = [b""]
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        spec = f.metadata.get("array")
        if spec is not None and value is not None:
            arr = np.ascontiguousarray(np.asarray(value, dtype=spec.dtype))
            if arr.ndim != spec.ndim:
                raise ProtocolError(f"{msg.TYPE}.{f.name}: rank {arr.ndim}, declared {spec.ndim}")
            header[f.name] = {"__nd__": len(frames), "dtype": spec.dtype, "shape": list(arr.shape)}
            frames.append(memoryview(arr).cast("B") if arr.nbytes else b"")
        else:
            header[f.name] = _plain(value)
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


# --------------------------------------------------------------------------- decode


def _buffer(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame received with copy=False
        return frame.buffer
    return memoryview(frame)


def _decode_array(where: str, ref: Any, spec: ArraySpec, frames: list, used: set) -> np.ndarray:
    if not isinstance(ref, dict) or set(ref) != {"__nd__", "dtype", "shape"}:
        raise ProtocolError(f"{where}: expected an array reference")
    index, dtype, shape = ref["__nd__"], ref["dtype"], ref["shape"]
    if not isinstance(index, int) or isinstance(index, bool) or not 1 <= index < len(frames):
        raise ProtocolError(f"{where}: array frame index {index!r} out of range")
    if index in used:
        raise ProtocolError(f"{where}: array frame {index} referenced twice")
    if dtype != spec.dtype:
        raise ProtocolError(f"{where}: dtype {dtype!r}, expected {spec.dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) != spec.ndim
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
    ):
        raise ProtocolError(f"{where}: bad shape {shape!r} for rank {spec.ndim}")
    buf = _buffer(frames[index])
    np_dtype = np.dtype(dtype)
    expected = math.prod(shape) * np_dtype.itemsize  # Python ints: np.prod(int64) wraps around
    if buf.nbytes != expected:
        raise ProtocolError(f"{where}: {buf.nbytes} bytes for shape {shape} {dtype} ({expected} expected)")
    used.add(index)
    arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
    arr.flags.writeable = False  # zmq.Frame buffers are writable; the decoded view must not be
    return arr


_SCALARS = {int: "int", float: "float", str: "str", bool: "bool"}


MAX_DEPTH = 32  # nesting allowed in free-form (Any) fields: far beyond any real message, far below recursion limits


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not part of the protocol")


def _check_plain(where: str, value: Any) -> None:
    """A free-form value must be plain and shallow: ``encode`` (and JSON, for the supervisor's status) can write
    it back. Walked without recursion, so a deep value cannot overflow the stack here."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif not (v is None or isinstance(v, (bool, int, float, str, bytes))):
            raise ProtocolError(f"{where}: {type(v).__name__} is not a plain value")


def _check(where: str, value: Any, hint: Any) -> Any:
    """Validate a header value against a type hint; returns the (converted) value."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _check(where, value, option)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(f"{where}: {value!r} matches none of {hint}")
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected null")
        return None
    if hint is Any:
        _check_plain(where, value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected float, got {type(value).__name__}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected int, got {type(value).__name__}")
        return value
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise ProtocolError(f"{where}: expected {_SCALARS[hint]}, got {type(value).__name__}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected map, got {type(value).__name__}")
        args = typing.get_args(hint)
        if args:
            return {_check(where, k, args[0]): _check(f"{where}[{k!r}]", v, args[1]) for k, v in value.items()}
        return value
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected list, got {type(value).__name__}")
        args = typing.get_args(hint)
        return [_check(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected map for {hint.__name__}, got {type(value).__name__}")
        built = _build(hint, value, where, None, None)
        reason = built.validate() if hasattr(built, "validate") else ""
        if reason:
            raise ProtocolError(f"{where}: {reason}")
        return built
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # a bug in a message definition


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # ~0.1 ms: most of a small message's decode, so once per type


def _build(cls: type, data: dict, where: str, frames: list | None, used: set | None) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{name}: required field missing")
            continue
        value = data[f.name]
        spec = f.metadata.get("array")
        if spec is not None:
            if value is None and f.default is None:
                kwargs[f.name] = None
            elif frames is None:
                raise ProtocolError(f"{name}: arrays are not allowed here")
            else:
                kwargs[f.name] = _decode_array(name, value, spec, frames, used)
        else:
            kwargs[f.name] = _check(name, value, hints[f.name])
    return cls(**kwargs)


def decode(frames: list, expect: tuple[type, ...] | None = None) -> Any:
    """Validate ``frames`` and build the message; ``expect`` limits the accepted types."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, max_ext_len=0, ext_hook=_refuse_ext)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    t, v = header.get("t"), header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r}, this peer speaks {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(t) if isinstance(t, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {t!r}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message type {t!r} on this socket")
    used: set[int] = set()
    msg = _build(cls, header, t, frames, used)
    if len(used) != len(frames) - 1:
        raise ProtocolError(f"{t}: {len(frames) - 1 - len(used)} unreferenced array frame(s)")
    if hasattr(msg, "validate"):
        reason = msg.validate()
        if reason:
            raise ProtocolError(f"{t}: {reason}")
    return msg


def registered_types() -> dict[str, type]:
    """Every registered message type by wire name (for tests and fuzzers)."""
    return dict(_REGISTRY)

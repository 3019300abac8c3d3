"""The ``delta`` weight transport: each version ships only the elements that changed since the version before.

At bf16 and the paper's learning rate (3e-6) most elements of a step's update round to no change
(bench/delta_weights.py measures the fraction), so a version's delta is a fraction of the file the ``stream``
transport ships. verl, NeMo-RL, AReaL, slime and SkyRL ship deltas too.

Publisher (the trainer, ``DeltaTransport``): a ``stream`` publisher (stream.py) underneath builds each version's
safetensors file in memory and serves it, as it always does; that snapshot is also the copy of the last published
weights the next delta is taken against (the stream keeps the newest ``keep`` >= 2 versions), so the delta costs no
copy of the model beyond the stream's own. The delta of v against v-1 compares every tensor's raw bits (viewed as
unsigned ints of the element's size: -0.0/+0.0 and NaN payloads differ as bits, as they must) and is served with v
on the same ROUTER (``WeightsGet.part = "delta"``). The full file of every version stays served: it is the base
anyway, and a sampler that fell behind, was restarted or got a delta it refused loads it (a *resync*).

A delta (``encode``) is a header and a data section, like a safetensors file::

    u64 little-endian header length | JSON header, padded to 8 bytes | data
    header: {"version": v, "base": v-1, "tensors": [{"name", "dtype", "enc", "count", "zlib", "index": [a, b],
             "values": [a, b]}, ...]}          offsets [a, b) into the data section; tensors without change absent

Per tensor, the new values of the ``count`` changed elements (in order) and their flat indices, in whichever of
these is smallest: ``all`` (every element: no index), ``mask`` (one bit per element, numpy ``packbits``),
``gapW`` (the first index + 1, then the gaps between indices, as W-byte unsigned ints: 1, 2, 4 or 8; a dense
update's gaps fit one byte). With ``zlib_level`` > 0 the index bytes are zlib-compressed where that saves an eighth
of them. Off by default: measured at 50m (bench/delta_weights.py) level 1 takes about a fifth off a delta (the gaps
of changes spread like noise compress little) for ~80 ms more of the trainer's publish, which pays only on links
slower than ~200 Mb/s.

Receiver (a sampler, ``load``): the notice's URI is ``delta+tcp://HOST:PORT/VERSION?base=BASE`` (BASE -1: no delta,
the first version or a changed layout). The process keeps the file of the version its engine last loaded
(``Kept``, host memory: one copy of the model, per engine). When that is BASE and the engine's version is too, it fetches the
delta, refuses it whole with a ``WeightsError`` if anything in it is off (malformed header, unknown tensor, wrong
dtype, lengths that do not add up, indices out of range or not increasing), else applies it to the kept copy and
checks the notice's checksum (XXH3-128 of the whole file after the delta: the stream's checksum of version v). The
engine then gets the full tensors, views of the kept copy (``load_tensors``; engines copy them; an engine without it
gets the file by path). Anything else -- no kept copy, another version, a refused delta, a failed checksum -- is a
resync: the full file of v by the stream's receiver (size and checksum checked), kept, loaded by path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import weakref
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from cascade_rl.protocol.messages import WeightsReady

from . import stream
from .common import WeightsError, notice_uri, receive_dir
from .layout import SAFETENSORS_DTYPES, Weights

log = logging.getLogger(__name__)

FORMAT, SCHEME = "delta", "delta+tcp"  # its notices: WeightsReady.format, and the URI's scheme
DELTA_URI = re.compile(r"^delta\+tcp://(?P<addr>.+:\d+)/(?P<version>\d+)\?base=(?P<base>-1|\d+)$")
PART = "delta"  # the stream part a version's delta is served as
TIMEOUT_S = 30.0  # a sampler's longest wait for each reply of the publisher
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # element size -> the view its bits are compared in


# --------------------------------------------------------------------------- the file's tensors


def header_size(blob: np.ndarray, bad) -> int:
    """The size of the JSON header after ``blob``'s u64 length prefix (a safetensors file, a delta); ``bad(why)``
    makes the error raised when there is none or it overruns the blob."""
    if len(blob) < 8:
        raise bad(f"{len(blob)} bytes: no header")
    (n,) = struct.unpack("<Q", blob[:8].tobytes())
    if 8 + n > len(blob):
        raise bad(f"a header of {n} bytes in {len(blob)}")
    return n



@dataclass
class Tensors:
    """The tensors of a safetensors file held in one uint8 buffer: name -> (dtype name, shape, start, end)."""

    data: np.ndarray
    entries: dict[str, tuple[str, tuple[int, ...], int, int]]
    header: int  # bytes before the data section (u64 + JSON)

    @classmethod
    def parse(cls, data: np.ndarray) -> Tensors:
        n = header_size(data, lambda why: WeightsError(f"weights file: {why}"))
        try:
            header = json.loads(data[8 : 8 + n].tobytes())
            entries = {name: (e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
                       for name, e in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise WeightsError(f"weights file header unreadable: {e}") from None
        return cls(data, entries, 8 + n)

    def elements(self, name: str) -> np.ndarray:
        """The raw bits of tensor ``name``: a flat view as unsigned ints of its element size (writable if the
        buffer is)."""
        dtype, _, start, end = self.entries[name]
        return self.data[start:end].view(UINT[SAFETENSORS_DTYPES[dtype].itemsize])

    def torch(self) -> dict[str, torch.Tensor]:
        """Every tensor as a torch view of the buffer (no copy: valid until the buffer changes)."""
        out = {}
        for name, (dtype, shape, start, end) in self.entries.items():
            t = SAFETENSORS_DTYPES[dtype]
            if end == start:
                out[name] = torch.empty(shape, dtype=t)
            else:
                out[name] = torch.frombuffer(self.data[start:end], dtype=torch.uint8).view(t).reshape(shape)
        return out


# --------------------------------------------------------------------------- encoding


def _index(idx: np.ndarray, n: int, count: int, itemsize: int) -> tuple[str, bytes]:
    """The smallest index encoding of ``count`` sorted flat indices of an ``n``-element tensor."""
    if count == n:
        return "all", b""
    gaps = np.diff(idx, prepend=-1)
    width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < 1 << (8 * w))
    if (n + 7) // 8 < width * count:
        mask = np.zeros(n, bool)
        mask[idx] = True
        enc, raw = "mask", np.packbits(mask).tobytes()
    else:
        enc, raw = f"gap{width}", gaps.astype(UINT[width]).tobytes()
    if (n - count) * itemsize < len(raw):  # sending every value costs less than saying which changed
        return "all", b""
    return enc, raw


def encode(old: Tensors, new: Tensors, version: int, zlib_level: int = 0) -> tuple[bytes, dict]:
    """The delta of ``new`` (version ``version``) against ``old`` (the version before; same layout), and its stats:
    ``changed_frac`` (elements), ``bytes`` (the delta's), ``full_bytes`` (the file's), ``index_bytes``,
    ``zlib_saved`` (bytes zlib took off the indices)."""
    entries, parts, offset = [], [], 0
    changed = total = index_bytes = zlib_saved = 0
    for name, (dtype, _, _, _) in new.entries.items():
        a, b = old.elements(name), new.elements(name)
        total += len(b)
        idx = np.flatnonzero(a != b)  # bits, not floats: -0.0 vs +0.0 and NaN payloads count as changes
        if not len(idx):
            continue
        changed += len(idx)
        enc, raw = _index(idx, len(b), len(idx), b.itemsize)
        values = b.tobytes() if enc == "all" else b[idx].tobytes()
        packed = zlib.compress(raw, zlib_level) if zlib_level and len(raw) >= 4096 else raw
        use_zlib = len(packed) < len(raw) - len(raw) // 8  # only where it pays
        if use_zlib:
            zlib_saved += len(raw) - len(packed)
            raw = packed
        index_bytes += len(raw)
        count = len(b) if enc == "all" else len(idx)  # "all" sends every value, changed or not
        entries.append({"name": name, "dtype": dtype, "enc": enc, "count": count, "zlib": use_zlib,
                        "index": [offset, offset + len(raw)], "values": [offset + len(raw), offset + len(raw) + len(values)]})
        parts += [raw, values]
        offset += len(raw) + len(values)
    text = json.dumps({"version": version, "base": version - 1, "tensors": entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = b"".join([struct.pack("<Q", len(text)), text, *parts])
    stats = {"changed_frac": changed / max(1, total), "bytes": len(blob), "full_bytes": len(new.data),
             "index_bytes": index_bytes, "zlib_saved": zlib_saved}
    return blob, stats


def decode(blob: np.ndarray, kept: Tensors, version: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The delta ``blob`` of ``version`` against ``kept`` as (tensor, flat indices, new values) -- every entry
    checked before any is returned, so a refused delta (``WeightsError``) has changed nothing."""
    def bad(why: str) -> WeightsError:
        return WeightsError(f"delta of weights v{version} refused: {why}")

    n = header_size(blob, bad)
    try:
        header = json.loads(blob[8 : 8 + n].tobytes())
        tensors = header["tensors"]
        if header["version"] != version or header["base"] != version - 1 or not isinstance(tensors, list):
            raise bad(f"it is v{header['base']} -> v{header['version']}, expected v{version - 1} -> v{version}")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise bad(f"header unreadable: {str(e)[:200]}") from None
    data, out, seen = blob[8 + n :], [], set()
    for e in tensors:
        try:
            name, dtype, enc, count, packed = e["name"], e["dtype"], e["enc"], e["count"], e["zlib"]
            (i0, i1), (v0, v1) = e["index"], e["values"]
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"entry {str(e)[:80]}: {err}") from None
        if not isinstance(name, str) or name not in kept.entries:
            raise bad(f"tensor {str(name)[:80]!r} unknown here")
        if name in seen:
            raise bad(f"tensor {name!r} twice")
        seen.add(name)
        if dtype != kept.entries[name][0]:
            raise bad(f"{name}: dtype {str(dtype)[:16]}, the weights hold {kept.entries[name][0]}")
        bits = kept.elements(name)
        numel, itemsize = len(bits), bits.itemsize
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (count, i0, i1, v0, v1)):
            raise bad(f"{name}: non-integer count or offsets")
        if not (1 <= count <= numel and 0 <= i0 <= i1 <= len(data) and 0 <= v0 <= v1 <= len(data)):
            raise bad(f"{name}: count {count} of {numel}, index [{i0}, {i1}), values [{v0}, {v1}) of {len(data)}")
        if v1 - v0 != count * itemsize:
            raise bad(f"{name}: {v1 - v0} value bytes for {count} {dtype} elements")
        raw = data[i0:i1]
        if packed:
            d = zlib.decompressobj()  # bounded: a zlib bomb stops at the size the encoding allows
            try:
                raw = np.frombuffer(d.decompress(raw.tobytes(), (numel + 7) // 8 + 8 * count + 1), np.uint8)
            except zlib.error as err:
                raise bad(f"{name}: index does not decompress: {err}") from None
            if not d.eof or d.unconsumed_tail or d.unused_data:
                raise bad(f"{name}: index is not one whole zlib stream of a size its encoding allows")
        out.append((name, _indices(name, enc, raw, count, numel, bad), data[v0:v1].view(UINT[itemsize])))
    return out


def _indices(name: str, enc, raw: np.ndarray, count: int, numel: int, bad) -> np.ndarray | None:
    """The flat indices an entry's index bytes encode (None: every element), checked against the tensor."""
    if enc == "all":
        if count != numel or len(raw):
            raise bad(f"{name}: 'all' with count {count} of {numel} and {len(raw)} index bytes")
        return None
    if enc == "mask":
        if len(raw) != (numel + 7) // 8:
            raise bad(f"{name}: mask of {len(raw)} bytes for {numel} elements")
        bits = np.unpackbits(raw)
        if bits[numel:].any():
            raise bad(f"{name}: mask bits past the tensor's end")
        idx = np.flatnonzero(bits[:numel])
    elif isinstance(enc, str) and enc in ("gap1", "gap2", "gap4", "gap8"):
        width = int(enc[3:])
        if len(raw) != width * count:
            raise bad(f"{name}: {len(raw)} index bytes for {count} {enc} gaps")
        gaps = raw.view(UINT[width])
        if gaps.min() < 1 or gaps.max() > numel:
            raise bad(f"{name}: gaps must be in [1, {numel}]")
        idx = np.cumsum(gaps, dtype=np.int64) - 1  # gaps <= numel: no overflow
        if idx[-1] >= numel:
            raise bad(f"{name}: index {idx[-1]} out of range (numel {numel})")
    else:
        raise bad(f"{name}: unknown index encoding {str(enc)[:16]!r}")
    if len(idx) != count:
        raise bad(f"{name}: {len(idx)} indices, count says {count}")
    return idx


# --------------------------------------------------------------------------- publisher


class DeltaTransport:
    """The trainer's side: a ``stream`` publisher serving each version's full file, plus its delta."""

    def __init__(self, run_id: str, keep: int = 2, endpoint: str = "tcp://0.0.0.0:0", host: str = "",
                 chunk_mb: int = 16, zlib_level: int = 0) -> None:
        """As ``StreamTransport`` (``keep`` >= 2: the delta of v is taken against v-1's snapshot);
        ``zlib_level``: 0 never compresses the indices."""
        if keep < 2:
            raise ValueError(f"delta: keep must be >= 2 (the delta of v is taken against v-1), got {keep}")
        self.stream = stream.StreamTransport(run_id, keep, endpoint, host, chunk_mb)
        self.zlib_level = zlib_level
        self.metrics: dict[str, float] = {}  # of the last version: changed_frac, bytes, full_bytes, delta_s, ...
        self._last = -1

    def publish(self, weights: Weights, version: int) -> WeightsReady:
        full = self.stream.publish(weights, version)
        new, old = self.stream.served(version), self.stream.served(version - 1) if self._last == version - 1 else None
        self._last, base = version, -1
        t0 = time.perf_counter()
        if old is not None and bytes(old.data[:8]) == bytes(new.data[:8]):
            old_t, new_t = Tensors.parse(old.data), Tensors.parse(new.data)
            if bytes(old.data[: old_t.header]) == bytes(new.data[: new_t.header]):  # same layout
                blob, self.metrics = encode(old_t, new_t, version, self.zlib_level)
                self.stream.attach(version, PART, np.frombuffer(blob, np.uint8))
                base = version - 1
        if base < 0:
            self.metrics = {"changed_frac": 1.0, "bytes": full.nbytes, "full_bytes": full.nbytes}
        self.metrics["delta_s"] = time.perf_counter() - t0
        return WeightsReady(version=version, uri=f"delta+tcp://{self.stream.host}:{self.stream.port}/{version}"
                            f"?base={base}", format=FORMAT, nbytes=full.nbytes, checksum=full.checksum)

    def close(self) -> None:
        self.stream.close()


# --------------------------------------------------------------------------- receiver


@dataclass
class Kept:
    """The file of the version this process's engine last loaded from one publisher."""

    version: int
    tensors: Tensors


KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {publisher HOST:PORT -> its Kept}: one
# per engine, so samplers that share a process (``--inline``) never share a copy
COUNTS = {"deltas": 0, "resyncs": 0, "refused": 0}  # this process's loads: by delta, by full file; deltas refused


def load(engine, notice: WeightsReady, run_id: str) -> None:
    """Apply ``notice`` to ``engine``: by its delta when this process holds its base, else by the full file."""
    m = notice_uri(DELTA_URI, notice, f"delta+tcp://HOST:PORT/{notice.version}?base=B", full_only="delta")
    addr, base = m["addr"], int(m["base"])
    held = KEPT.setdefault(engine, {})
    kept = held.get(addr)
    if base < 0:
        why = "the publisher sent no delta"
    elif kept is None:
        why = "no weights of this publisher kept here"
    elif kept.version != base or engine.version != base:
        why = f"the delta is from v{base}; kept v{kept.version}, engine v{engine.version}"
    else:
        try:
            apply(kept, stream.fetch_part(addr, notice.version, PART, TIMEOUT_S), notice)
        except WeightsError as e:
            held.pop(addr, None)  # it may hold part of the delta
            COUNTS["refused"] += 1
            log.warning("%s; loading the full weights instead", e)
            why = "refused delta"
        else:
            _hand(engine, kept, run_id)
            COUNTS["deltas"] += 1
            log.info("weights v%d: delta applied", notice.version)
            return
    resync(engine, notice, run_id, addr, why)


def apply(kept: Kept, blob: np.ndarray, notice: WeightsReady) -> None:
    """Apply the delta ``blob`` of ``notice.version`` to ``kept`` and check the checksum of the result."""
    changes = decode(blob, kept.tensors, notice.version)  # refused before anything changes
    for name, idx, values in changes:
        bits = kept.tensors.elements(name)
        if idx is None:
            bits[:] = values
        else:
            bits[idx] = values
    kept.version = -1  # a mix until the checksum says otherwise
    if notice.checksum and xxhash.xxh3_128(kept.tensors.data).hexdigest() != notice.checksum:
        raise WeightsError(f"weights v{notice.version} after its delta fail their checksum")
    kept.version = notice.version


def resync(engine, notice: WeightsReady, run_id: str, addr: str, why: str) -> None:
    """The full file of ``notice.version`` by the stream's receiver (checked), kept and loaded by path."""
    log.info("weights v%d: full resync (%s)", notice.version, why)
    full = WeightsReady(version=notice.version, uri=f"stream+tcp://{addr}/{notice.version}", nbytes=notice.nbytes,
                        checksum=notice.checksum)
    path = stream.resolve(full, run_id, TIMEOUT_S)
    held = KEPT.setdefault(engine, {})
    held.pop(addr, None)
    data = np.fromfile(path, np.uint8)
    engine.load_weights(path, notice.version)
    held[addr] = Kept(notice.version, Tensors.parse(data))
    COUNTS["resyncs"] += 1


def _hand(engine, kept: Kept, run_id: str) -> None:
    """The kept weights to the engine: as tensors (views; the engine copies them), else as a file by path."""
    if hasattr(engine, "load_tensors"):
        engine.load_tensors(kept.tensors.torch(), kept.version)
        return
    path = receive_dir(run_id) / f"policy-v{kept.version:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    kept.tensors.data.tofile(tmp)
    os.replace(tmp, path)
    stream._keep_newest(path.parent, path, 2)
    engine.load_weights(str(path), kept.version)

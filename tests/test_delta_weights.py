"""The ``delta`` weight transport (weights/delta.py): bit-exact after many versions, resync when a delta is missed
or the receiver is fresh, malformed deltas refused (WeightsError) and resynced, the changed fraction reported.

    .venv/bin/pytest tests/test_delta_weights.py
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.weights import delta
from cascade_rl.weights.common import WeightsError
from cascade_rl.weights.registry import RECEIVERS, TRANSPORTS, load, receiver

RUN = f"test-delta-{uuid.uuid4().hex[:6]}"


class PathEngine:
    """What a sampler's engine does with weights: holds a copy, loaded by path (SGLang has no ``load_tensors``)."""

    def __init__(self) -> None:
        self.version, self.state = 0, {}

    def load_weights(self, path: str, version: int) -> None:
        self.state, self.version = load_file(path), version


class Engine(PathEngine):
    """An engine in the sampler's process (torch, vLLM): also takes tensors, and copies them."""

    def load_tensors(self, tensors: dict, version: int) -> None:
        self.state, self.version = {k: t.clone() for k, t in tensors.items()}, version


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(97, 48), torch.nn.Linear(48, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 97))


def trained(lr: float = 3e-5, steps: int = 6):
    """bf16 state dicts of a model after each of ``steps`` AdamW steps (fp32 masters, published in bf16)."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randint(0, 97, (8, 12))
        loss = torch.nn.functional.cross_entropy(m(x).reshape(-1, 97), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield {k: v.detach().to(torch.bfloat16).clone() for k, v in m.state_dict().items()}


@pytest.fixture
def publisher():
    delta.KEPT.clear()
    t = TRANSPORTS["delta"](run_id=f"{RUN}-{uuid.uuid4().hex[:6]}", endpoint="tcp://127.0.0.1:0")
    yield t
    t.close()
    delta.KEPT.clear()


def same(engine: Engine, state: dict) -> bool:
    return engine.state.keys() == state.keys() and all(
        torch.equal(engine.state[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def counts() -> dict:
    return dict(delta.COUNTS)


def delta_since(before: dict) -> dict:
    return {k: delta.COUNTS[k] - before[k] for k in before}


# --------------------------------------------------------------------------- registry


def test_registered_by_name_and_by_notice():
    assert TRANSPORTS["delta"] is delta.DeltaTransport and RECEIVERS["delta"].format == delta.FORMAT
    assert receiver(WeightsReady(version=3, uri="delta+tcp://h:1/3?base=2", format="delta")) is RECEIVERS["delta"]
    with pytest.raises(ValueError, match="keep must be >= 2"):
        delta.DeltaTransport(run_id=RUN, keep=1)


# --------------------------------------------------------------------------- bit-exact after N versions


@pytest.mark.parametrize("engine_cls", [Engine, PathEngine])
def test_receiver_is_bit_exact_after_many_optimizer_steps(publisher, engine_cls):
    engine, before = engine_cls(), counts()
    fracs = []
    for version, state in enumerate(trained(), start=1):
        notice = publisher.publish(state, version)
        fracs.append(publisher.metrics["changed_frac"])
        assert publisher.metrics["bytes"] > 0
        load(engine, notice, RUN)
        assert engine.version == version and same(engine, state), f"v{version}"
    assert delta_since(before) == {"deltas": 5, "resyncs": 1, "refused": 0}  # v1: nothing kept yet
    assert fracs[0] == 1.0 and all(0 < f < 1 for f in fracs[1:]), fracs
    assert publisher.metrics["bytes"] < publisher.metrics["full_bytes"]


def test_zero_signs_and_nan_payloads_are_changes():
    """Bits, not float equality: -0.0 vs +0.0 and two NaNs with different payloads count as changed."""
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = a.clone()
    b[0] = -0.0
    b.view(torch.int16)[2] = a.view(torch.int16)[2] | 1  # another NaN payload
    old, new = (delta.Tensors.parse(np.frombuffer(_file({"w": t}), np.uint8).copy()) for t in (a, b))
    blob, stats = delta.encode(old, new, 1)
    assert stats["changed_frac"] == 0.5
    kept = delta.Kept(0, old)
    delta.apply(kept, np.frombuffer(blob, np.uint8), WeightsReady(version=1, uri="", checksum=""))
    assert bytes(kept.tensors.data) == bytes(new.data)


@pytest.mark.parametrize("frac", [0.0005, 0.02, 0.3, 0.97, 1.0])
def test_every_index_encoding_round_trips(frac):
    """Sparse (gap4/gap2), dense (gap1, mask) and full (all) updates, zlib on or off, apply bit-exactly."""
    rng = np.random.default_rng(int(frac * 1e4))
    a = torch.randn(300, 301).to(torch.bfloat16)
    b = a.clone()
    hit = torch.from_numpy(rng.random(a.shape) < frac)
    b[hit] = (b[hit].float() + 0.5).to(torch.bfloat16)
    old, new = (delta.Tensors.parse(np.frombuffer(_file({"w": t, "e": t[:0]}), np.uint8).copy()) for t in (a, b))
    for level in (0, 1):
        blob, stats = delta.encode(old, new, 1, level)
        kept = delta.Kept(0, delta.Tensors(old.data.copy(), old.entries, old.header))
        delta.apply(kept, np.frombuffer(blob, np.uint8), WeightsReady(version=1, uri=""))
        assert bytes(kept.tensors.data) == bytes(new.data)
        assert stats["bytes"] <= len(new.data) + 512


# --------------------------------------------------------------------------- resync


def test_dropped_delta_and_fresh_receiver_resync(publisher):
    states = list(trained(steps=6))
    engine, before = Engine(), counts()
    for version in (1, 2):
        load(engine, publisher.publish(states[version - 1], version), RUN)
    publisher.publish(states[2], 3)  # v3 never reaches this sampler
    load(engine, publisher.publish(states[3], 4), RUN)  # its delta is from v3: resync
    assert engine.version == 4 and same(engine, states[3])
    assert delta_since(before) == {"deltas": 1, "resyncs": 2, "refused": 0}
    load(engine, publisher.publish(states[4], 5), RUN)  # back on deltas
    assert same(engine, states[4]) and delta_since(before)["deltas"] == 2

    fresh, before = Engine(), counts()  # a restarted sampler: nothing kept, its engine at the run's start
    load(fresh, publisher.publish(states[5], 6), RUN)
    assert fresh.version == 6 and same(fresh, states[5]) and delta_since(before)["resyncs"] == 1


def test_engine_that_loaded_elsewhere_resyncs(publisher):
    states = list(trained(steps=2))
    engine = Engine()
    load(engine, publisher.publish(states[0], 1), RUN)
    engine.version = 7  # the engine's weights are not the kept copy's
    before = counts()
    load(engine, publisher.publish(states[1], 2), RUN)
    assert same(engine, states[1]) and delta_since(before) == {"deltas": 0, "resyncs": 1, "refused": 0}


# --------------------------------------------------------------------------- malformed deltas


def _file(state: dict) -> bytes:
    from cascade_rl.weights.stream import snapshot

    return snapshot(state).data.tobytes()


def _pair():
    """(kept v0, v1 file, the delta of v1, the notice of v1) of a small random update."""
    a = {"w": torch.randn(64, 33).to(torch.bfloat16), "b": torch.randn(33).to(torch.bfloat16)}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][::3, ::5] += 1
    b["b"][:] += 1
    old, new = (delta.Tensors.parse(np.frombuffer(_file(s), np.uint8).copy()) for s in (a, b))
    blob, _ = delta.encode(old, new, 1, zlib_level=0)
    import xxhash

    notice = WeightsReady(version=1, uri="", checksum=xxhash.xxh3_128(new.data).hexdigest())
    return old, new, blob, notice


def _edit(blob: bytes, fn) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    fn(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + n :]


def _set(i: int, key: str, value):
    return lambda h: h["tensors"][i].__setitem__(key, value)


MALFORMED = {
    "empty": lambda b: b"",
    "truncated header": lambda b: b[:20],
    "not json": lambda b: b[:8] + b"{" * (len(b) - 8),
    "wrong version": lambda b: _edit(b, lambda h: h.__setitem__("version", 5)),
    "unknown tensor": lambda b: _edit(b, _set(0, "name", "lm_head.weight")),
    "wrong dtype": lambda b: _edit(b, _set(0, "dtype", "F32")),
    "count too large": lambda b: _edit(b, _set(0, "count", 10**9)),
    "value bytes short": lambda b: _edit(b, lambda h: h["tensors"][0]["values"].__setitem__(1, h["tensors"][0]["values"][1] - 2)),
    "offsets past the end": lambda b: _edit(b, _set(0, "values", [0, 10**9])),
    "unknown encoding": lambda b: _edit(b, _set(0, "enc", "rle")),
    "duplicate tensor": lambda b: _edit(b, lambda h: h["tensors"].append(dict(h["tensors"][0]))),
    "bad zlib": lambda b: _edit(b, _set(0, "zlib", True)),
    "missing field": lambda b: _edit(b, lambda h: h["tensors"][0].pop("index")),
    "float count": lambda b: _edit(b, _set(0, "count", 1.5)),
    "list as a name": lambda b: _edit(b, _set(0, "name", ["w"])),
    "nested too deep": lambda b: struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000,
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_delta_is_refused_before_anything_changes(case):
    old, _, blob, notice = _pair()
    kept = delta.Kept(0, delta.Tensors(old.data.copy(), old.entries, old.header))
    with pytest.raises(WeightsError, match="refused"):
        delta.apply(kept, np.frombuffer(MALFORMED[case](blob), np.uint8), notice)
    assert kept.version == 0 and bytes(kept.tensors.data) == bytes(old.data)


def test_out_of_range_and_unsorted_indices_are_refused():
    old, _, blob, notice = _pair()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = bytearray(blob[8 + n :])
    e = next(e for e in header["tensors"] if e["enc"].startswith("gap"))
    width = int(e["enc"][3:])
    i0 = e["index"][0]
    for gap, why in ((0, "gaps must be"), (2**(8 * width) - 1, "gaps must be|out of range")):
        bad = bytearray(data)
        bad[i0 + width * (e["count"] - 1) : i0 + width * e["count"]] = gap.to_bytes(width, "little")
        kept = delta.Kept(0, delta.Tensors(old.data.copy(), old.entries, old.header))
        with pytest.raises(WeightsError, match=why):
            delta.apply(kept, np.frombuffer(blob[: 8 + n] + bytes(bad), np.uint8), notice)


def test_random_corruption_never_crashes_nor_corrupts_silently():
    """Flipped bytes anywhere: refused, or a checksum failure, or (a flip in padding or an unchanged value) the
    right weights -- never another exception, never wrong weights taken for right."""
    old, new, blob, notice = _pair()
    rng = np.random.default_rng(1)
    for _ in range(300):
        bad = bytearray(blob)
        for i in rng.integers(0, len(bad), size=int(rng.integers(1, 4))):
            bad[i] = int(rng.integers(0, 256))
        kept = delta.Kept(0, delta.Tensors(old.data.copy(), old.entries, old.header))
        try:
            delta.apply(kept, np.frombuffer(bytes(bad), np.uint8), notice)
        except WeightsError:
            continue
        assert kept.version == 1 and bytes(kept.tensors.data) == bytes(new.data)


def test_refused_delta_over_the_wire_resyncs(publisher, monkeypatch):
    states = list(trained(steps=2))
    engine = Engine()
    load(engine, publisher.publish(states[0], 1), RUN)
    notice = publisher.publish(states[1], 2)
    real = delta.stream.fetch_part
    monkeypatch.setattr(delta.stream, "fetch_part", lambda *a, **k: np.frombuffer(
        _edit(real(*a, **k).tobytes(), _set(0, "name", "nope")), np.uint8))
    before = counts()
    load(engine, notice, RUN)
    assert same(engine, states[1]) and delta_since(before) == {"deltas": 0, "resyncs": 1, "refused": 1}


def test_checksum_mismatch_after_apply_resyncs(publisher, monkeypatch):
    states = list(trained(steps=2))
    engine = Engine()
    load(engine, publisher.publish(states[0], 1), RUN)
    notice = publisher.publish(states[1], 2)
    (kept,) = delta.KEPT[engine].values()
    kept.tensors.data[kept.tensors.header - 1] ^= 1  # the kept copy drifted where no delta writes: the delta
    # applies, the checksum says no
    before = counts()
    load(engine, notice, RUN)
    assert same(engine, states[1]) and delta_since(before) == {"deltas": 0, "resyncs": 1, "refused": 1}


def test_lora_notice_is_refused():
    with pytest.raises(WeightsError, match="LoRA"):
        load(Engine(), WeightsReady(version=1, uri="delta+tcp://h:1/1?base=0", format="delta", adapter={"r": 4}), RUN)


def test_two_engines_in_one_process_keep_their_own_copies(publisher):
    """Samplers that share a process (``--inline``): each engine's kept copy is its own, both stay on deltas."""
    a, b, before = Engine(), Engine(), counts()
    for version, state in enumerate(trained(steps=3), start=1):
        notice = publisher.publish(state, version)
        load(a, notice, RUN)
        load(b, notice, RUN)
        assert same(a, state) and same(b, state)
    assert delta_since(before) == {"deltas": 4, "resyncs": 2, "refused": 0}


@pytest.mark.slow
def test_a_launch_with_the_delta_transport_ships_deltas(tiny_model, math_data, tmp_path):
    """The tiny run (3 steps: v1 is every sampler's resync, v2 its first delta) through every real process."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"run_dir={run_dir}",
                        f"model.path={tiny_model}", *math_data, "weights_transport=delta", "supervisor.progress=none"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, XDG_STATE_HOME=str(tmp_path)))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "trainer/weights_changed_frac" in m]
    assert len(steps) == 3 and steps[0]["trainer/weights_changed_frac"] == 1.0  # v1: no version before it
    assert 0 <= steps[1]["trainer/weights_changed_frac"] < 1  # 0 when the step's groups all tied (no gradient)
    assert steps[1]["trainer/weights_bytes"] < steps[0]["trainer/weights_bytes"]
    log = (run_dir / "logs" / "sampler-0.log").read_text()
    assert "v1: full resync" in log and "v2: delta applied" in log and "refused" not in log

"""Weight sync: publish + resolve with the ``shm`` and ``stream`` transports vs a plain memory copy.

    .venv/bin/python bench/weight_transport.py [--quick] [--rounds N] [--threads N]

Weights: random fp32 tensors shaped like a small dense model (an 8192 x 1024
embedding, then per layer four 1024 x 1024 matrices and two 1024 norms),
256 MiB (``--quick``: 64 MiB). Each side moves the same bytes:

* ``memcpy`` (baseline): ``{name: t.clone()}``, a fresh copy of every tensor
  (fresh pages, as a published version gets). ``memcpy_warm`` (reference
  only): the same copy into buffers touched before, i.e. without page faults.
* ``shm``: ``ShmTransport.publish`` (one safetensors file in /dev/shm,
  checksummed while written) + ``resolve`` in a sampler process (a spawned
  child: size check and a full re-hash of the file).
* ``stream``: ``StreamTransport.publish`` (snapshot + checksum in memory) +
  ``resolve`` in the child over TCP on 127.0.0.1 (chunks fetched with a window,
  written to the child's /dev/shm folder and hashed on arrival).

The time of a transport side is publish (in this process) + resolve (the
child, driven over a pipe; the pipe's round trip is < 1 ms). Rounds run the
sides in rotating order after three warm-up rounds (a run's steady state:
the stream reuses an evicted version's buffer from its fourth version on).
The headline is the median over rounds of shm / memcpy (target <= 1.5x);
stream / memcpy is reported alongside, with each side's publish and resolve
times and the checksum's own cost (XXH3-128 of the same bytes, one thread).
Both transports hash every byte twice (publisher, then the sampler's check),
so on a machine where the hash is slower than a copy, it sets the ratio.

Writes bench/results/weight_transport.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
import xxhash
from _common import machine  # noqa: E402  (bench/ is on sys.path when a script runs)

from cascade_rl.learner.weights import TRANSPORTS
from cascade_rl.protocol.weights import resolve

ROOT = Path(__file__).resolve().parent
HIDDEN, VOCAB, TARGET = 1024, 8192, 1.5
RUN_ID = f"bench-wt-{os.getpid()}"



def make_weights(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    layers = (mib - VOCAB * HIDDEN * 4 // 2**20) // (4 * HIDDEN * HIDDEN * 4 // 2**20)
    for i in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"model.layers.{i}.{name}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{name}.weight"] = torch.ones(HIDDEN)
    return weights


def sampler(conn, run_id: str) -> None:
    """The child: resolve each notice it is sent; reply with the seconds it took (or the error)."""
    torch.set_num_threads(1)
    while (notice := conn.recv()) is not None:
        t0 = time.perf_counter()
        try:
            resolve(notice, run_id, timeout_s=60.0)
            conn.send(time.perf_counter() - t0)
        except Exception as e:  # reported, and the bench fails loudly
            conn.send(f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds")
    p.add_argument("--rounds", type=int, default=0, help="timed rounds (default 5, --quick 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mib, rounds = (64, args.rounds or 3) if args.quick else (256, args.rounds or 5)

    # --- weights, transports, the sampler process
    weights = make_weights(mib)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    transports = {"shm": TRANSPORTS["shm"](run_id=RUN_ID),
                  "stream": TRANSPORTS["stream"](run_id=RUN_ID, endpoint="tcp://127.0.0.1:0")}
    conn, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=sampler, args=(child_conn, RUN_ID + "-recv"), daemon=True)
    child.start()
    version = 0

    def memcpy() -> dict:
        t0 = time.perf_counter()
        copy = {k: v.clone() for k, v in weights.items()}
        dt = time.perf_counter() - t0
        del copy
        return {"total_s": dt}

    warm = {k: torch.empty_like(v) for k, v in weights.items()}

    def memcpy_warm() -> dict:  # for reference: the same copy into pages touched before (no page faults)
        t0 = time.perf_counter()
        for k, v in weights.items():
            warm[k].copy_(v)
        return {"total_s": time.perf_counter() - t0}

    def transport(name: str) -> dict:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        notice = transports[name].publish(weights, version)
        t1 = time.perf_counter()
        conn.send(notice)
        resolved = conn.recv()
        if isinstance(resolved, str):
            raise RuntimeError(f"{name}: resolve failed in the sampler process: {resolved}")
        return {"total_s": time.perf_counter() - t0, "publish_s": t1 - t0, "resolve_s": resolved}

    sides = {"memcpy": memcpy, "shm": lambda: transport("shm"), "stream": lambda: transport("stream"),
             "memcpy_warm": memcpy_warm}

    # --- rounds: warm-up, then rotating order
    try:
        for _ in range(3):  # warm-up to steady state: keep=2, so the stream reuses buffers from its 4th version
            for fn in sides.values():
                fn()
        results: dict[str, list[dict]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[name].append(sides[name]())
        t0 = time.perf_counter()
        h = xxhash.xxh3_128()
        for t in weights.values():
            h.update(t.numpy())
        hash_s = time.perf_counter() - t0
    finally:
        conn.send(None)
        child.join(10)
        for t in transports.values():
            t.close()

    # --- summary
    def ratios(name: str) -> list[float]:
        return [a["total_s"] / b["total_s"] for a, b in zip(results[name], results["memcpy"], strict=True)]

    def med(name: str, key: str = "total_s") -> float:
        return statistics.median(x[key] for x in results[name])

    shm_ratio, stream_ratio = statistics.median(ratios("shm")), statistics.median(ratios("stream"))
    gbps = {name: nbytes / med(name) / 1e9 for name in sides}
    full = {
        "bytes": nbytes, "tensors": len(weights), "rounds": rounds, "quick": args.quick,
        "median_s": {name: med(name) for name in sides},
        "publish_s": {name: med(name, "publish_s") for name in ("shm", "stream")},
        "resolve_s": {name: med(name, "resolve_s") for name in ("shm", "stream")},
        "checksum_s": hash_s,
        "GB_per_s": gbps,
        "ratio_vs_memcpy": {name: statistics.median(ratios(name)) for name in sides if name != "memcpy"},
        "ratio_range": {name: [min(ratios(name)), max(ratios(name))] for name in ("shm", "stream")},
        "rounds_raw": results,
        "machine": machine(),
    }
    for name in sides:
        extra = ""
        if name in transports:
            extra = (f"  publish {med(name, 'publish_s') * 1e3:7.1f} ms  resolve {med(name, 'resolve_s') * 1e3:7.1f} ms"
                     f"  x{statistics.median(ratios(name)):.2f} memcpy")
        print(f"{name:11s} {med(name) * 1e3:8.1f} ms  {gbps[name]:5.2f} GB/s{extra}")
    print(f"XXH3-128 of the same bytes (one thread): {hash_s * 1e3:.1f} ms")
    summary = {"name": "weight_transport", "metric": "shm publish+resolve time / memcpy time (median of rounds)",
               "value": med("shm"), "baseline": "memcpy (torch clone of every tensor)",
               "baseline_value": med("memcpy"), "ratio": shm_ratio, "target": TARGET, "pass": shm_ratio <= TARGET,
               "machine": machine(), "stream_ratio": stream_ratio, "bytes": nbytes}
    results_dir = ROOT / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "weight_transport.json").write_text(json.dumps({"summary": summary, **full}, indent=2))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

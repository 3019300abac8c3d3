"""Weight sync: publish + resolve with the ``shm`` and ``stream`` transports vs a plain memory copy.

    .venv/bin/python bench/weight_transport.py [--quick | --smoke] [--rounds N] [--threads N]

Weights: random fp32 tensors shaped like a small dense model (an 8192 x 1024
embedding, then per layer four 1024 x 1024 matrices and two 1024 norms),
256 MiB (``--quick``: 64 MiB; ``--smoke``: the embedding alone, 32 MiB, one
round). Each side moves the same bytes:

* ``memcpy`` (baseline): ``{name: t.clone()}``, a fresh copy of every tensor
  (fresh pages, as a published version gets). ``memcpy_warm`` (reference
  only): the same copy into buffers touched before, i.e. without page faults.
  ``file_floor`` (reference only): the same bytes written to a fresh file in
  /dev/shm, one ``write`` per tensor, no header, no checksum, no reader: what
  any transport through a file pays at least.
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

GPU mode (only where CUDA is available; elsewhere the script is the above alone):
``shm`` vs ``cuda_ipc`` for a trainer and a sampler sharing the GPU, on synthetic
bf16 state dicts on the GPU: ``tiny`` (8.4M parameters, 17 MB) and ``1b`` (1.07B
parameters, 2.1 GB: a 14-layer, 2048-wide dense model with a 32000 vocabulary).
The loader is a second process (spawned) holding its own copy of every tensor on
the GPU, as an engine's parameters: ``shm`` is publish (GPU -> host, file in
/dev/shm, checksummed) + ``resolve`` (re-hash) + ``load_file`` to the GPU + copy
into the loader's tensors; ``cuda_ipc`` is publish (device-to-device copy into
the trainer's buffer, sidecar) + copy from views of that buffer (``reading``,
seqlock checked after a synchronize). One warm-up round, then 5 (tiny) and 3
(1b) timed rounds (``--quick``: 3 and 2; ``--smoke``: tiny only, 1 round) in alternating order, none started
after 70 s of GPU mode; medians, and the ratio cuda_ipc / shm of publish + load.
After the rounds the loader's tensors are compared with the trainer's (an
integer fingerprint per tensor of its bits) for each transport. A size is
skipped for ``shm`` when /dev/shm lacks room for two copies of it. Results go
under ``gpu`` in the JSON, and ``cuda_ipc_vs_shm`` into the summary line.

Writes bench/results/weight_transport.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import time

import torch
import xxhash
from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)
from safetensors.torch import load_file

from cascade_rl.weights import cuda_ipc
from cascade_rl.weights.common import shm_dir
from cascade_rl.weights.registry import TRANSPORTS, resolve

HIDDEN, VOCAB, TARGET = 1024, 8192, 1.5
RUN_ID = f"bench-wt-{os.getpid()}"



def publish_then(transport, weights: dict, version: int, receive, key: str) -> dict:
    """Seconds of one version published here (``publish_s``), then ``receive(notice)`` in the receiving process
    (its own seconds, under ``key``), and of both (``total_s``)."""
    t0 = time.perf_counter()
    notice = transport.publish(weights, version)
    t1 = time.perf_counter()
    received = receive(notice)
    return {"publish_s": t1 - t0, key: received, "total_s": time.perf_counter() - t0}


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


# --------------------------------------------------------------------------- GPU mode: shm vs cuda_ipc

# name -> (vocab, hidden, intermediate, layers) of a synthetic dense bf16 model
GPU_SIZES = {"tiny": (8192, 256, 1024, 4), "1b": (32000, 2048, 8192, 14)}
GPU_ROUNDS = {"tiny": 5, "1b": 3}  # timed rounds after one warm-up (1b: ~2-4 s a shm round on an H200 host)
GPU_ROUNDS_QUICK = {"tiny": 3, "1b": 2}
GPU_ROUNDS_SMOKE = {"tiny": 1}
GPU_BUDGET_S = 70.0  # no new round starts after this long in GPU mode (the whole script: < 90 s on an H200)
GPU_REPLY_S = 60.0  # the loader answers within this, or the GPU mode stops with what it has


def make_gpu_weights(size: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Random bf16 tensors on ``device``, named and shaped like a dense HF causal LM of ``GPU_SIZES[size]``."""
    vocab, hidden, inter, layers = GPU_SIZES[size]
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, device=device, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"{p}self_attn.{name}.weight"] = rand(hidden, hidden)
        weights[f"{p}mlp.gate_proj.weight"], weights[f"{p}mlp.up_proj.weight"] = rand(inter, hidden), rand(inter, hidden)
        weights[f"{p}mlp.down_proj.weight"] = rand(hidden, inter)
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{p}{name}.weight"] = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    return weights


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """name -> an integer of each tensor's bits (sum of its bytes weighted by position mod 251), computed on its
    device: equal weights give equal fingerprints; a wrong, stale or shifted byte changes them."""
    out = {}
    for name, t in sorted(tensors.items()):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        out[name] = int((b * (torch.arange(len(b), device=b.device) % 251 + 1)).sum())
    return out


def gpu_loader(conn, run_id: str, device: str) -> None:
    """The sampler's seat on the same GPU: for each (size, notice), copy the announced weights into this
    process's own tensors (allocated at the first load of a size, as an engine's parameters) and reply with
    the seconds it took; ("fingerprint", size) replies with those tensors' fingerprints, ("zero", size) zeroes
    them; errors as text."""
    torch.set_num_threads(1)
    dest: dict[str, dict[str, torch.Tensor]] = {}
    while (msg := conn.recv()) is not None:
        size, arg = msg
        try:
            if size == "fingerprint":
                conn.send(fingerprint(dest[arg]))
                continue
            if size == "zero":
                for t in dest[arg].values():
                    t.zero_()
                conn.send(0.0)
                continue
            t0 = time.perf_counter()
            if arg.format == cuda_ipc.FORMAT:
                with cuda_ipc.reading(arg) as tensors:
                    _copy_into(dest, size, tensors)
            else:
                _copy_into(dest, size, load_file(resolve(arg, run_id, timeout_s=60.0), device=device))
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
            conn.send(time.perf_counter() - t0)
        except Exception as e:  # reported to the parent, which records it
            conn.send(f"{type(e).__name__}: {e}")


def _copy_into(dest: dict, size: str, tensors: dict[str, torch.Tensor]) -> None:
    if size not in dest:
        dest[size] = {k: torch.empty_like(t) for k, t in tensors.items()}
    for name, t in tensors.items():
        dest[size][name].copy_(t)


def gpu_mode(device: torch.device | None = None, rounds: dict[str, int] = GPU_ROUNDS) -> dict:
    """shm vs cuda_ipc on this GPU (``device``, default the current one), for each size of ``rounds`` (size ->
    timed rounds; see the module docstring). Rounds stop early past ``GPU_BUDGET_S`` (noted in the JSON)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    run_id = f"{RUN_ID}-gpu"
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=gpu_loader, args=(child_conn, run_id + "-recv", str(device)), daemon=True)
    child.start()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    out: dict = {"device": name, "torch": torch.__version__, "sizes": {}}
    t_start = time.perf_counter()

    def ask(msg):
        conn.send(msg)
        if not conn.poll(GPU_REPLY_S):
            raise TimeoutError(f"the loader process did not answer in {GPU_REPLY_S:g}s")
        reply = conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"in the loader process: {reply}")
        return reply

    try:
        for size, n in rounds.items():
            out["sizes"][size] = gpu_size(size, device, run_id, ask, n, t_start + GPU_BUDGET_S)
            torch.cuda.empty_cache()
    except Exception as e:  # a hung or failed loader: report what ran, and why the rest did not
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if child.is_alive():
            conn.send(None)
            child.join(30)
        if child.is_alive():
            child.kill()
        for folder in shm_dir(run_id).parent.glob(f"{shm_dir(run_id).name}*"):
            shutil.rmtree(folder, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t_start
    return out


def gpu_size(size: str, device: torch.device, run_id: str, ask, rounds: int, deadline: float) -> dict:
    """One size: ``rounds`` timed rounds (after a warm-up) of publish (here) + load (the loader process) for
    each transport that fits; no round starts after ``deadline`` (perf_counter)."""
    weights = make_gpu_weights(size, device)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    result: dict = {"params": sum(t.numel() for t in weights.values()), "bytes": nbytes, "rounds": 0,
                    "skipped": {}, "errors": {}}
    free = shutil.disk_usage(shm_dir(run_id).parent).free
    transports = {"cuda_ipc": TRANSPORTS["cuda_ipc"](run_id=f"{run_id}-{size}-ipc")}
    if free > 2.2 * nbytes:  # keep=1: the new file's tmp beside the previous version
        transports["shm"] = TRANSPORTS["shm"](run_id=f"{run_id}-{size}-shm", keep=1)
    else:
        result["skipped"]["shm"] = f"{shm_dir(run_id).parent} has {free / 2**30:.1f} GiB free, needs {2.2 * nbytes / 2**30:.1f}"
    versions, times = itertools.count(1), {name: [] for name in transports}

    def side(name: str) -> dict:
        return publish_then(transports[name], weights, next(versions), lambda notice: ask((size, notice)), "load_s")

    try:
        names = list(transports)
        for r in range(rounds + 1):  # round 0 warms up: buffers, the loader's tensors, CUDA IPC mappings
            if r > 1 and time.perf_counter() > deadline:
                result["stopped_early"] = f"the GPU mode's {GPU_BUDGET_S:g} s budget was spent"
                break
            result["rounds"] = r
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name in result["errors"]:
                    continue
                try:
                    figures = side(name)
                except RuntimeError as e:  # this transport failed in the loader: the other still runs
                    result["errors"][name] = str(e)
                    continue
                if r:
                    times[name].append(figures)
        result["bitwise_equal"] = {}
        for name in transports:  # new values (negated: exact in bf16), the loader's tensors zeroed, one load
            if name not in result["errors"]:
                for t in weights.values():
                    t.neg_()
                ask(("zero", size))
                side(name)
                result["bitwise_equal"][name] = ask(("fingerprint", size)) == fingerprint(weights)
    finally:
        for t in transports.values():
            t.close()
    for name, rows in times.items():
        if rows:
            result[name] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    if "shm" in result and "cuda_ipc" in result:
        result["ratio_cuda_ipc_vs_shm"] = result["cuda_ipc"]["total_s"] / result["shm"]["total_s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser(__doc__, quick="64 MiB, 3 rounds",
                     smoke="32 MiB, 1 round (GPU: tiny only): the code path in seconds")
    p.add_argument("--rounds", type=int, default=0, help="timed rounds (default 5, --quick 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mib, rounds = (32, 1) if args.smoke else (64, args.rounds or 3) if args.quick else (256, args.rounds or 5)

    # --- weights, transports, the sampler process
    weights = make_weights(mib)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    transports = {"shm": TRANSPORTS["shm"](run_id=RUN_ID),
                  "stream": TRANSPORTS["stream"](run_id=RUN_ID, endpoint="tcp://127.0.0.1:0")}
    conn, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=sampler, args=(child_conn, RUN_ID + "-recv"), daemon=True)
    child.start()
    versions = itertools.count(1)

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

    floor_dir = shm_dir(RUN_ID + "-floor")
    floor_dir.mkdir(parents=True, exist_ok=True)

    def file_floor() -> dict:  # for reference: the bytes into fresh tmpfs pages, nothing else
        path = floor_dir / "floor.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for v in weights.values():
                f.write(v.numpy())
        dt = time.perf_counter() - t0
        path.unlink()
        return {"total_s": dt}

    def transport(name: str) -> dict:
        def resolve_there(notice) -> float:
            conn.send(notice)
            if isinstance(resolved := conn.recv(), str):
                raise RuntimeError(f"{name}: resolve failed in the sampler process: {resolved}")
            return resolved

        return publish_then(transports[name], weights, next(versions), resolve_there, "resolve_s")

    sides = {"memcpy": memcpy, "shm": lambda: transport("shm"), "stream": lambda: transport("stream"),
             "memcpy_warm": memcpy_warm, "file_floor": file_floor}

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
        shutil.rmtree(floor_dir, ignore_errors=True)

    gpu_rounds = GPU_ROUNDS_SMOKE if args.smoke else GPU_ROUNDS_QUICK if args.quick else GPU_ROUNDS
    gpu = gpu_mode(rounds=gpu_rounds) if torch.cuda.is_available() else None

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
        "gpu": gpu,
    }
    for name in sides:
        extra = ""
        if name in transports:
            extra = (f"  publish {med(name, 'publish_s') * 1e3:7.1f} ms  resolve {med(name, 'resolve_s') * 1e3:7.1f} ms"
                     f"  x{statistics.median(ratios(name)):.2f} memcpy")
        print(f"{name:11s} {med(name) * 1e3:8.1f} ms  {gbps[name]:5.2f} GB/s{extra}")
    print(f"XXH3-128 of the same bytes (one thread): {hash_s * 1e3:.1f} ms")
    gpu_ratios = None
    if gpu is not None:
        gpu_ratios = {size: r.get("ratio_cuda_ipc_vs_shm") for size, r in gpu["sizes"].items()}
        for size, r in gpu["sizes"].items():
            line = "  ".join(f"{name} {r[name]['total_s'] * 1e3:8.1f} ms (publish {r[name]['publish_s'] * 1e3:.1f}, "
                             f"load {r[name]['load_s'] * 1e3:.1f})" for name in ("shm", "cuda_ipc") if name in r)
            print(f"GPU {size} ({r['bytes'] / 1e9:.2f} GB bf16): {line}  cuda_ipc/shm "
                  f"{r.get('ratio_cuda_ipc_vs_shm') or float('nan'):.4f}  bitwise {r.get('bitwise_equal')}"
                  f"{'  errors ' + json.dumps(r['errors']) if r['errors'] else ''}"
                  f"{'  skipped ' + json.dumps(r['skipped']) if r['skipped'] else ''}")
        if "error" in gpu:
            print(f"GPU mode stopped: {gpu['error']}")
    summary = {"name": "weight_transport", "metric": "shm publish+resolve time / memcpy time (median of rounds)",
               "value": med("shm"), "baseline": "memcpy (torch clone of every tensor)",
               "baseline_value": med("memcpy"), "ratio": shm_ratio, "target": TARGET, "pass": shm_ratio <= TARGET,
               "machine": machine(), "stream_ratio": stream_ratio, "bytes": nbytes,
               "shm_vs_file_floor": statistics.median(a["total_s"] / b["total_s"] for a, b in
                                                      zip(results["shm"], results["file_floor"], strict=True)),
               # a verified file transport's floor: the bytes written once into fresh tmpfs pages, hashed once
               "shm_vs_floor_plus_hash": med("shm") / (med("file_floor") + hash_s),
               "cuda_ipc_vs_shm": gpu_ratios}  # GPU mode: publish+load time ratio per size (None without CUDA)
    return write_result(summary, {"summary": summary, **full}, smoke=args.smoke)


if __name__ == "__main__":
    main()

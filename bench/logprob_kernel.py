"""Per-token log-prob + entropy from the LM head: Triton kernel vs chunked torch vs full logits, fwd+bwd.

    .venv/bin/python bench/logprob_kernel.py [--quick | --smoke] [--rounds R] [--tokens 8192,16384,32768]

On CUDA (the real benchmark): N tokens of hidden size 2048 through a Qwen-sized LM head of
V = 151,936 rows, bf16 inputs, T = 1.0, log-prob of a random target and the entropy per token; the
loss is Σ a·logprob + Σ b·entropy with random a, b (fixed seed) and backward runs to both the hidden
states and the weight. N = 8,192, 16,384 and 32,768 (``--quick``: 8,192 only, 3 rounds). Sides:

- ``triton``: ``kernels.logprob.linear_logprobs`` (bf16 tensor-core matmuls, fp32 accumulation);
- ``chunked``: ``modeling.logprobs.linear_logprobs``, chunk_tokens = 1,024 (the trainer's path today;
  fp32 matmuls, as torch leaves TF32 off by default);
- ``full``: ``modeling.logprobs.linear_logprobs_reference`` (full [N, V] fp32 logits, log_softmax,
  gather); at large N it runs out of memory, which is recorded as such.

Each side runs once untimed (Triton compiles there), once for memory (peak of the torch CUDA
allocator above what was allocated before the pass, i.e. above the inputs), then ``--rounds``
timed passes (CUDA events, forward and backward separately), the sides alternating within a round.
Headline: median fwd+bwd time of ``triton`` / ``chunked`` at 8,192 tokens; target ≤ 0.5. ``pass`` also
needs the Triton side's peak memory ≤ the chunked side's and its values to agree with the chunked
side's (max |Δ| log-prob and entropy ≤ 1e-3; the gradients' max |Δ| / max |ref| is reported).

Without CUDA: a tiny CPU run (512 tokens x vocab 8,192 x hidden 256, fp32) of the two torch paths
only, whatever the flags; the Triton side needs a GPU (its interpreter is for tests), so the summary
has value, ratio and pass null and says GPU figures are pending.

``--smoke``: one round of 1,024 tokens on CUDA, of 128 tokens x vocab 1,024 x hidden 64 on CPU: the code path
in seconds.

Writes bench/results/logprob_kernel.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

from cascade_rl.modeling.logprobs import linear_logprobs, linear_logprobs_reference

VOCAB, HIDDEN, CHUNK = 151_936, 2048, 1024
TOKENS, QUICK_TOKENS, SMOKE_TOKENS, HEADLINE_TOKENS = (8192, 16384, 32768), (8192,), (1024,), 8192
CPU_SHAPE, CPU_SMOKE_SHAPE = (512, 8192, 256), (128, 1024, 64)  # (tokens, vocab, hidden) of the torch paths on CPU
TARGET, VALUE_TOL = 0.5, 1e-3



def inputs(n: int, v: int, h: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets, torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)


def forward(fn, hidden, weight, targets, a, b):
    lp, ent = fn(hidden, weight, targets, 1.0, CHUNK, True)
    return lp, ent, (lp * a).sum() + (ent * b).sum()


# --- CUDA ----------------------------------------------------------------------------------------


def timed_pass(fn, args) -> tuple[float, float]:
    """(forward ms, backward ms) of one pass, by CUDA events."""
    args[0].grad = args[1].grad = None
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    loss = forward(fn, *args)[2]
    mid.record()
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(mid), mid.elapsed_time(end)


def peak_pass(fn, args) -> tuple[float, dict]:
    """Allocator peak (MiB) above the inputs during one pass, and its outputs and grads for the comparison."""
    args[0].grad = args[1].grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent, loss = forward(fn, *args)
    loss.backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    out = {"logprob": lp.detach(), "entropy": ent.detach(), "grad_hidden": args[0].grad, "grad_weight": args[1].grad}
    args[0].grad = args[1].grad = None
    return peak, out


def diffs(got: dict, ref: dict) -> dict:
    def rel(k):
        return ((got[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max()).item()

    return {"logprob_max_abs_diff": (got["logprob"] - ref["logprob"]).abs().max().item(),
            "entropy_max_abs_diff": (got["entropy"] - ref["entropy"]).abs().max().item(),
            "grad_hidden_max_rel_diff": rel("grad_hidden"), "grad_weight_max_rel_diff": rel("grad_weight")}


def bench_cuda(tokens: tuple[int, ...], rounds: int) -> dict:
    from cascade_rl.kernels.logprob import linear_logprobs as triton_logprobs

    sides = {"triton": triton_logprobs, "chunked": linear_logprobs, "full": linear_logprobs_reference}
    results = {}
    for n in tokens:
        args = inputs(n, VOCAB, HIDDEN, torch.bfloat16, "cuda")
        res = {side: {} for side in sides}
        outs = {}
        for side, fn in sides.items():
            try:
                timed_pass(fn, args)  # warm-up: Triton compiles, cuBLAS picks its kernels
                res[side]["peak_mib"], outs[side] = peak_pass(fn, args)
            except torch.OutOfMemoryError:
                res[side] = {"oom": True}
                args[0].grad = args[1].grad = None
                torch.cuda.empty_cache()
        live = [s for s in sides if not res[s].get("oom")]
        times = {s: [] for s in live}
        for r in range(rounds):  # alternate the sides, rotating who goes first
            for side in live[r % len(live):] + live[:r % len(live)]:
                times[side].append(timed_pass(sides[side], args))
        for side in live:
            fwd, bwd = zip(*times[side], strict=True)
            res[side].update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                             total_ms=statistics.median(f + b for f, b in times[side]))
        if "chunked" in outs:
            for side in ("triton", "full"):
                if side in outs:
                    res[side]["vs_chunked"] = diffs(outs[side], outs["chunked"])
        results[n] = res
        line = ", ".join(f"{s} OOM" if res[s].get("oom") else
                         f"{s} {res[s]['total_ms']:.1f} ms ({res[s]['peak_mib']:.0f} MiB)" for s in sides)
        print(f"{n} tokens: {line}", file=sys.stderr)
        del args, outs
        torch.cuda.empty_cache()
    return results


# --- CPU (torch paths only) ---------------------------------------------------------------------


def bench_cpu(shape: tuple[int, int, int], rounds: int) -> dict:
    args = inputs(*shape, torch.float32, "cpu")
    res = {}
    for side, fn in {"chunked": linear_logprobs, "full": linear_logprobs_reference}.items():
        forward(fn, *args)[2].backward()  # warm-up
        totals = []
        for _ in range(rounds):
            args[0].grad = args[1].grad = None
            t0 = time.perf_counter()
            forward(fn, *args)[2].backward()
            totals.append((time.perf_counter() - t0) * 1e3)
        res[side] = {"total_ms": statistics.median(totals)}
        print(f"cpu {side}: {res[side]['total_ms']:.1f} ms", file=sys.stderr)
    return res


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick=f"{QUICK_TOKENS[0]} tokens only, 3 rounds",
                      smoke="one round at a small shape: the code path in seconds")
    ap.add_argument("--rounds", type=int, default=None, help="timed passes per side (median); default 5, quick 3")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (CUDA), e.g. 8192,32768")
    args = ap.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds or (3 if args.quick else 5)

    if not torch.cuda.is_available():
        shape = CPU_SMOKE_SHAPE if args.smoke else CPU_SHAPE
        cpu = bench_cpu(shape, rounds)
        note = ("no CUDA: GPU figures pending. Ran the torch paths only, tiny and fp32 on CPU "
                "({} tokens x vocab {} x hidden {}); rerun on a GPU for the figures".format(*shape))
        summary = {"name": "logprob_kernel",
                   "metric": f"fwd+bwd ms, Triton / chunked torch ({HEADLINE_TOKENS} tokens x vocab {VOCAB} x hidden "
                             f"{HIDDEN}, bf16, logprob+entropy) — pending: no GPU",
                   "value": None, "baseline": f"chunked torch linear_logprobs (chunk {CHUNK})",
                   "baseline_value": None, "ratio": None, "target": TARGET, "pass": None, "machine": machine(),
                   "note": note}
        full = {**summary, "cpu_torch_paths": cpu, "rounds": rounds, "quick": args.quick}
    else:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
            SMOKE_TOKENS if args.smoke else QUICK_TOKENS if args.quick else TOKENS)
        results = bench_cuda(tokens, rounds)
        head_n = HEADLINE_TOKENS if HEADLINE_TOKENS in results else tokens[0]
        head = results[head_n]
        tri, chunked = head["triton"], head["chunked"]
        ratio = tri["total_ms"] / chunked["total_ms"] if not (tri.get("oom") or chunked.get("oom")) else None
        d = tri.get("vs_chunked", {})
        values_ok = bool(d) and max(d["logprob_max_abs_diff"], d["entropy_max_abs_diff"]) <= VALUE_TOL
        memory_ok = ratio is not None and tri["peak_mib"] <= chunked["peak_mib"]
        summary = {"name": "logprob_kernel",
                   "metric": f"fwd+bwd ms median of {rounds} ({head_n} tokens x vocab {VOCAB} x hidden {HIDDEN}, bf16, "
                             f"logprob+entropy{', quick' if args.quick else ''})",
                   "value": None if tri.get("oom") else round(tri["total_ms"], 2),
                   "baseline": f"chunked torch linear_logprobs (chunk {CHUNK}, fp32 matmuls)",
                   "baseline_value": None if chunked.get("oom") else round(chunked["total_ms"], 2),
                   "ratio": None if ratio is None else round(ratio, 4), "target": TARGET,
                   "pass": ratio is not None and ratio <= TARGET and values_ok and memory_ok, "machine": machine()}
        full = {**summary, "results": {str(n): r for n, r in results.items()}, "values_ok": values_ok,
                "memory_ok": memory_ok, "value_tol": VALUE_TOL,
                "workload": {"tokens": list(tokens), "vocab": VOCAB, "hidden": HIDDEN, "dtype": "bfloat16",
                             "temperature": 1.0, "with_entropy": True, "chunk_tokens": CHUNK, "rounds": rounds,
                             "memory": "torch CUDA allocator peak above the allocation before the pass"},
                "quick": args.quick}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

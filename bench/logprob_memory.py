"""Peak memory of per-token log-probs + entropy: chunked ``linear_logprobs`` against full logits, in one run.

    .venv/bin/python bench/logprob_memory.py [--quick | --smoke] [--chunk N] [--rounds 3]

Workload: N tokens of hidden size 256 through an LM head of V = 32,768 rows, fp32,
T = 1.0, log-prob of a random target and entropy per token; the loss is
Σ a·logprob + Σ b·entropy with random a, b (fixed seed), and backward runs to both
the hidden states and the weight. N = 8,192 (full) or 2,048 (``--quick``, said in the
JSON). The baseline is ``linear_logprobs_reference``: full [N, V] logits, log_softmax,
gather, entropy from exp(log p) — what a trainer does with ``model(...).logits``.
The lean side is ``linear_logprobs`` with ``chunk_tokens`` = N / 8 (1,024 full, 256
quick): its peak is about 2 chunks of logits, so the ratio depends on N / chunk, and
the quick run keeps that of the full one. ``--smoke``: N = 64, one pass, both sides in
the parent process one after the other (no child's start; the memory figures are then
not each side's own): the code path in seconds.

Memory is peak RSS above a baseline, each side in its own child process: the child
imports torch, allocates the inputs, runs the workload once at a tiny shape (kernels,
thread pools), reads VmRSS, resets the kernel's high-water mark (``5`` into
/proc/self/clear_refs) and then reads VmHWM after the forward (forward peak) and after
the backward (forward + backward peak, the headline). RSS is what an OOM kill sees,
allocator and libc included. For the record, a later profiled pass also reports the
torch allocator's own peak (``torch.profiler`` with ``profile_memory``). Times are the
median of ``--rounds`` further passes. The parent compares the two sides' outputs
(max |Δ| of log-probs and entropies, must be ≤ 1e-5) and gradients (max |Δ| / max |ref|).

Writes bench/results/logprob_memory.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

HIDDEN, VOCAB, TOKENS, QUICK_TOKENS, SMOKE_TOKENS = 256, 32768, 8192, 2048, 64
TARGET, VALUE_TOL = 0.125, 1e-5
SIDES = ("naive", "lean")



# --- the child: one side, one process ------------------------------------------------------------


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(ln.split(":", 1) for ln in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def inputs(n: int, h: int, v: int):
    import torch

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets, torch.randn(n, generator=g), torch.randn(n, generator=g)


def child(side: str, n: int, chunk: int, rounds: int, out_dir: Path) -> None:
    import torch

    from cascade_rl.modeling.logprobs import allocator_peak, linear_logprobs, linear_logprobs_reference

    fn = {"naive": linear_logprobs_reference, "lean": linear_logprobs}[side]

    def forward(hidden, weight, targets, a, b):
        lp, ent = fn(hidden, weight, targets, temperature=1.0, chunk_tokens=chunk, with_entropy=True)
        return lp, ent, (lp * a).sum() + (ent * b).sum()

    hidden, weight, targets, a, b = inputs(n, HIDDEN, VOCAB)
    forward(*inputs(16, HIDDEN, 64))[2].backward()  # warm-up at a tiny shape: kernels and thread pools
    base_rss, _ = rss_mib()
    hwm_reset = reset_peak()

    t0 = time.perf_counter()
    lp, ent, loss = forward(hidden, weight, targets, a, b)
    fwd_s = time.perf_counter() - t0
    fwd_peak = rss_mib()[1] - base_rss
    t0 = time.perf_counter()
    loss.backward()
    bwd_s = time.perf_counter() - t0
    peak = rss_mib()[1] - base_rss
    torch.save({"logprob": lp.detach(), "entropy": ent.detach(), "grad_hidden": hidden.grad,
                "grad_weight": weight.grad}, out_dir / f"{side}.pt")
    del lp, ent, loss

    fwd_times, bwd_times = [fwd_s], [bwd_s]
    for _ in range(rounds - 1):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = forward(hidden, weight, targets, a, b)[2]
        fwd_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loss.backward()
        bwd_times.append(time.perf_counter() - t0)
        del loss

    hidden.grad = weight.grad = None
    alloc_peak = allocator_peak(lambda: forward(hidden, weight, targets, a, b)[2].backward())
    print(json.dumps({"base_rss_mib": base_rss, "hwm_reset": hwm_reset, "fwd_peak_mib": fwd_peak, "peak_mib": peak,
                      "allocator_peak_mib": alloc_peak / 2**20, "fwd_s": statistics.median(fwd_times),
                      "bwd_s": statistics.median(bwd_times), "rounds": rounds}))


# --- the parent ---------------------------------------------------------------------------------


def run_side(side: str, n: int, chunk: int, rounds: int, out_dir: Path, in_process: bool = False) -> dict:
    """One side's result line: from its own child process, or (``in_process``, a smoke run) from this one."""
    if in_process:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            child(side, n, chunk, rounds, out_dir)
        out = printed.getvalue()
    else:
        cmd = [sys.executable, __file__, "--child", side, "--tokens", str(n), "--chunk", str(chunk),
               "--rounds", str(rounds), "--out", str(out_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} side exited (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        out = proc.stdout
    res = json.loads(out.strip().splitlines()[-1])
    print(f"{side}: peak {res['peak_mib']:.0f} MiB (forward {res['fwd_peak_mib']:.0f}), "
          f"forward {res['fwd_s']:.2f} s, backward {res['bwd_s']:.2f} s", file=sys.stderr)
    return res


def compare(out_dir: Path) -> dict:
    import torch

    naive, lean = (torch.load(out_dir / f"{s}.pt") for s in SIDES)

    def rel(k: str) -> float:
        return ((lean[k] - naive[k]).abs().max() / naive[k].abs().max()).item()

    return {"logprob_max_abs_diff": (lean["logprob"] - naive["logprob"]).abs().max().item(),
            "entropy_max_abs_diff": (lean["entropy"] - naive["entropy"]).abs().max().item(),
            "grad_hidden_max_rel_diff": rel("grad_hidden"), "grad_weight_max_rel_diff": rel("grad_weight")}


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick=f"{QUICK_TOKENS} tokens instead of {TOKENS}, 1 timed pass",
                      smoke=f"{SMOKE_TOKENS} tokens, 1 pass, one process: the code path in seconds")
    ap.add_argument("--chunk", type=int, default=None, help="chunk_tokens of the lean side (default tokens / 8)")
    ap.add_argument("--rounds", type=int, default=None, help="timed passes per side (median)")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    n = args.tokens or (SMOKE_TOKENS if args.smoke else QUICK_TOKENS if args.quick else TOKENS)
    rounds = args.rounds or (1 if args.quick or args.smoke else 3)
    chunk = args.chunk or max(1, n // 8)
    if args.child:
        child(args.child, n, chunk, rounds, Path(args.out))
        return {}

    with tempfile.TemporaryDirectory() as tmp:
        # One side after the other, so neither's timing shares the cores with the other.
        sides = {s: run_side(s, n, chunk, rounds, Path(tmp), in_process=args.smoke) for s in SIDES}
        diffs = compare(Path(tmp))

    naive, lean = sides["naive"], sides["lean"]
    ratio = lean["peak_mib"] / naive["peak_mib"]
    values_match = max(diffs["logprob_max_abs_diff"], diffs["entropy_max_abs_diff"]) <= VALUE_TOL
    workload = f"{n} tokens x vocab {VOCAB} x hidden {HIDDEN}, chunk {chunk}, fp32, logprob+entropy, fwd+bwd"
    summary = {"name": "logprob_memory",
               "metric": f"peak RSS MiB above inputs ({workload}{', quick' if args.quick else ''})",
               "value": round(lean["peak_mib"], 1),
               "baseline": "full logits + log_softmax + gather + entropy (linear_logprobs_reference)",
               "baseline_value": round(naive["peak_mib"], 1), "ratio": round(ratio, 4), "target": TARGET,
               "pass": ratio <= TARGET and values_match, "machine": machine()}
    full = {**summary, "sides": sides, "diffs": diffs, "values_match": values_match,
            "fwd_ratio": lean["fwd_peak_mib"] / naive["fwd_peak_mib"],
            "allocator_ratio": lean["allocator_peak_mib"] / naive["allocator_peak_mib"],
            "time_ratio": (lean["fwd_s"] + lean["bwd_s"]) / (naive["fwd_s"] + naive["bwd_s"]),
            "workload": {"tokens": n, "vocab": VOCAB, "hidden": HIDDEN, "dtype": "float32", "temperature": 1.0,
                         "chunk_tokens": chunk, "with_entropy": True, "rounds": rounds,
                         "memory": "peak RSS (VmHWM after resetting it, minus VmRSS) after inputs and warm-up, "
                                   "each side in its own process"},
            "quick": args.quick}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

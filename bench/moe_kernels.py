"""MoE block forward+backward: per-expert loop vs torch._grouped_mm vs the torch reference vs Triton (kernels/moe.py).

    .venv/bin/python bench/moe_kernels.py [--quick | --smoke] [--rounds N] [--threads N]

Each side runs one Qwen3-MoE sparse block (router, top-k, SwiGLU experts, weighted combine) forward and backward to
x, the router, gate_up and down, on the same weights and tokens (fixed seed; router ~ N(0, 1/H), so routing is
roughly balanced, as in a trained model):

  loop        HF ``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="eager"``: a Python loop over the experts
              that were hit, index + index_add per expert (the baseline)
  grouped_mm  HF's ``grouped_mm`` experts (``torch._grouped_mm`` on expert-sorted rows; transformers' default)
  torch       ``moe_forward(impl="torch")``: capacity-padded bmm, autograd backward
  triton      ``moe_forward(impl="triton")``: the block-padded Triton kernels (CUDA only)

CUDA (bf16 weights and tokens): shapes ``qwen3-30b-a3b`` (4096 tokens, 128 experts, top-8, hidden 2048, expert
hidden 768; one layer of Qwen3-30B-A3B) and ``mid`` (2048 tokens, 32 experts, top-4, 1024, 512); ``--quick`` runs
``mid`` only. Headline: Triton tokens/s over the loop's at the largest shape run; targets on Hopper ≥ 4× the loop and
≥ 1× grouped_mm (both must hold for pass). Peak memory: ``torch.cuda.max_memory_allocated`` above what was allocated
before the step (inputs and weights excluded, gradients included).

No CUDA: Triton runs only in its interpreter on CPU, which is no benchmark, so the run compares the torch paths in
fp32 on CPU at ``cpu-tiny`` (1024 tokens through the demo model's MoE layer: 8 experts, top-2, 128, 128) and
``cpu-mid`` (1024 tokens, 32 experts, top-4, 512, 256); ``pass`` is null and GPU figures are pending. Peak memory on
CPU: VmHWM − VmRSS of one step in a child process per side (what an OOM kill sees).

Timing: one warm-up step per side (Triton compiles there), then ``--rounds`` rounds (3 quick, 10 full) that run every
side once in rotating order; the figure is the median step time. Each side's output and gradients are compared with
the torch reference (max |Δ| / max |ref|). CPU runs one torch thread by default (``--threads 0``: torch's default):
two spinning OpenMP threads on a shared 2-core machine measure the neighbours.

``--smoke``: one round at ``smoke`` (64 tokens, 4 experts, top-2, 32, 32), every side as above but the CPU's peak
memory (null: a child process per side costs more than the rest of the run; a failed one only nulls its figure):
the code path in seconds.

Writes bench/results/moe_kernels.json; the last stdout line is the summary JSON object.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

from cascade_rl.kernels import moe
from cascade_rl.kernels.moe_triton import INTERPRETED

TARGET_VS_LOOP, TARGET_VS_GROUPED_MM = 4.0, 1.0


@dataclass(frozen=True)
class Shape:
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {
    "qwen3-30b-a3b": Shape(4096, 128, 8, 2048, 768),
    "mid": Shape(2048, 32, 4, 1024, 512),
    "cpu-tiny": Shape(1024, 8, 2, 128, 128),
    "cpu-mid": Shape(1024, 32, 4, 512, 256),
    "smoke": Shape(64, 4, 2, 32, 32),
}


def describe(s: Shape) -> str:
    return f"{s.tokens} tokens, {s.experts} experts top-{s.top_k}, hidden {s.hidden}, expert hidden {s.inter}"



# --- sides ------------------------------------------------------------------------------------------------------


def make_inputs(shape: Shape, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    h, i, e = shape.hidden, shape.inter, shape.experts
    x = torch.randn(shape.tokens, h, generator=g)
    router = torch.randn(e, h, generator=g) / h**0.5
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(e, h, i, generator=g) / i**0.5
    dy = torch.randn(shape.tokens, h, generator=g)
    return [t.to(device, dtype) for t in (x, router, gate_up, down, dy)]


def make_side(name: str, shape: Shape, device: str, dtype: torch.dtype):
    """A step() running forward + backward, and the tensors whose .grad it fills: (y, [x, router, gate_up, down])."""
    x, router, gate_up, down, dy = make_inputs(shape, device, dtype)
    if name in ("loop", "grouped_mm"):
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(
            hidden_size=shape.hidden, moe_intermediate_size=shape.inter, num_experts=shape.experts,
            num_experts_per_tok=shape.top_k, norm_topk_prob=True, hidden_act="silu",
        )  # fmt: skip
        cfg._experts_implementation = "eager" if name == "loop" else "grouped_mm"
        block = Qwen3MoeSparseMoeBlock(cfg).to(device, dtype)
        with torch.no_grad():
            block.gate.weight.copy_(router)
            block.experts.gate_up_proj.copy_(gate_up)
            block.experts.down_proj.copy_(down)
        leaves = [x.requires_grad_(), block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]

        def forward():
            return block(x[None]).squeeze(0)
    else:
        leaves = [t.requires_grad_() for t in (x, router, gate_up, down)]

        def forward():
            return moe.moe_forward(*leaves, shape.top_k, impl=name)

    def step():
        for t in leaves:
            t.grad = None
        y = forward()
        y.backward(dy)
        return y

    return step, leaves


def sides_for(device: str) -> list[str]:
    return ["loop", "grouped_mm", "torch"] + (["triton"] if device == "cuda" else [])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- measurements ----------------------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def cpu_peak_rss_mib(shape_name: str, side: str, threads: int) -> float | None:
    """VmHWM − VmRSS over one step in a fresh process (see --child)."""
    cmd = [sys.executable, __file__, "--child", shape_name, side, "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def proc_status_kib(field: str) -> int:
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(field + ":"))


def child(shape_name: str, side: str) -> None:
    step, _ = make_side(side, SHAPES[shape_name], "cpu", torch.float32)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = proc_status_kib("VmRSS")
    step()
    print(json.dumps({"peak_rss_mib": (proc_status_kib("VmHWM") - before) / 1024}))


def bench_shape(shape_name: str, device: str, dtype: torch.dtype, rounds: int, threads: int,
                memory_sides: int | None = None) -> dict:
    """Every side's timing, errors and peak memory (CPU: of the first ``memory_sides`` sides, None: all; each is a
    child process)."""
    shape = SHAPES[shape_name]
    steps, outputs, errors = {}, {}, {}
    for side in sides_for(device):
        try:
            steps[side], leaves = make_side(side, shape, device, dtype)
            y = steps[side]()  # warm-up (Triton compiles here); kept for the comparison
            sync(device)
            outputs[side] = [y.detach()] + [t.grad.detach().clone() for t in leaves]
        except Exception as e:  # e.g. torch._grouped_mm on a device/dtype that lacks it
            errors[side] = f"{type(e).__name__}: {e}"[:300]
            steps.pop(side, None)
            print(f"{shape_name}: {side} unavailable: {errors[side]}", file=sys.stderr)
    times = {side: [] for side in steps}
    names = list(steps)
    for r in range(rounds):
        for side in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            steps[side]()
            sync(device)
            times[side].append(time.perf_counter() - t0)
    result = {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."), "errors": errors, "sides": {}}
    measured = names[:memory_sides]  # CPU: the sides whose peak memory a child process measures
    for side in steps:
        ms = statistics.median(times[side]) * 1e3
        entry = {"ms_median": round(ms, 3), "tokens_per_s": round(shape.tokens / ms * 1e3, 1),
                 "ms_rounds": [round(t * 1e3, 3) for t in times[side]]}  # fmt: skip
        if "torch" in outputs:
            names5 = ("y", "dx", "drouter", "dgate_up", "ddown")
            entry["rel_err_vs_torch"] = {n: rel_err(a, b) for n, a, b in zip(names5, outputs[side], outputs["torch"])}
        if device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            steps[side]()
            sync(device)
            entry["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        else:
            entry["peak_rss_mib"] = cpu_peak_rss_mib(shape_name, side, threads) if side in measured else None
        result["sides"][side] = entry
        print(f"{shape_name:14s} {side:11s} {ms:9.2f} ms  {entry['tokens_per_s']:10.0f} tok/s", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="fewer rounds; on CUDA the mid shape only",
                      smoke="the smoke shape, 1 round: the code path in seconds")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default 3 quick, 10 full)")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (0: torch's default)")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads and not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    if args.child:
        child(*args.child)
        return {}

    cuda = torch.cuda.is_available()
    if cuda and INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: unset it to benchmark the compiled kernels")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = ["smoke"] if args.smoke else (["mid"] if args.quick else ["mid", "qwen3-30b-a3b"]) if cuda else [
        "cpu-tiny", "cpu-mid"]
    rounds = 1 if args.smoke else args.rounds or (3 if args.quick else 10)
    results = {name: bench_shape(name, device, dtype, rounds, args.threads, 0 if args.smoke else None)
               for name in shapes}

    head_shape = shapes[-1] if cuda or args.smoke else "cpu-tiny"
    head = results[head_shape]["sides"]
    side = "triton" if cuda else "torch"
    value, loop = head.get(side, {}).get("tokens_per_s"), head.get("loop", {}).get("tokens_per_s")
    grouped = head.get("grouped_mm", {}).get("tokens_per_s")
    ratio = round(value / loop, 2) if value and loop else None
    ratio_gmm = round(value / grouped, 2) if value and grouped else None
    if cuda:
        passed = (
            ratio is not None and ratio >= TARGET_VS_LOOP and (ratio_gmm is None or ratio_gmm >= TARGET_VS_GROUPED_MM)
        )
        note = f"Triton vs loop {ratio}x (target {TARGET_VS_LOOP}), vs torch._grouped_mm {ratio_gmm}x (target 1.0)"
    else:
        passed = None
        note = ("no CUDA: torch reference vs per-expert loop, fp32 CPU; Triton runs only in the interpreter on CPU "
                "(not a benchmark); GPU figures pending")  # fmt: skip
    summary = {
        "name": "moe_kernels",
        "metric": f"MoE block fwd+bwd tokens/s, {side}, {head_shape} ({describe(SHAPES[head_shape])}), "
        f"{results[head_shape]['dtype']}, {device}",
        "value": value, "baseline": "HF Qwen3MoeSparseMoeBlock, per-expert loop (experts_implementation=eager)",
        "baseline_value": loop, "ratio": ratio, "target": TARGET_VS_LOOP, "pass": passed, "machine": machine(),
        "ratio_vs_grouped_mm": ratio_gmm, "note": note,
    }  # fmt: skip
    full = {**summary, "results": results, "quick": args.quick, "rounds": rounds}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

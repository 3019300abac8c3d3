"""MasterAdamW's step, many parameters per op (``foreach``, the default) against one parameter at a time.

    .venv/bin/python bench/optimizer_step.py [--quick | --smoke] [--rounds N]

The trainer's optimizer (learner/optim.py) over a ``make-tiny-model`` Qwen3-MoE built in memory (random weights,
bf16 parameters: each gets an fp32 master and fp32 moments), random fp32 gradients: the time of ``step()`` alone,
median of ``--rounds``, the two modes alternating on the same parameters. Two layouts:

  one     every parameter a plain tensor in this process (on CUDA where there is one): on a GPU a loop launches ~8
          kernels per parameter where ``_foreach_*`` launches one per chunk of tensors; on a CPU both are loops
  fsdp2   2 ranks (torchrun, gloo on CPU), every decoder layer and the model ``fully_shard``-ed: each parameter a
          DTensor shard, whose every op goes through DTensor's dispatch (per op, not per element)

Sizes: 50m (56.8 M parameters, 123 tensors), ``--quick`` 10m, ``--smoke`` tiny and 2 rounds (no figures).
The ratio is foreach / loop step time, per layout (< 1: foreach faster); both give the same bits
(tests/test_optim.py). Writes bench/results/optimizer_step.json. On a CPU the loop is the faster (the trainer's
default there, ``foreach=None``: multi-tensor on CUDA only, as torch's AdamW); the GPU's figure comes from
bench/gpu_checks.sh.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, machine, write_result  # noqa: E402


def build(size: str, device: str):
    """The bf16 model's parameters and a grad for each (fixed seeds)."""
    import torch

    from cascade_rl.learner.tiny_model import model_config

    torch.manual_seed(0)
    config, model_cls = model_config("qwen3_moe", size, vocab_size=512, pad_id=0, eos_id=1, max_len=256)
    model = model_cls(config).to(device, torch.bfloat16)
    return model


def time_steps(params: list, rounds: int, sync) -> dict[str, list[float]]:
    """``step()`` seconds per round for each mode, alternating, on optimizers of their own over the same tensors."""
    import torch

    from cascade_rl.learner.optim import MasterAdamW

    opts = {mode: MasterAdamW(params, lr=3e-6, foreach=mode == "foreach") for mode in ("foreach", "loop")}
    assert MasterAdamW(params, lr=3e-6).foreach == (params[0].device.type == "cuda")  # the default: CUDA only
    times: dict[str, list[float]] = {mode: [] for mode in opts}
    g = torch.Generator().manual_seed(1)
    for r in range(rounds + 1):  # round 0 creates the state (masters, moments): a warm-up, not timed
        for mode, opt in opts.items():
            for p in params:
                grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)  # the same on every rank
                if hasattr(p, "full_tensor"):  # a DTensor shard: its grad is the shard of the same placements
                    from torch.distributed.tensor import distribute_tensor

                    grad = distribute_tensor(grad, p.device_mesh, p.placements)
                p.grad = grad
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if r:
                times[mode].append(time.perf_counter() - t0)
            opt.zero_grad()
    return times


def one(size: str, rounds: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = list(build(size, device).parameters())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = time_steps(params, rounds, sync)
    return {"device": device, "tensors": len(params), "params": sum(p.numel() for p in params), "step_s": times}


def fsdp_worker(size: str, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build(size, "cpu")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    times = time_steps(params, rounds, lambda: None)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"tensors": len(params), "step_s": times}))
    dist.barrier()
    dist.destroy_process_group()


def fsdp2(size: str, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fsdp2.json"
        # the ranks are CPU ranks (gloo): hide the GPUs, or FSDP2's default mesh sets a CUDA device per rank
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", CUDA_VISIBLE_DEVICES="")
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            __file__, "--worker", size, str(rounds), str(out)], capture_output=True, text=True,
                           env=env, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"the fsdp2 ranks failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return {"device": "cpu (2 ranks, gloo)", **json.loads(out.read_text())}


def summarize(layout: dict) -> dict:
    med = {mode: statistics.median(ts) for mode, ts in layout["step_s"].items()}
    return {**layout, "median_s": med, "foreach_over_loop": round(med["foreach"] / med["loop"], 3)}


def main() -> dict:
    ap = bench_parser(__doc__, quick="10m", smoke="tiny, 2 rounds: no figures")
    ap.add_argument("--rounds", type=int, default=10, help="timed steps per mode")
    args = ap.parse_args()
    size = "tiny" if args.smoke else "10m" if args.quick else "50m"
    rounds = 2 if args.smoke else args.rounds
    layouts = {"one": summarize(one(size, rounds)), "fsdp2": summarize(fsdp2(size, rounds))}
    summary = {
        "name": "optimizer_step",
        "metric": f"MasterAdamW step s, foreach, {size} bf16, 2 FSDP2 ranks (CPU)",
        "value": round(layouts["fsdp2"]["median_s"]["foreach"], 4),
        "baseline": "one parameter at a time (foreach=False)",
        "baseline_value": round(layouts["fsdp2"]["median_s"]["loop"], 4),
        "ratio": layouts["fsdp2"]["foreach_over_loop"],
        "target": None,
        "pass": None,
        "machine": machine(),
        "one_foreach_over_loop": layouts["one"]["foreach_over_loop"],
    }
    return write_result(summary, {**summary, "size": size, "rounds": rounds, "layouts": layouts}, smoke=args.smoke)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        fsdp_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()

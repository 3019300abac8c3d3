"""Host memory per published version: an FSDP2 trainer (2 CPU ranks, gloo) publishing through ``shm``.

    .venv/bin/python bench/publish_memory.py [--size 50m] [--arch qwen3_moe] [--dtype bfloat16] [--quick | --smoke]

Builds a ``make-tiny-model`` model of ``--size`` (50m: 512 wide, 8 layers, MoE), shards it over two ranks as the
trainer does (learner/parallel.py: bf16 weights held as fp32 shards) and publishes one version with each way,
each in fresh processes (the allocator keeps freed pages, so one process per way):

* ``gathered`` (the trainer's): ``trainer.publish``: every parameter gathered when the transport reads it,
  written to /dev/shm through the staging path, dropped.
* ``full_state_dict`` (before): the whole state dict gathered to rank 0's host memory, then published (the
  previous trainer: ``transport.publish(strip_prefix(full_state_dict(policy)))``, tied weights copied).

For each: rank 0's peak RSS during the publish above its RSS before it (sampled every millisecond), the file's
bytes (tmpfs: host memory too) and the files in the run's /dev/shm folder after three versions (``keep`` 2).
Host RAM per version = peak RSS delta + the file. On CUDA the staging buffers add 2 x 64 MiB pinned, once.

Writes bench/results/publish_memory.json; the last stdout line is the summary JSON object (bench/run_all.py's
row: host bytes per version against the full state dict's; target: at most 0.75 of it, and rank 0's memory
above the file under 0.75 of the model's bytes). ``--quick``: the 10m model; ``--smoke``: the tiny one, the
gathered mode alone (one torchrun of 2 ranks; its own baseline, ratio 1): the code path in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks run with PYTHONSAFEPATH (bench/ not on it)
from _common import bench_parser, sft_model, write_result  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest RSS seen while the block runs, sampled every millisecond by a thread."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def rank_main(model_dir: str, mode: str, dtype: str, out: str) -> None:
    """One way of publishing, on every rank torchrun started."""
    from transformers import AutoModelForCausalLM

    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import publish, strip_prefix
    from cascade_rl.modeling.policy import Policy
    from cascade_rl.weights.layout import unshared
    from cascade_rl.weights.shm import ShmTransport

    ranks = parallel.init(int(os.environ["WORLD_SIZE"]))
    if mode == "full_state_dict":
        parallel.LOW_PRECISION = ()  # the trainer before: bf16 shards (no fp32 master shards), as it gathered them
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    policy = parallel.parallelize(Policy(model), ranks)
    transport = ShmTransport(f"bench-publish-memory-{os.getppid()}") if ranks.main else None
    report = {}
    for version in (1, 2, 3):
        torch.distributed.barrier()
        with PeakRss() as peak:
            if mode == "gathered":
                notice = publish(transport, policy, ranks, version)
            else:
                state = parallel.full_state_dict(policy, ranks)
                notice = transport.publish(unshared(strip_prefix(state)), version) if ranks.main else None
                del state
        if ranks.main and version == 1:
            report = {"peak_rss_delta": peak.peak - peak.base, "file_bytes": notice.nbytes, "largest_param": largest}
    if ranks.main:
        report["files_after_3_versions"] = len(list(transport.dir.iterdir()))
        report["params"] = sum(p.numel() for p in policy.parameters())
        transport.close()
        Path(out).write_text(json.dumps(report))
    parallel.close(ranks)


def main() -> None:
    ap = bench_parser(__doc__, quick="the 10m model (make bench)", smoke="the tiny model, gathered alone: the code path in seconds")
    ap.add_argument("--size", default="50m")
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)  # model_dir mode out: run by torchrun
    args = ap.parse_args()
    if args.rank:
        return rank_main(args.rank[0], args.rank[1], args.dtype, args.rank[2])

    if args.quick or args.smoke:
        args.size = "tiny" if args.smoke else "10m"
    tmp = Path(tempfile.mkdtemp())
    if args.smoke and args.arch == "qwen3_moe":  # the other smoke runs' tiny model (the same arguments): made once
        model_dir = sft_model(smoke=True)
    else:
        from cascade_rl.learner.tiny_model import make_tiny_model

        model_dir = make_tiny_model(tmp / "model", arch=args.arch, size=args.size)
    # every allocation above 64 KiB its own mapping, returned on free: RSS then shows live memory (glibc otherwise
    # keeps freed tensors' pages in its heap, and the peak measures the allocator's history)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", MALLOC_MMAP_THRESHOLD_="65536")
    results = {}
    for mode in ("gathered",) if args.smoke else ("gathered", "full_state_dict"):
        out = tmp / f"{mode}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--dtype", args.dtype, "--rank", str(model_dir), mode, str(out)]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results[mode] = json.loads(out.read_text())
        r = results[mode]
        r["host_bytes_per_version"] = r["peak_rss_delta"] + r["file_bytes"]
    params = results["gathered"]["params"]
    file_bytes = results["gathered"]["file_bytes"]
    before_mode = "gathered" if args.smoke else "full_state_dict"  # a smoke run: gathered alone, its own baseline
    ours, before = (results[m]["host_bytes_per_version"] for m in ("gathered", before_mode))
    ratio = ours / before
    summary = {
        "name": "publish_memory",
        "metric": f"host MB per published version at {args.size} (rank 0's peak RSS above it + the /dev/shm file), "
                  "one parameter gathered at a time",
        "value": round(ours / 1e6, 1), "baseline": "the full state dict on rank 0",
        "baseline_value": round(before / 1e6, 1), "ratio": round(ratio, 3), "target": "<= 0.75",
        "pass": ratio <= 0.75 and results["gathered"]["peak_rss_delta"] < 0.75 * file_bytes,
        "size": args.size, "arch": args.arch, "dtype": args.dtype, "params": params,
        "file_MB": round(file_bytes / 1e6, 1), "largest_param_MB": round(results["gathered"]["largest_param"] / 1e6, 1),
        **{f"{m}_MB": round(r["host_bytes_per_version"] / 1e6, 1) for m, r in results.items()},
        **{f"{m}_rss_delta_MB": round(r["peak_rss_delta"] / 1e6, 1) for m, r in results.items()},
        # RSS delta in units of the model's bytes: the full state dict is ~1 model (more with copies); gathering
        # one parameter at a time is the largest parameters in flight (CPU: the hash queue holds up to 8), O(1)
        **{f"{m}_rss_delta_models": round(r["peak_rss_delta"] / file_bytes, 2) for m, r in results.items()},
        "files_in_shm": results["gathered"]["files_after_3_versions"],
    }
    write_result(summary, {"summary": summary, "runs": results}, smoke=args.smoke)


if __name__ == "__main__":
    main()

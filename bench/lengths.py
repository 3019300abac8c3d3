"""Trainer memory and step time against sequence length, activations kept against checkpointed (issue 36, part).

    .venv/bin/python bench/lengths.py [--quick | --smoke] [--lengths 1024,4096,16384] [--size 50m]

One sequence of T tokens (64 of prompt, the rest response) through the trainer's Policy on a random Qwen3-MoE
(``make-tiny-model --size``: tiny by default, or 10m, 50m; fp32, padded layout), one forward and backward of the
summed response log-probs, each (T, mode) in a child process of its own so that its peak RSS is that step's alone:
``step GiB`` = the child's peak RSS minus its RSS once the model is loaded (activations, the [T, T] attention
mask SDPA is given, the chunked log-prob pass, the gradients). Modes: ``kept`` (every activation held for the
backward) and ``checkpointed`` (``trainer.activation_checkpointing``: each decoder layer recomputed in the
backward). The growth per token is the slope between the two longest lengths. Baseline: ``kept``, in the same run.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, machine, random_model, results_dir, write_result  # noqa: E402

MODES = {"kept": False, "checkpointed": True}
PROMPT = 64


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def child(model: str, length: int, checkpointing: bool) -> None:
    """One step at ``length``; prints {"step_gib", "seconds", "loaded_gib"}."""
    import torch
    from transformers import AutoModelForCausalLM

    from cascade_rl.modeling.policy import Policy

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    policy = Policy(net, pack=False, share_prefix=False, activation_checkpointing=checkpointing).train()
    ids = torch.randint(5, net.config.vocab_size, (1, length))
    lengths = torch.tensor([length])
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[:, PROMPT:] = True
    loaded = rss_gib()
    t0 = time.perf_counter()
    logprobs, _ = policy(ids, lengths, mask)
    logprobs[mask].sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"step_gib": round(peak - loaded, 3), "seconds": round(seconds, 2), "loaded_gib": round(loaded, 3)}))


def measure(model: str, length: int, mode: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", model, str(length), mode]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def per_token_kib(rows: dict, mode: str) -> float | None:
    """The step's memory growth per token between the two longest lengths measured in ``mode``."""
    done = sorted((t, r[mode]["step_gib"]) for t, r in rows.items() if "step_gib" in r.get(mode, {}))
    if len(done) < 2:
        return None
    (t0, m0), (t1, m1) = done[-2:]
    return round((m1 - m0) * 2**20 / (t1 - t0), 2)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], int(argv[2]), MODES[argv[3]])
        return {}
    ap = bench_parser(__doc__, quick="1K-8K tokens", smoke="256 tokens (the code path, no figures)")
    ap.add_argument("--lengths", default="", help="comma-separated sequence lengths (default: by mode)")
    ap.add_argument("--size", default="tiny", help="make-tiny-model --size of the random model: tiny | 10m | 50m")
    args = ap.parse_args(argv)
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else [256] if args.smoke
               else [1024, 2048, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768])
    model, params = random_model(args.size, results_dir(args.smoke) / "models" if args.smoke else None)
    rows: dict[int, dict] = {}
    for length in lengths:
        rows[length] = {mode: measure(str(model), length, mode, timeout=900) for mode in MODES}
        print(json.dumps({"tokens": length, **rows[length]}), file=sys.stderr, flush=True)
    longest = max(t for t, r in rows.items() if all("step_gib" in r[m] for m in MODES))
    kept, ckpt = rows[longest]["kept"], rows[longest]["checkpointed"]
    ratio = round(kept["step_gib"] / ckpt["step_gib"], 2) if ckpt["step_gib"] > 0 else None
    name = "lengths" if args.size == "tiny" else f"lengths-{args.size}"
    summary = {"name": name, "metric": f"trainer step memory at {longest} tokens, GiB (checkpointed)",
               "value": ckpt["step_gib"], "baseline": "activations kept", "baseline_value": kept["step_gib"],
               "ratio": ratio, "target": None, "pass": None}
    record = {**summary, "machine": machine(), "model": f"{args.size} Qwen3-MoE, {params} parameters, fp32, sdpa",
              "rows": {str(t): r for t, r in rows.items()},
              "per_token_kib": {m: per_token_kib(rows, m) for m in MODES},
              "time_ratio_at_longest": round(ckpt["seconds"] / kept["seconds"], 2)}
    return write_result(summary, record, smoke=args.smoke)


if __name__ == "__main__":
    main()

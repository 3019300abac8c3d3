"""Trainer and engine memory against sequence length: activations kept vs checkpointed; KV paged vs static (issue 36).

    .venv/bin/python bench/lengths.py [--quick | --smoke] [--lengths 1024,4096,16384] [--size 50m]
    .venv/bin/python bench/lengths.py --engine [--quick | --smoke] [--lengths 4096,16384]
    .venv/bin/python bench/lengths.py --context-parallel 2 [--smoke] [--lengths 4096,16384,32768]

One sequence of T tokens (64 of prompt, the rest response) through the trainer's Policy on a random Qwen3-MoE
(``make-tiny-model --size``: tiny by default, or 10m, 50m; fp32, padded layout), one forward and backward of the
summed response log-probs, each (T, mode) in a child process of its own so that its peak RSS is that step's alone:
``step GiB`` = the child's peak RSS minus its RSS once the model is loaded (activations, SDPA's causal kernel: one
unpadded row, no mask is given; the chunked log-prob pass, the gradients). Modes: ``kept`` (every activation held for the
backward) and ``checkpointed`` (``trainer.activation_checkpointing``: each decoder layer recomputed in the
backward). The growth per token is the slope between the two longest lengths. Baseline: ``kept``, in the same run.

``--context-parallel N``: the same step, checkpointed, on N ranks sharing the sequence (``trainer.context_parallel``,
modeling/context_parallel.py: Ulysses attention), each length one ``torch.distributed.run --standalone
--nproc-per-node N`` (gloo, ``OMP_NUM_THREADS=1`` a rank) of FSDP2-sharded Policies (packed layout, one pack of T
tokens, T / N a rank); each rank's ``step GiB`` measured as above, the row's the largest of the ranks, ``seconds``
the slowest rank's. The 1-rank ``checkpointed`` step is measured again in the same run as the baseline. Merged into
the existing result file (``rows[T]["cp<N>_checkpointed"]`` beside ``kept`` and ``checkpointed``, and a
``context_parallel`` section with the ratios and the growth per token); the file's summary is left as it was. On
the CPU the attention after the Ulysses exchange is one causal SDPA a row (no [T, T] tensor); on GPUs the varlen
kernel.

``--engine``: the torch engine's memory against the tokens in flight, for a mix of a few long rows among many short
ones: ``LONG_ROWS`` rows of each ``--lengths`` prompt tokens among ``SHORT_ROWS`` of ``SHORT`` tokens, every row
``MAX_TOKENS`` new tokens (ignore_eos), all rows admitted at once, on the same random model with its context raised
to fit. Each (length, mode) in a child process: ``cache GiB`` (the K/V buffers) and ``step GiB`` (peak RSS less the
RSS once loaded: the cache, the prefills' activations, the decode steps). Modes: ``static`` (every slot reserves the
longest row, the C++ decode kernel off so that both run torch ops), ``paged`` (a pool of exactly the tokens in
flight, rounded to 16-token blocks), ``paged_half`` (half that pool: rows wait and are preempted). Baseline:
``static``. Last, the speed of a small batch of short rows only (``SMALL``), static with the C++ kernels, static on
torch ops and paged.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, machine, random_model, results_dir, run_child, write_result  # noqa: E402

MODES = {"kept": False, "checkpointed": True}
PROMPT = 64
ENGINE_MODES = {"static": 0.0, "paged": 1.0, "paged_half": 0.5}  # the paged pool as a share of the tokens in flight
LONG_ROWS, SHORT_ROWS, SHORT, MAX_TOKENS, BLOCK = 4, 60, 256, 32, 16
SMALL = (64, 128, 64)  # the speed check: rows, prompt tokens, new tokens


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
    print(json.dumps(measured_step(policy, net.config.vocab_size, length)))


def measured_step(policy, vocab: int, length: int, before=None) -> dict:
    """One forward + backward of the summed response log-probs of a ``length``-token row (seed 0: the same tokens in
    every process): {"step_gib": peak RSS less RSS before the step, "seconds", "loaded_gib"}. ``before()`` runs just
    before the RSS is read (a barrier)."""
    import torch

    ids = torch.randint(5, vocab, (1, length))
    lengths = torch.tensor([length])
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[:, PROMPT:] = True
    if before is not None:
        before()
    loaded = rss_gib()
    t0 = time.perf_counter()
    logprobs, _ = policy(ids, lengths, mask)
    logprobs[mask].sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"step_gib": round(peak - loaded, 3), "seconds": round(seconds, 2), "loaded_gib": round(loaded, 3)}


def cp_child(model: str, length: int) -> None:
    """One rank of ``torch.distributed.run``: the checkpointed step at ``length`` with the sequence split across the
    ranks; rank 0 prints {"step_gib", "seconds", "loaded_gib", "ranks": [per rank]} (the largest and slowest)."""
    import os

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from cascade_rl.learner import parallel
    from cascade_rl.modeling.policy import Policy

    world = int(os.environ["WORLD_SIZE"])
    ranks = parallel.init(world, context_parallel=world)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    policy = parallel.parallelize(Policy(net, pack=True, pack_tokens=length, share_prefix=False,
                                         activation_checkpointing=True, context_parallel=ranks.context), ranks).train()
    mine = measured_step(policy, net.config.vocab_size, length, before=dist.barrier)
    every = [None] * world
    dist.all_gather_object(every, mine)
    if ranks.main:
        print(json.dumps({"step_gib": max(r["step_gib"] for r in every), "seconds": max(r["seconds"] for r in every),
                          "loaded_gib": max(r["loaded_gib"] for r in every), "ranks": every}), flush=True)
    parallel.close(ranks)


def cp_measure(model: Path, length: int, cp: int, timeout: float) -> dict:
    """``cp_child`` on ``cp`` ranks under torch.distributed.run: rank 0's line, or {"error": ...}."""
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
           "--cp-child", str(model), str(length)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [x for x in r.stdout.strip().splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
    return json.loads(lines[-1])


def cp_main(args, lengths: list[int]) -> dict:
    """The ``--context-parallel`` arm, merged into the size's existing result file (see the module docstring)."""
    cp = args.context_parallel
    model, params = random_model(args.size, results_dir(args.smoke) / "models" if args.smoke else None)
    arm = f"cp{cp}_checkpointed"
    name = "lengths" if args.size == "tiny" else f"lengths-{args.size}"
    path = results_dir(args.smoke) / f"{name}.json"
    record = json.loads(path.read_text()) if path.is_file() else {
        "name": name, "metric": "trainer step memory, GiB (checkpointed)", "value": None, "baseline": None,
        "baseline_value": None, "ratio": None, "target": None, "pass": None, "machine": machine(),
        "model": f"{args.size} Qwen3-MoE, {params} parameters, fp32, sdpa", "rows": {}}
    summary = {k: record[k] for k in ("name", "metric", "value", "baseline", "baseline_value", "ratio", "target",
                                      "pass")}
    measured: dict[int, dict] = {}
    for length in lengths:
        measured[length] = {"checkpointed": measure(["--child", str(model), str(length), "checkpointed"], timeout=900),
                            arm: cp_measure(model, length, cp, timeout=900)}
        print(json.dumps({"tokens": length, **measured[length]}), file=sys.stderr, flush=True)
        record["rows"].setdefault(str(length), {})[arm] = measured[length][arm]
    ratios = {str(t): round(r[arm]["step_gib"] / r["checkpointed"]["step_gib"], 2) for t, r in measured.items()
              if "step_gib" in r[arm] and r["checkpointed"].get("step_gib", 0) > 0}
    times = {str(t): round(r[arm]["seconds"] / r["checkpointed"]["seconds"], 2) for t, r in measured.items()
             if "seconds" in r[arm] and r["checkpointed"].get("seconds", 0) > 0}
    record["context_parallel"] = {
        "size": cp, "arm": arm, "lengths": lengths, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "launch": f"torch.distributed.run --standalone --nproc-per-node={cp}, gloo, OMP_NUM_THREADS=1 a rank, "
                  "FSDP2, packed layout, checkpointed; step_gib: the largest rank's, seconds: the slowest's",
        "one_rank_checkpointed": {str(t): r["checkpointed"] for t, r in measured.items()},
        "peak_ratio_to_one_rank": ratios, "time_ratio_to_one_rank": times,
        "per_token_kib": {arm: per_token_kib(measured, arm), "checkpointed": per_token_kib(measured, "checkpointed")},
        "attention": "CPU: one causal SDPA a row after the Ulysses exchange (the flash kernel, no [T, T] tensor)"}
    return write_result(summary, record, smoke=args.smoke, name=name)


def engine_child(model: str, spec: str) -> None:
    """One generate call of the rows in ``spec`` (JSON: [[rows, prompt tokens], ...], max_tokens, mode, pool share,
    kernels); prints {"cache_gib", "step_gib", "seconds", "tokens_per_s", "in_flight", "counters"}."""
    import numpy as np
    import torch

    from cascade_rl.samplers.engine import GenerationRequest
    from cascade_rl.samplers.torch_engine import TorchEngine

    rows, max_tokens, mode, share, kernels = json.loads(spec)
    in_flight = sum(n * (p + max_tokens) for n, p in rows)
    pool = -(-int(in_flight * share) // BLOCK) * BLOCK + sum(n for n, _ in rows) * BLOCK  # rows' last blocks
    engine = TorchEngine(model, max_batch=sum(n for n, _ in rows), ignore_eos=True, cpu_kernels=kernels,
                         kv_cache="paged" if share else "static", kv_cache_tokens=pool, kv_block_size=BLOCK)
    rng = np.random.default_rng(0)
    reqs = [GenerationRequest(f"{p}-{i}", rng.integers(5, engine.vocab_size, p).astype(np.int32), 1, 1.0, 1.0,
                              max_tokens, [], seed=i) for n, p in rows for i in range(n)]
    torch.manual_seed(0)
    loaded = rss_gib()
    t0 = time.perf_counter()
    engine.generate(reqs)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    cache = sum(b.numel() * b.element_size() for b in engine.cache.buffers())
    print(json.dumps({"cache_gib": round(cache / 2**30, 4), "step_gib": round(peak - loaded, 3),
                      "seconds": round(seconds, 2), "tokens_per_s": round(len(reqs) * max_tokens / seconds, 1),
                      "in_flight": in_flight, "counters": dict(engine.counters)}))


def long_context(model: Path, context: int) -> Path:
    """The model with ``max_position_embeddings`` raised to ``context`` (same weights; RoPE needs nothing more)."""
    out = model.with_name(f"{model.name}-ctx{context}")
    if not (out / "config.json").exists():
        shutil.copytree(model, out, dirs_exist_ok=True)
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = context
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def engine_main(args, lengths: list[int]) -> dict:
    model, params = random_model(args.size, results_dir(args.smoke) / "models" if args.smoke else None)
    long_rows, short_rows, short, max_tokens = (2, 6, 32, 8) if args.smoke else (LONG_ROWS, SHORT_ROWS, SHORT,
                                                                                 MAX_TOKENS)
    model = long_context(model, max(max(lengths) + max_tokens, 512))
    rows: dict[int, dict] = {}
    for length in lengths:
        mix = [[long_rows, length], [short_rows, short]]
        rows[length] = {mode: measure(["--engine-child", str(model), json.dumps([mix, max_tokens, mode, share, False])],
                                      timeout=1800) for mode, share in ENGINE_MODES.items()}
        print(json.dumps({"long": length, **rows[length]}), file=sys.stderr, flush=True)
    small = [[SMALL[0], SMALL[1]]], SMALL[2]
    speed = {name: measure(["--engine-child", str(model), json.dumps([*small, mode, share, kernels])], timeout=900)
             for name, mode, share, kernels in [("static_cpu_kernels", "static", 0.0, None),
                                                ("static", "static", 0.0, False), ("paged", "paged", 1.0, False)]
             if not args.smoke}  # smoke: the memory part's children alone (seconds each)
    longest = max(t for t, r in rows.items() if all("cache_gib" in r[m] for m in ENGINE_MODES))
    static, paged = rows[longest]["static"], rows[longest]["paged"]
    summary = {"name": "lengths-engine" if args.size == "tiny" else f"lengths-engine-{args.size}",
               "metric": f"engine KV cache GiB, {long_rows} rows of {longest} among {short_rows} of {short} (paged)",
               "value": paged["cache_gib"], "baseline": "static per-row reservation",
               "baseline_value": static["cache_gib"],
               "ratio": round(static["cache_gib"] / paged["cache_gib"], 2) if paged["cache_gib"] else None,
               "target": None, "pass": None}
    record = {**summary, "machine": machine(), "model": f"{args.size} Qwen3-MoE, {params} parameters, fp32",
              "mix": {"long_rows": long_rows, "short_rows": short_rows, "short": short, "max_tokens": max_tokens,
                      "block": BLOCK}, "rows": {str(t): r for t, r in rows.items()},
              "small_batch": {"rows": small[0][0][0], "prompt": SMALL[1], "max_tokens": small[1], **speed}}
    return write_result(summary, record, smoke=args.smoke)


def measure(args: list[str], timeout: float) -> dict:
    """This file run with ``args`` in a child process of its own: its last stdout line, or {"error": ...}."""
    return run_child(__file__, args, timeout)


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
    if argv and argv[0] == "--cp-child":
        cp_child(argv[1], int(argv[2]))
        return {}
    if argv and argv[0] == "--engine-child":
        engine_child(argv[1], argv[2])
        return {}
    ap = bench_parser(__doc__, quick="1K-8K tokens", smoke="256 tokens (the code path, no figures)")
    ap.add_argument("--lengths", default="", help="comma-separated sequence lengths (default: by mode)")
    ap.add_argument("--size", default="tiny", help="make-tiny-model --size of the random model: tiny | 10m | 50m")
    ap.add_argument("--engine", action="store_true", help="the torch engine's KV memory, paged vs static, instead")
    ap.add_argument("--context-parallel", type=int, default=1,
                    help="N > 1: the checkpointed step on N ranks sharing the sequence (torch.distributed.run, gloo)")
    args = ap.parse_args(argv)
    if args.context_parallel > 1:
        return cp_main(args, [int(x) for x in args.lengths.split(",")] if args.lengths else [256] if args.smoke
                       else [4096, 16384] if args.quick else [4096, 16384, 32768])
    if args.engine:
        return engine_main(args, [int(x) for x in args.lengths.split(",")] if args.lengths else [512] if args.smoke
                           else [1024, 4096] if args.quick else [1024, 4096, 16384])
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else [256] if args.smoke
               else [1024, 2048, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768])
    model, params = random_model(args.size, results_dir(args.smoke) / "models" if args.smoke else None)
    rows: dict[int, dict] = {}
    for length in lengths:
        rows[length] = {mode: measure(["--child", str(model), str(length), mode], timeout=900) for mode in MODES}
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

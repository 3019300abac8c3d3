"""Sequence packing: padding saved on an RL length mix, and forward+backward tokens/s packed vs padded.

    .venv/bin/python bench/packing.py [--quick | --smoke] [--model DIR] [--arch qwen3_moe|qwen3] [--threads N]

Length mix (seeded, numpy): 128 groups x 8 rollouts, max length 2048. Each group
has one prompt of U{40..200} tokens; response lengths are long-tailed as in
reasoning RL, log-normal with a per-group difficulty term (hard prompts make all
eight answers long):

    response = exp(ln 400 + g + e),  g ~ N(0, 0.5) per group,  e ~ N(0, 0.8) per rollout,

rounded and clipped to [1, 2048 − prompt] (about 5% hit the cap, as truncated
rollouts do). Token counts are reported for three layouts: the trainer's padded
batch (every row padded to the batch's longest), padded per micro-batch of one
group (each group padded to its own longest), and packed (no padding at all).

Timing (CPU, the tiny model, fp32, one torch thread unless ``--threads``): the same
mix with every length divided by 4 (max 512, the tiny model's context), the first
2 groups (``--quick``) or 4 groups (``--smoke``: one group, lengths divided by 16, one round). Both sides run the same rows and the same
loss (a fixed random per-token weight times the token log-probs) through one
forward+backward: padded as one [rows, L] batch with an attention mask, packed as
``modeling.packing.pack(..., max_tokens=L)`` with one forward+backward per pack,
gradients accumulated. Capping a pack at L keeps sdpa's materialised [T, T] mask
and its T² attention no larger than the padded side's per-row L²; on GPU with
flash-attn varlen the attention cost is Σ len² whatever the cap. Rounds alternate
the two sides (order flips each round) after one warm-up each; the headline is
the median over rounds of packed/padded real-token throughput (real tokens =
non-padding tokens, the same on both sides). Target: packed ≥ padded (ratio ≥
1.0). The run also checks that both layouts give the same log-probs (max |Δ|).
One thread by default because on a shared 2-core machine two OpenMP threads
spin-wait on each other whenever a neighbour takes a core: rounds then swing by
20x and measure the neighbours, not the layouts (``--threads 0``: torch's default).

Writes bench/results/packing.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.modeling.packing import pack, pack_values, packed_forward, packed_token_logprobs, unpack

ROOT = Path(__file__).resolve().parent
GROUPS, GROUP_SIZE, MAX_LEN, TIMING_SCALE, TARGET = 128, 8, 2048, 4, 1.0



def rollout_lengths(groups: int, group_size: int, max_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response lengths [groups * group_size], rows ordered group by group."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(40, 201, groups).repeat(group_size)
    difficulty = rng.normal(0.0, 0.5, groups).repeat(group_size)
    response = np.exp(math.log(400) + difficulty + rng.normal(0.0, 0.8, groups * group_size))
    response = np.clip(np.rint(response), 1, max_len - prompt).astype(np.int64)
    return prompt, response


def layout_tokens(total: np.ndarray, group_size: int) -> dict:
    real = int(total.sum())
    padded_batch = int(len(total) * total.max())
    padded_groups = int(sum(group_size * g.max() for g in total.reshape(-1, group_size)))
    return {
        "rows": len(total), "real_tokens": real, "padded_batch_tokens": padded_batch,
        "padded_per_group_tokens": padded_groups, "padding_saved_vs_batch_pct": 100 * (1 - real / padded_batch),
        "padding_saved_vs_per_group_pct": 100 * (1 - real / padded_groups),
        "response_p50_p90_p99_max": [int(np.percentile(total, q)) for q in (50, 90, 99)] + [int(total.max())],
    }


# --- timing ---------------------------------------------------------------------------------


def step_padded(model, ids, real, weights) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=real.long()).logits
    lp = token_logprobs(logits, ids)
    (lp * weights).sum().backward()
    return lp.detach() * real


def step_packed(model, ids, lengths, weights) -> torch.Tensor:
    out = torch.zeros(ids.shape)
    for p in pack(ids, lengths, max_tokens=ids.shape[1]):
        lp = packed_token_logprobs(packed_forward(model, p), p)
        (lp * pack_values(weights, p)).sum().backward()
        out[p.rows] = unpack(lp.detach(), p, ids.shape[1])
    return out


def timed(fn, model, *args) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = fn(model, *args)
    return time.perf_counter() - t0, out


def time_layouts(model_dir: str, lengths: np.ndarray, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    width = int(lengths.max())
    lengths_t = torch.from_numpy(lengths)
    real = torch.arange(width)[None, :] < lengths_t[:, None]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), width), generator=gen) * real
    weights = torch.randn(ids.shape, generator=gen) * real
    weights[:, 0] = 0.0
    sides = {"padded": (step_padded, ids, real, weights), "packed": (step_packed, ids, lengths_t, weights)}
    outs = {name: timed(fn, model, *args)[1] for name, (fn, *args) in sides.items()}  # warm-up
    max_diff = (outs["packed"] - outs["padded"]).abs().max().item()
    n_real = int(lengths.sum())
    per_round = []
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        res = {name: n_real / timed(sides[name][0], model, *sides[name][1:])[0] for name in order}
        per_round.append(res)
        print(f"round {r}: padded {res['padded']:8.0f} tok/s   packed {res['packed']:8.0f} tok/s", file=sys.stderr)
    return {
        "rows": len(lengths), "width": width, "real_tokens": n_real, "padded_tokens": len(lengths) * width,
        "packs": len(pack(ids, lengths_t, max_tokens=width)), "logprob_max_abs_diff": max_diff,
        "padded_tok_s_median": statistics.median(r["padded"] for r in per_round),
        "packed_tok_s_median": statistics.median(r["packed"] for r in per_round),
        "ratio_median": statistics.median(r["packed"] / r["padded"] for r in per_round),
        "rounds": per_round,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="2 groups timed over 3 rounds instead of 4 groups over 7",
                      smoke="1 group at 1/16 of the lengths, 1 round: seconds")
    ap.add_argument("--model", default=str(ROOT.parent / "models" / "tiny"), help="HF dir of a tiny model")
    ap.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen3"],
                    help="arch of the model built when --model is missing")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); see the docstring")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    # --- the length mix and its token counts
    prompt, response = rollout_lengths(GROUPS, GROUP_SIZE, MAX_LEN)
    total = prompt + response
    mix = layout_tokens(total, GROUP_SIZE)
    mix["truncated_pct"] = 100 * float((total == MAX_LEN).mean())
    print(f"mix: {mix['real_tokens']} real tokens, padded batch {mix['padded_batch_tokens']} "
          f"({mix['padding_saved_vs_batch_pct']:.1f}% saved), per-group {mix['padded_per_group_tokens']} "
          f"({mix['padding_saved_vs_per_group_pct']:.1f}% saved)", file=sys.stderr)

    # --- timing on a scaled-down sample
    model_dir = args.model
    if not (Path(model_dir) / "config.json").exists():
        from cascade_rl.learner.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch=args.arch))
    timing_groups, rounds = (1, 1) if args.smoke else (2, 3) if args.quick else (4, 7)
    scale = TIMING_SCALE * (4 if args.smoke else 1)
    sample = np.ceil(total[: timing_groups * GROUP_SIZE] / scale).astype(np.int64)
    timing = time_layouts(model_dir, sample, rounds)

    ratio = timing["ratio_median"]
    summary = {"name": "packing",
               "metric": f"fwd+bwd real tokens/s, packed (max_tokens=L), {timing['rows']} rollouts, tiny model, "
                         "fp32, CPU",
               "value": round(timing["packed_tok_s_median"], 1),
               "baseline": "right-padded batch with attention_mask (the trainer's layout)",
               "baseline_value": round(timing["padded_tok_s_median"], 1), "ratio": round(ratio, 2),
               "target": TARGET, "pass": ratio >= TARGET, "machine": machine(),
               "padding_saved_pct": round(mix["padding_saved_vs_batch_pct"], 1)}
    full = {**summary, "mix": mix, "timing": timing, "model": model_dir,
            "workload": {"groups": GROUPS, "group_size": GROUP_SIZE, "max_len": MAX_LEN,
                         "timing_scale": scale, "timing_groups": timing_groups},
            "quick": args.quick}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

"""Sampling tokens/s: the torch engine (samplers/torch_engine.py) against transformers' ``generate``.

    .venv/bin/python bench/torch_engine.py [--quick] [--model models/tiny]

Workload (DESIGN §9): the tiny Qwen3-MoE demo model (built in a temporary
directory if ``--model`` is missing), fp32, 64 chat-formatted arithmetic
prompts (lengths differ), 64 new tokens each, plain sampling at temperature
1.0 (no top-k, no top-p). Both sides produce exactly 64 tokens per sequence,
so they do the same work: ``generate`` with ``min_new_tokens=64`` (EOS
suppressed), the engine with ``ignore_eos=True``. The baseline is one
left-padded ``generate`` call over the 64 prompts; the engine gets the 64
requests (n=1) in one ``generate`` call. Rounds alternate baseline / engine in
the same process (one warm-up call each first), so load from other processes
hits both; the ratio is the median of the per-round ratios. ``--quick`` runs
3 rounds (well under a minute), the full run 7 and then, for the record only
(not the headline), 2 rounds of a larger RL-shaped workload: 32 prompts x
n=8 samples x 128 tokens (``num_return_sequences=8`` for generate; one shared
prefill per group for the engine).

Writes bench/results/torch_engine.json; the last stdout line is the summary
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.learner.tasks import load_task
from cascade_rl.learner.tiny_model import make_tiny_model
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parent
SEQS, NEW_TOKENS, TARGET = 64, 64, 3.0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def prompts(tokenizer, n: int) -> list[np.ndarray]:
    questions = [ex.prompt for ex in load_task("arithmetic", {"heldout": n})["heldout"]]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    return [np.array(tokenizer(t, add_special_tokens=False)["input_ids"], np.int32) for t in texts]


def run_engine(engine: TorchEngine, ids: list[np.ndarray], new_tokens: int) -> tuple[float, int]:
    reqs = [GenerationRequest(f"b{i}", p, 1, 1.0, 1.0, new_tokens, []) for i, p in enumerate(ids)]
    t0 = time.perf_counter()
    groups = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return dt, sum(len(s.response_ids) for g in groups for s in g)


def run_engine_groups(engine: TorchEngine, ids: list[np.ndarray], n: int, new_tokens: int) -> tuple[float, int]:
    reqs = [GenerationRequest(f"g{i}", p, n, 1.0, 1.0, new_tokens, []) for i, p in enumerate(ids)]
    t0 = time.perf_counter()
    groups = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return dt, sum(len(s.response_ids) for g in groups for s in g)


def run_generate(model, tokenizer, ids: list[np.ndarray], new_tokens: int, n: int = 1) -> tuple[float, int]:
    width = max(len(p) for p in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, p in enumerate(ids):  # left padding, as generate wants for decoder-only models
        input_ids[i, width - len(p) :] = torch.from_numpy(p.astype(np.int64))
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             num_return_sequences=n, pad_token_id=tokenizer.pad_token_id)
    dt = time.perf_counter() - t0
    return dt, int((out.shape[1] - width) * out.shape[0])


def main(argv: list[str] | None = None) -> dict:
    # --- args ---
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--model", default=str(ROOT.parent / "models" / "tiny"), help="HF dir of the tiny MoE model")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)

    # --- model, engine, prompts ---
    model_dir = args.model
    if not (Path(model_dir) / "config.json").exists():
        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="qwen3_moe"))
    torch.manual_seed(0)
    engine = TorchEngine(model_dir, dtype="float32", ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompts(engine.tokenizer, SEQS)

    # --- warm-up, then alternating rounds ---
    run_generate(hf, engine.tokenizer, ids[:8], 4)
    run_engine(engine, ids[:8], 4)
    per_round = []
    for r in range(rounds):
        base_s, base_tok = run_generate(hf, engine.tokenizer, ids, NEW_TOKENS)
        ours_s, ours_tok = run_engine(engine, ids, NEW_TOKENS)
        assert base_tok == ours_tok == SEQS * NEW_TOKENS, (base_tok, ours_tok)
        per_round.append({"round": r, "baseline_s": base_s, "engine_s": ours_s, "baseline_tok_s": base_tok / base_s,
                          "engine_tok_s": ours_tok / ours_s, "ratio": (ours_tok / ours_s) / (base_tok / base_s)})
        print(f"round {r}: generate {base_tok / base_s:8.0f} tok/s   engine {ours_tok / ours_s:8.0f} tok/s   "
              f"ratio {per_round[-1]['ratio']:.2f}", file=sys.stderr)

    extra = []
    if not args.quick:  # the larger workload, for the record
        group_ids = ids[:32]
        for r in range(2):
            base_s, base_tok = run_generate(hf, engine.tokenizer, group_ids, 128, n=8)
            ours_s, ours_tok = run_engine_groups(engine, group_ids, 8, 128)
            extra.append({"round": r, "baseline_tok_s": base_tok / base_s, "engine_tok_s": ours_tok / ours_s,
                          "ratio": (ours_tok / ours_s) / (base_tok / base_s)})
            print(f"32x8x128 round {r}: generate {base_tok / base_s:8.0f} tok/s   engine {ours_tok / ours_s:8.0f} "
                  f"tok/s   ratio {extra[-1]['ratio']:.2f}", file=sys.stderr)

    # --- results ---
    ratios = [x["ratio"] for x in per_round]
    value = statistics.median(x["engine_tok_s"] for x in per_round)
    baseline_value = statistics.median(x["baseline_tok_s"] for x in per_round)
    ratio = statistics.median(ratios)
    summary = {"name": "torch_engine", "metric": "tokens/s (64 seqs x 64 new tokens, tiny MoE, fp32, CPU)",
               "value": round(value, 1), "baseline": "transformers generate (do_sample, T=1.0, min_new_tokens=64)",
               "baseline_value": round(baseline_value, 1), "ratio": round(ratio, 2), "target": TARGET,
               "pass": ratio >= TARGET, "machine": machine()}
    full = {**summary, "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": per_round,
            "workload": {"model": model_dir, "sequences": SEQS, "new_tokens": NEW_TOKENS, "dtype": "float32",
                         "prompt_lengths": [len(p) for p in ids], "max_batch": engine.max_batch,
                         "fairness": "every sequence produces exactly 64 tokens on both sides: generate with "
                                     "min_new_tokens=64 (EOS suppressed), the engine with ignore_eos=True; "
                                     "sampling with top_k=0, top_p=1.0, temperature 1.0 on both sides"},
            "groups_32x8x128": extra, "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = ROOT / "results" / "torch_engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

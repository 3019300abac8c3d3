"""Multi-turn next turns on the torch engine: each row's kept K/V plus a prefill of the observation only,
against a prefill of the whole trajectory, in one run.

    .venv/bin/python bench/prefix_reuse.py --model models/tools-sft [--quick] [--rows 64]

Workload: the tool miniature's first turns (``make tools`` builds the model: it answers a tool question with a
python call and EOS), sampled greedily for ``--rows`` held-out questions; the observation is
the chat template's tool turn with the right value (data/render.py ``TurnRenderer``), and the next turn 16
tokens, greedy. The same requests go to two engines of the same model: ``reuse`` (the default) and ``full``
(``prefix_cache_tokens=0``: every next turn prefills its whole prompt). Rounds alternate the order; the
headline is the median over rounds of full / reuse seconds of the next-turn ``generate`` call. Both must give
the same tokens and log-probs within 1e-4. Writes bench/results/prefix_reuse.json; the last stdout line is the
summary JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tools-sft", help="the tool miniature's SFT'd model (make tools)")
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from cascade_rl.data.render import PromptRenderer, TurnRenderer
    from cascade_rl.data.tasks import load_task
    from cascade_rl.samplers.engine import GenerationRequest
    from cascade_rl.samplers.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(args.model)
    turns = TurnRenderer(PromptRenderer(tok, thinking=True))
    examples = load_task("tool_arithmetic", {"heldout": args.rows})["heldout"]
    engines = {"reuse": TorchEngine(args.model), "full": TorchEngine(args.model, prefix_cache_tokens=0)}
    rounds = 3 if args.quick else 7
    times: dict[str, list[float]] = {k: [] for k in engines}
    agree, kept, tokens = True, 0, 0
    for k in range(rounds):
        order = list(engines) if k % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for name in order:
            eng = engines[name]
            firsts, nexts = [], []
            for i, ex in enumerate(examples):
                messages = [{"role": "user", "content": ex.prompt}]
                firsts.append((messages, GenerationRequest(f"g{i}", np.array(turns.render.ids(messages), np.int32),
                                                           1, 0.0, 1.0, 48, [], prefix_keys=[f"g{i}/0/{k}"])))
            samples = eng.generate([r for _, r in firsts])
            for (messages, r), s in zip(firsts, samples):
                ids = np.concatenate([r.prompt_ids, s[0].response_ids])
                conversation = [*messages, {"role": "assistant", "content": turns.assistant_text(s[0].response_ids)},
                                {"role": "tool", "content": f"{ex_value(r, examples)}\n"}]
                obs = turns.observation_ids(ids, conversation)
                nexts.append(GenerationRequest(r.key, np.concatenate([ids, obs]).astype(np.int32), 1, 0.0, 1.0, 16,
                                               [], prefix_keys=list(r.prefix_keys)))
            t0 = time.perf_counter()
            outputs[name] = eng.generate(nexts)
            times[name].append(time.perf_counter() - t0)
            tokens = sum(len(r.prompt_ids) for r in nexts)
        for a, b in zip(outputs["reuse"], outputs["full"]):
            agree &= a[0].response_ids.tolist() == b[0].response_ids.tolist() and bool(
                np.abs(a[0].logprobs - b[0].logprobs).max() <= 1e-4)
    kept = engines["reuse"].counters["prefix_hits"]
    summary = {"bench": "prefix_reuse", "model": args.model, "rows": args.rows, "rounds": rounds,
               "next_turn_prompt_tokens": tokens, "prefix_hits": kept,
               "reused_frac": engines["reuse"].counters["prefix_tokens_reused"] / max(1, tokens * rounds),
               "full_s": statistics.median(times["full"]), "reuse_s": statistics.median(times["reuse"]),
               "speedup": statistics.median(f / r for f, r in zip(times["full"], times["reuse"])), "agree": agree,
               "threads": torch.get_num_threads()}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "prefix_reuse.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    sys.exit(0 if agree else 1)


def ex_value(request, examples) -> str:
    return examples[int(request.key[1:])].answer


if __name__ == "__main__":
    main()

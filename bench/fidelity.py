"""Engine/trainer fidelity of an MoE policy: fp32, bf16, bf16 + routing replay, bf16 + each mismatch correction.

    .venv/bin/python bench/fidelity.py [--quick] [--steps 30] [--configs fp32,bf16,bf16+r3]

One GRPO stage per configuration on the same model, prompts, seed and hardware: make run's SFT'd tiny Qwen3-MoE
(4 MoE layers, 8 experts, top-2), its arithmetic prompts, 8 prompts x 8 rollouts of at most 64 tokens a step,
lr 3e-5 (the demo's RL stages), every process real (``cascade-rl launch``). Every configuration asks the engine
for its routes (``sampler.return_routes``), so the trainer reports how often its own routers choose other
experts than the engine did, replayed or not. Per configuration, over the run's steps:

- ``logprob_abs_diff``: mean |log π_inf − log π_trainer| over response tokens (``mismatch/abs_diff_mean``),
  and its largest value (``abs_diff_max``) and the k3 size of the gap (``kl_k3``);
- ``route_disagree``: the fraction of (token, MoE layer) routes whose expert set the trainer's router picks
  otherwise (``routing/disagree_frac``; with R3 the trainer then takes the engine's);
- ``masked`` / ``truncated``: the fraction of loss tokens the correction zeroed / capped;
- ``reward``: the training reward of the first and last fifth of the steps, and the held-out accuracy is
  left out (the stage is short; the reward curve is in the JSON).

Writes bench/results/fidelity.json; the last stdout line is the summary (the worst token's gap with R3 against
without). BENCHMARKS.md has the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, math_data, sft_model  # noqa: E402
from vs_trl import CLI, run_tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SETUP = {"prompts_per_step": 8, "group_size": 8, "max_tokens": 64, "lr": 3e-5, "seed": 0}
BF16 = ["model.dtype=bf16"]
CONFIGS = {  # name -> launch overrides
    "fp32": ["model.dtype=float32"],
    "bf16": BF16,
    "bf16+r3": [*BF16, "trainer.routing_replay=true"],
    **{f"bf16+{c}": [*BF16, f"trainer.correction={c}"] for c in ("tis", "icepop", "seq_tis", "mis", "geo_mask")},
}


def run(name: str, model: Path, steps: int, work: Path) -> dict:
    run_dir = work / name
    s = SETUP
    args = ["launch", "tiny", f"run_dir={run_dir}", f"model.path={model}", f"run.steps={steps}",
            f"run.prompts_per_step={s['prompts_per_step']}", f"run.group_size={s['group_size']}",
            f"sampling.max_tokens={s['max_tokens']}", f"trainer.lr={s['lr']}", *math_data(), f"data.seed={s['seed']}",
            f"run.seed={s['seed']}", "orchestrator.eval_n=0", "orchestrator.eval_greedy=false",
            "supervisor.progress=none", "sampler.return_routes=true", *CONFIGS[name]]
    t0 = time.perf_counter()
    run_tree([*CLI, *args])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in rows if "version" in m]

    def mean(key):
        values = [m[key] for m in rows if key in m]
        return statistics.mean(values) if values else None

    fifth = max(1, len(rows) // 5)
    return {
        "config": name, "overrides": CONFIGS[name], "wall_s": time.perf_counter() - t0,
        "logprob_abs_diff": mean("trainer/mismatch/abs_diff_mean"),
        "logprob_abs_diff_max": max(m["trainer/mismatch/abs_diff_max"] for m in rows),
        "kl_k3": mean("trainer/mismatch/kl_k3"),
        "route_disagree": mean("trainer/routing/disagree_frac"),
        "masked": mean("trainer/correction/masked_frac"),
        "truncated": mean("trainer/correction/truncated_frac"),
        "reward_first": statistics.mean(m["reward_mean"] for m in rows[:fifth]),
        "reward_last": statistics.mean(m["reward_mean"] for m in rows[-fifth:]),
        "reward_per_step": [m["reward_mean"] for m in rows],
        "step_s": statistics.median(m["step_s"] for m in rows[1:] or rows),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 steps per configuration")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    args = ap.parse_args(argv)
    steps = args.steps or (5 if args.quick else 30)
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    model = sft_model()
    work = Path(tempfile.mkdtemp(prefix="crl-fidelity-"))
    results = []
    for name in names:
        r = run(name, model, steps, work)
        results.append(r)
        print(f"{name}: |dlogp| {r['logprob_abs_diff']:.2e} (max {r['logprob_abs_diff_max']:.2f}), routes differ "
              f"{r['route_disagree']:.4f}, masked {r['masked']:.4f}, truncated {r['truncated']:.4f}, reward "
              f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}, {r['step_s']:.2f} s/step", file=sys.stderr)
    by = {r["config"]: r for r in results}
    summary = {"name": "fidelity", "metric": "worst |Δ log p| engine vs trainer over a GRPO stage, bf16 + R3 "
                                             "(tiny MoE; the other configurations in the JSON)",
               "value": by["bf16+r3"]["logprob_abs_diff_max"] if "bf16+r3" in by else None,
               "baseline": "bf16 without routing replay",
               "baseline_value": by["bf16"]["logprob_abs_diff_max"] if "bf16" in by else None,
               "ratio": None, "target": None, "pass": None, "machine": machine()}
    if summary["value"] is not None and summary["baseline_value"]:
        summary["ratio"] = round(summary["value"] / summary["baseline_value"], 3)
    out = {**summary, "setup": SETUP, "steps": steps, "results": results, "quick": args.quick,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fidelity.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

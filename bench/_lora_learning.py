"""LoRA RL against full fine-tuning, learning: the IF-RL stage of `make run`, from the same SFT checkpoint, same steps.

    .venv/bin/python bench/_lora_learning.py [--quick | --smoke] [--steps 20] [--rank 8] [--lrs 2e-4,6e-4,2e-3,6e-3,2e-2]

From make run's SFT'd tiny model (models/tiny-sft) and data (runs/data/demo), each run a one-stage cascade
(`cascade-rl cascade`, configs/cascade/demo.yaml's IF-RL stage and settings: 16 prompts x 8, lr 5e-5 for full
fine-tuning): its checkpoints evaluated by the cascade's own evaluation (avg@4 at T = 1, 96 tokens).

The held-out IF questions (128) are split in two: the first half picks LoRA's learning rate, the second compares.
**Sweep**: ``--steps`` of LoRA (rank ``--rank``, alpha 2 x rank) at each of ``--lrs``, scored on the first half;
the best is LoRA's rate. **Race**: full fine-tuning (the stage's lr) and LoRA (that rate), the same steps and seed,
scored on the second half; recorded, each against the SFT start and LoRA against full, the paired 95 % interval of
the per-question difference (orchestrator/evaluate.py ``paired_gain``: the same questions, each answered 4 times by
both). Baseline: full fine-tuning, in the same run.

Writes bench/results/lora_learning.json; the last stdout line is the summary JSON object. ``--quick``: 10 steps, two
rates. ``--smoke``: a random tiny model and a few rows, 1 step, one rate. Five cascades of real launches (about 12
minutes on 2 cores; smoke: 3, about 3 minutes), so the name starts with ``_``: tests/test_benches.py's smoke runs
keep to one launch a script.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CLI, ROOT, bench_parser, builtin_data, machine, results_dir, sft_model, write_result  # noqa: E402

FULL_LR = 5e-5  # configs/run/cascade.yaml: the demo cascade's RL stages
SMOKE = ["run.prompts_per_step=2", "run.group_size=2", "sampling.max_tokens=8", "orchestrator.dynamic_filtering=false"]


def split_heldout(path: str, out: Path) -> tuple[Path, Path]:
    """The held-out file's rows as two files: the first half (the sweep's) and the second (the race's)."""
    rows = Path(path).read_text().splitlines()
    half = len(rows) // 2
    out.mkdir(parents=True, exist_ok=True)
    first, second = out / "if_sweep.jsonl", out / "if_race.jsonl"
    first.write_text("\n".join(rows[:half]) + "\n")
    second.write_text("\n".join(rows[half:]) + "\n")
    return first, second


def cascade(out: Path, model: Path, train: str, heldout: Path, steps: int, extra: list[str], smoke: bool,
            must: bool = True) -> dict | None:
    """One one-stage cascade (IF-RL), resumed past when its record is done; its record (a failed one: SystemExit,
    or None unless ``must``: a sweep's rate too high, whose policy collapses until dynamic filtering finds no group
    with a signal)."""
    record = out / "cascade.json"
    if not (record.is_file() and json.loads(record.read_text()).get("stages", {}).get("if_rl", {}).get("done")):
        out.mkdir(parents=True, exist_ok=True)
        config = {"run_dir": str(out), "model": str(model), "run": "cascade",
                  "overrides": [f"run.steps={steps}", f"trainer.save_every={steps}", "supervisor.progress=none",
                                *(SMOKE if smoke else [])],
                  "eval": {"files": [str(heldout)], "n": 1 if smoke else 4, "max_tokens": 8 if smoke else 96},
                  "stages": [{"name": "if_rl", "stage": "if_rl", "overrides": [f"data.files=[{train}]", *extra]}]}
        path = out / "cascade.yaml"
        path.write_text(json.dumps(config))  # YAML is a superset of JSON
        with open(out / "cascade.log", "w") as log:
            rc = subprocess.run([*CLI, "cascade", str(path)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if rc != 0 and must:
            raise SystemExit(f"cascade in {out} failed (rc {rc}); see {out / 'cascade.log'}")
        if rc != 0:
            return None
    return json.loads(record.read_text())


def final(record: dict) -> dict:
    return record["stages"]["if_rl"]["checkpoints"][-1]


def gain(after: dict, before: dict) -> dict:
    from cascade_rl.orchestrator.evaluate import paired_gain

    return paired_gain(np.array(after["per_question"]), np.array(before["per_question"]))


def main() -> None:
    parser = bench_parser(__doc__, quick="10 steps, two rates", smoke="random tiny model, 1 step, one rate")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lrs", default="2e-4,6e-4,2e-3,6e-3,2e-2")
    a = parser.parse_args()
    steps = 1 if a.smoke else 10 if a.quick else a.steps
    lrs = [float(x) for x in a.lrs.split(",")]
    lrs = lrs[1:2] if a.smoke else lrs[:2] if a.quick else lrs
    files = builtin_data(a.smoke)
    model = sft_model(a.smoke)
    out = results_dir(a.smoke) / ("lora_learning_quick" if a.quick else "lora_learning")
    sweep_file, race_file = split_heldout(files["heldout"]["arithmetic_if"], out / "heldout")
    train = files["rl"]["arithmetic_if"]
    lora = [f"trainer.lora.rank={a.rank}", f"trainer.lora.alpha={2 * a.rank}"]
    t0 = time.perf_counter()

    sweep = {}
    for lr in lrs:
        rec = cascade(out / f"sweep_lr{lr:g}", model, train, sweep_file, steps, [*lora, f"trainer.lr={lr}"], a.smoke,
                      must=False)
        sweep[f"{lr:g}"] = {"start": rec["initial"]["accuracy"], "final": final(rec)["accuracy"]} if rec else \
            {"failed": f"the run stopped (see {out.name}/sweep_lr{lr:g}/cascade.log)"}
    best = max((lr for lr in lrs if "final" in sweep[f"{lr:g}"]), key=lambda lr: sweep[f"{lr:g}"]["final"])

    full = cascade(out / "race_full", model, train, race_file, steps, [f"trainer.lr={FULL_LR}"], a.smoke)
    adapted = cascade(out / f"race_lora_lr{best:g}", model, train, race_file, steps, [*lora, f"trainer.lr={best}"], a.smoke)
    start = full["initial"]
    race = {
        "questions": len(start["per_question"]),
        "start": start["accuracy"],
        "full": {"lr": FULL_LR, "accuracy": final(full)["accuracy"], "vs_start": gain(final(full), start)},
        "lora": {"lr": best, "rank": a.rank, "accuracy": final(adapted)["accuracy"],
                 "vs_start": gain(final(adapted), start)},
        "lora_vs_full": gain(final(adapted), final(full)),
    }
    d = race["lora_vs_full"]
    summary = {"name": "lora_learning", "metric": f"held-out IF accuracy after {steps} steps, LoRA r{a.rank}",
               "value": race["lora"]["accuracy"], "baseline": "full fine-tuning",
               "baseline_value": race["full"]["accuracy"],
               "ratio": race["lora"]["accuracy"] / max(race["full"]["accuracy"], 1e-9),
               "target": "LoRA - full: a paired 95 % interval that reaches 0", "pass": d["ci95_high"] >= 0,
               "lora_lr": best, "start": race["start"], "lora_minus_full": d["delta"],
               "ci95": [d["ci95_low"], d["ci95_high"]]}
    write_result(summary, {"summary": summary, "machine": machine(), "sweep": sweep, "race": race,
                           "seconds": time.perf_counter() - t0},
                 smoke=a.smoke, name="lora_learning_quick" if a.quick else "lora_learning")


if __name__ == "__main__":
    main()

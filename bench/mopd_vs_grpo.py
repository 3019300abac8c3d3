"""MOPD against GRPO from the same regressed checkpoint (the paper's Figure 3(c), in miniature), and the
cascade with and without its MOPD stage.

    .venv/bin/python bench/mopd_vs_grpo.py [--quick] [--seeds 0,1,2] [--steps 30] [--eval-every 5]

For each seed S (trainer.seed = data.seed = S; the held-out questions are the same for all):

1. the demo cascade (configs/cascade/demo.yaml: SFT'd tiny model -> IF-RL -> multi-domain RL -> MOPD) in
   ``bench/results/mopd_vs_grpo/seed{S}/cascade``; ``--cascade DIR`` reuses a finished one (e.g.
   ``make run``'s runs/demo) for the first seed;
2. the start: the IF-RL stage's final checkpoint (instruction-following RL costs math accuracy: in the
   demo cascade 0.53 -> 0.33); the teacher: the recorded checkpoint with the best math accuracy before
   the MOPD stage (SFT or an RL stage's; whether the start is below it is recorded per seed);
3. from that start, ``--steps`` steps of GRPO on math (the RL stages' settings) and ``--steps`` steps of
   MOPD on math with that teacher (the cascade's MOPD settings), math held-out accuracy evaluated every
   ``--eval-every`` steps (orchestrator, avg@4 on the cascade's 64 held-out questions at T=1);
   steps-to-teacher = the first evaluated step whose accuracy reaches the teacher's recorded accuracy.
4. the ablation the paper does not report: final per-domain accuracy of the cascade with its MOPD stage
   against without it (the multi-domain stage's final checkpoint, where the cascade would end).

Writes bench/results/mopd_vs_grpo.json; the last stdout line is the summary JSON object.
``--quick`` (``make bench``): one seed (``make run``'s cascade when runs/demo has one), 10 steps, evaluation
every 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _common import builtin_data, machine  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


def run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[3:6])} failed (rc {rc}); see {log}")


def cascade(seed: int, out: Path, model: str) -> dict:
    """The demo cascade with this seed (resumes or skips what an earlier run of this bench finished)."""
    cfg = yaml.safe_load((ROOT / "configs" / "cascade" / "demo.yaml").read_text())
    cfg.update(run_dir=str(out), model=model, report=True)
    cfg["overrides"] = [*cfg.get("overrides", []), f"trainer.seed={seed}", f"data.seed={seed}",
                        "supervisor.progress=none"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cascade.yaml").write_text(yaml.safe_dump(cfg))
    run([*CLI, "cascade", str(out / "bench_cascade.yaml")], out / "cascade.log")
    return json.loads((out / "cascade.json").read_text())


def checkpoints(record: dict, before: str = "mopd") -> list[dict]:
    """The starting model's and every stage's evaluated checkpoints, up to (not including) stage ``before``."""
    names = record["order"][: record["order"].index(before)] if before in record["order"] else record["order"]
    return [record["initial"]] + [c for n in names for c in record["stages"][n].get("checkpoints", [])]


def curve(method: str, seed: int, start: str, teacher: str, out: Path, steps: int, every: int, cfg: dict) -> list:
    """Math held-out accuracy [(step, accuracy)] of ``steps`` steps of ``method`` from ``start``."""
    files = builtin_data()
    args = ["launch", "cascade", f"model.path={start}", f"run_dir={out}", f"data.files=[{files['rl']['arithmetic']}]",
            f"data.eval_files=[{files['heldout']['arithmetic']}]",
            f"trainer.steps={steps}", "trainer.save_every=0", f"orchestrator.eval_every={every}",
            f"orchestrator.eval_n={cfg['eval']['n']}", f"trainer.seed={seed}", f"data.seed={seed}",
            "supervisor.progress=none"]
    if method == "mopd":
        mopd = next(s for s in cfg["stages"] if s.get("stage") == "mopd")
        args += ["stage=mopd", f"+teacher.checkpoints.math={teacher}",
                 *[o for o in mopd.get("overrides", []) if not o.startswith(("data.files", "trainer.steps"))]]
    run([*CLI, *args], out / "launch.log")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["heldout_accuracy"]) for m in metrics if "heldout_accuracy" in m]


def steps_to(level: float, points: list) -> int | None:
    return next((step for step, acc in points if acc >= level), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--model", default="models/tiny-sft", help="the SFT'd starting model of the cascade")
    p.add_argument("--cascade", default="", help="a finished demo cascade to reuse for the first seed")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")][: 1 if a.quick else None]
    if a.quick and not a.cascade and (ROOT / "runs" / "demo" / "cascade.json").is_file():
        a.cascade = str(ROOT / "runs" / "demo")  # make run's cascade: the quick run only adds the comparison
    steps, every = (10, 5) if a.quick else (a.steps, a.eval_every)
    if not (ROOT / a.model / "config.json").is_file():
        raise SystemExit(f"{a.model} missing: make run builds it (make-tiny-model --task cascade, then sft)")
    cfg = yaml.safe_load((ROOT / "configs" / "cascade" / "demo.yaml").read_text())
    base = RESULTS / "mopd_vs_grpo"
    t0 = time.perf_counter()
    per_seed = []
    for i, seed in enumerate(seeds):
        out = base / f"seed{seed}"
        reuse = Path(a.cascade) if a.cascade and i == 0 and (Path(a.cascade) / "cascade.json").is_file() else None
        record = json.loads((reuse / "cascade.json").read_text()) if reuse else cascade(
            seed, out / "cascade", str((ROOT / a.model).resolve()))
        start = record["stages"]["if_rl"]["checkpoints"][-1]
        teacher = max(checkpoints(record), key=lambda c: c["domains"]["math"])
        row = {"seed": seed, "cascade": str(reuse or out / "cascade"), "start": start["path"],
               "start_math": start["domains"]["math"], "teacher": teacher["path"],
               "teacher_math": teacher["domains"]["math"], "regressed": start["domains"]["math"] < teacher["domains"]["math"]}
        for method in ("grpo", "mopd"):
            points = curve(method, seed, start["path"], teacher["path"], out / method, steps, every, cfg)
            row[method] = {"curve": points, "steps_to_teacher": steps_to(teacher["domains"]["math"], points),
                           "final_math": points[-1][1]}
        mopd_final = record["stages"]["mopd"]["checkpoints"][-1]
        without = record["stages"]["multi_domain"]["checkpoints"][-1]
        row["ablation"] = {"without_mopd": without["domains"], "with_mopd": mopd_final["domains"]}
        per_seed.append(row)
        print(json.dumps({k: row[k] for k in ("seed", "start_math", "teacher_math")}
                         | {m: {"steps_to_teacher": row[m]["steps_to_teacher"], "final_math": row[m]["final_math"]}
                            for m in ("grpo", "mopd")}), flush=True)

    def spread(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values}

    domains = sorted(per_seed[0]["ablation"]["with_mopd"])
    summary = {
        "name": "mopd_vs_grpo",
        "metric": f"math held-out accuracy within {steps} steps from a regressed checkpoint (avg@4)",
        # the table's columns (bench/run_all.py): MOPD's final math accuracy against GRPO's, no target
        "value": spread([r["mopd"]["final_math"] for r in per_seed])["mean"],
        "baseline": "GRPO from the same checkpoint",
        "baseline_value": spread([r["grpo"]["final_math"] for r in per_seed])["mean"],
        "ratio": None, "target": None, "pass": None,
        "seeds": seeds,
        "steps": steps,
        "eval_every": every,
        "grpo_final_math": spread([r["grpo"]["final_math"] for r in per_seed]),
        "mopd_final_math": spread([r["mopd"]["final_math"] for r in per_seed]),
        "grpo_steps_to_teacher": [r["grpo"]["steps_to_teacher"] for r in per_seed],
        "mopd_steps_to_teacher": [r["mopd"]["steps_to_teacher"] for r in per_seed],
        "teacher_math": spread([r["teacher_math"] for r in per_seed]),
        "start_math": spread([r["start_math"] for r in per_seed]),
        "ablation": {d: {"without_mopd": spread([r["ablation"]["without_mopd"][d] for r in per_seed]),
                         "with_mopd": spread([r["ablation"]["with_mopd"][d] for r in per_seed])} for d in domains},
        "wall_s": time.perf_counter() - t0,
        "machine": machine(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mopd_vs_grpo.json").write_text(json.dumps({**summary, "per_seed": per_seed}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

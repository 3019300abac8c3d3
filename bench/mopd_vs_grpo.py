"""MOPD against GRPO, fairly (the paper's Figure 3(c) in miniature), and MOPD against RLHF on the judge-scored
domain (its Table 3 in miniature).

    .venv/bin/python bench/mopd_vs_grpo.py [--quick] [--seeds 0,1,2] [--steps 30] [--eval-every 5]

Math from `make run`'s SFT'd tiny model (models/tiny-sft) and data (runs/data/demo), chat from `make full`'s
(below), with the judge (models/judge-sft) served by the supervisor; every run is a real `cascade-rl launch`, its
held-out accuracy measured by the stage's own evaluation (avg@4 at T = 1 on 128 questions) every ``--eval-every`` steps.

**Math (Figure 3(c)).** The paper's math teacher is the SFT checkpoint, the student a later one whose math has
regressed. The start is the SFT model after ``--regress-steps`` of IF-RL (the demo cascade's first stage, which
costs math here as the paper's RLVR stages do); the teacher is the SFT model, which must be at least 0.15 above the
start on math (checked and recorded). Start and teacher are made once (seed 0); the seeds vary the races. From the
start, for each seed, ``--steps`` steps of GRPO on math (the cascade's RL settings) and of MOPD on math taught by the
SFT model (the cascade's MOPD settings), with **the same rollouts per step** (16 prompts x 8). Recorded: the
curve, and the steps each takes to close 90 % of the gap to the teacher (start + 0.9 x (teacher - start); the first
evaluation at or above it).

**The judge-scored domain (Table 3).** From `make full`'s SFT'd model (models/full-sft, data runs/data/full: its
SFT has chat enough to reply well about 40 % of the time; make run's 800-step model replies well 4 % of the time,
and RLHF from it finds too little to reinforce). The teacher is an RLHF checkpoint: ``--teacher-steps`` of GRPO on
chat with the judge's pairwise rewards from that model (made once, seed 0). For each seed, from the SFT model,
``--steps`` of RLHF (the same recipe) and of MOPD on chat taught by that checkpoint, the same rollouts per step
(16 prompts x 4); accuracy is the judge's preference for the reply over the row's baseline (genrm, ArenaHard-style)
and the gold (chat_quality: right, addressed, one short sentence).

Writes bench/results/mopd_vs_grpo.json; the last stdout line is the summary JSON object. ``--quick`` (``make bench``):
the math race only (the chat race needs `make full`'s model), one seed, 10 steps, evaluation every 5, its runs and
JSON under the name mopd_vs_grpo_quick. ``--smoke``: the math race's GRPO launch alone, one step at 2 prompts x 2
and 8 tokens, ``--inline`` (every role a thread of one process), on a random tiny model and a few rows of data (no
judge needed): no IF-RL launch (the start is the model itself, its accuracy the launch's first evaluation) and no
MOPD launch (its row is the GRPO run's): the script's code path in seconds. Not MOPD: inline, its teacher and the
trainer load their models at once in two threads, which transformers' global patches of from_pretrained do not
survive; as processes its launch costs ~45 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import (  # noqa: E402  (bench/ is on sys.path when a script runs)
    CLI,
    ROOT,
    bench_parser,
    builtin_data,
    full_sft_model,
    machine,
    results_dir,
    sft_model,
    write_result,
)

JUDGE = ROOT / "models" / "judge-sft"
RL = ["run.prompts_per_step=16", "run.group_size=8", "trainer.lr=5e-5"]  # configs/run/cascade.yaml
MOPD = ["stage=mopd", "run.prompts_per_step=16", "run.group_size=8", "trainer.lr=3e-5",
        "trainer.warmup_steps=5", "trainer.warmup_start_lr=3e-6"]  # configs/cascade/demo.yaml's MOPD
# chat with the judge: demo.yaml's RLHF (4 rollouts a prompt: 6 pairs to judge, not 28), and MOPD on the same rollouts
RLHF = ["stage=rlhf", "run.prompts_per_step=16", "run.group_size=4", "trainer.lr=2e-5"]
CHAT_MOPD = [*MOPD, "run.group_size=4"]
JUDGED = ["verifier.judge.serve=torch", f"verifier.judge.path={JUDGE}", "verifier.judge.genrm.template=compact",
          "verifier.judge.max_tokens=16", "verifier.judge.concurrency=32", "verifier.judge.args=[--threads,1]",
          "teacher.threads=1"]  # as configs/cascade/demo.yaml
GAP = 0.15  # the least the teacher must lead the start by on the domain (issue: a teacher clearly above)
# --smoke: after every launch's own overrides, so these win; a random model's rewards are all 0, so IF-RL's
# dynamic filtering would drop every group
SMOKE = ["run.prompts_per_step=2", "run.group_size=2", "sampling.max_tokens=8", "orchestrator.eval_n=1",
         "data.eval_per_domain=4", "orchestrator.dynamic_filtering=false"]


def launch(out: Path, args: list[str], smoke: bool = False) -> list[dict]:
    """One real launch (resumed past if its summary exists; ``smoke``: smaller, inline); its metrics lines."""
    if not (out / "summary.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "launch.log", "w") as log:
            rc = subprocess.run([*CLI, "launch", "cascade", *(["--inline"] if smoke else []), f"run_dir={out}",
                                 "supervisor.progress=none", *args,
                                 *(SMOKE if smoke else [])],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if rc != 0:
            raise SystemExit(f"launch in {out} failed (rc {rc}); see {out / 'launch.log'}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def final_checkpoint(out: Path) -> str:
    return str(sorted((out / "checkpoints").glob("step_*"))[-1])


def curve(metrics: list[dict], domain: str) -> list[tuple[int, float]]:
    """(step, held-out accuracy of ``domain``) of every evaluation of a launch."""
    key = f"heldout_accuracy/{domain}"
    return [(m["step"], m[key]) for m in metrics if key in m]


def closes(points: list[tuple[int, float]], start: float, teacher: float) -> int | None:
    """The first evaluated step at or above start + 0.9 (teacher - start); None if none within the run."""
    level = start + 0.9 * (teacher - start)
    return next((step for step, acc in points if acc >= level), None)


def evaluated(files: dict, tasks: list[str], every: int) -> list[str]:
    return [f"data.eval_files=[{','.join(files['heldout'][t] for t in tasks)}]", "data.eval_per_domain=128",
            f"orchestrator.eval_every={every}", "orchestrator.eval_n=4", "orchestrator.eval_greedy=false"]


def seeded(seed: int) -> list[str]:
    return [f"run.seed={seed}", f"data.seed={seed}"]


def regressed_start(out: Path, sft: str, files: dict, a: argparse.Namespace) -> tuple[str, float, float]:
    """The math race's start (the SFT model after IF-RL), with the SFT teacher's and the start's math accuracy."""
    regress = launch(out, [f"model.path={sft}", f"data.files=[{files['rl']['arithmetic_if']}]", "stage=if_rl", *RL,
                           f"run.steps={a.regress_steps}", "trainer.save_every=0",
                           "orchestrator.max_refill_rounds=64", *evaluated(files, ["arithmetic"], a.regress_steps),
                           *seeded(0)], a.smoke)
    (_, teacher_math), (_, start_math) = curve(regress, "math")[0], curve(regress, "math")[-1]
    return final_checkpoint(out), teacher_math, start_math


def rlhf_teacher(out: Path, sft: str, files: dict, a: argparse.Namespace) -> dict:
    """The judge-scored domain's teacher: ``--teacher-steps`` of RLHF from the SFT model; its genrm before and after."""
    run = launch(out, [f"model.path={sft}", f"data.files=[{files['rl']['chat']}]", *JUDGED, *RLHF,
                       f"run.steps={a.teacher_steps}", "trainer.save_every=0",
                       *evaluated(files, ["chat", "chat_gold"], a.teacher_steps), *seeded(0)])
    (_, start_genrm), (_, teacher_genrm) = curve(run, "genrm")[0], curve(run, "genrm")[-1]
    return {"teacher": final_checkpoint(out), "start_genrm": start_genrm, "teacher_genrm": teacher_genrm,
            "teacher_gold": curve(run, "chat_quality")[-1][1], "gap": teacher_genrm - start_genrm}


def math_race(seed: int, out: Path, sft: str, files: dict, a: argparse.Namespace,
              begin: tuple[str, float, float]) -> dict:
    start, teacher_math, start_math = begin
    common = [f"model.path={start}", f"data.files=[{files['rl']['arithmetic']}]", f"run.steps={a.steps}",
              "trainer.save_every=0", *evaluated(files, ["arithmetic"], a.eval_every), *seeded(seed)]
    row = {"seed": seed, "start": start, "teacher": sft}
    methods = {"grpo": RL, "mopd": [*MOPD, f"+teacher.checkpoints.math={sft}"]}
    if a.smoke:
        del methods["mopd"]
    for method, extra in methods.items():
        points = curve(launch(out / method, [*common, *extra], a.smoke), "math")
        if teacher_math is None:  # a smoke run: the start is the teacher, measured by this launch's first evaluation
            teacher_math = start_math = points[0][1]
        row[method] = {"curve": points, "steps_to_90": closes(points, start_math, teacher_math),
                       "final": points[-1][1]}
    row.setdefault("mopd", row["grpo"])  # a smoke run: GRPO alone, in both rows
    return {**row, "start_math": start_math, "teacher_math": teacher_math, "gap": teacher_math - start_math,
            "clearly_above": teacher_math - start_math >= GAP}


def rlhf_race(seed: int, out: Path, sft: str, files: dict, a: argparse.Namespace, teacher: dict) -> dict:
    chat = [f"data.files=[{files['rl']['chat']}]", *JUDGED]
    judged = evaluated(files, ["chat", "chat_gold"], a.eval_every)
    row = {"seed": seed, **teacher}
    start_genrm, teacher_genrm = teacher["start_genrm"], teacher["teacher_genrm"]
    common = [f"model.path={sft}", f"run.steps={a.steps}", "trainer.save_every=0", *judged, *seeded(seed)]
    for method, extra in (("rlhf", [*chat, *RLHF]),
                          ("mopd", [*chat, *CHAT_MOPD, f"+teacher.checkpoints.genrm={teacher['teacher']}"])):
        metrics = launch(out / method, [*common, *extra])
        points = curve(metrics, "genrm")
        row[method] = {"curve": points, "gold": curve(metrics, "chat_quality"), "final": points[-1][1],
                       "steps_to_90": closes(points, start_genrm, teacher_genrm)}
    return row


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def main() -> None:
    p = bench_parser(__doc__, quick="the math race, 1 seed, 10 steps (make bench)",
                     smoke="the math race's GRPO launch alone, 1 step, tiny, inline: seconds")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--regress-steps", type=int, default=40, help="IF-RL steps that cost the start its math")
    p.add_argument("--teacher-steps", type=int, default=60, help="RLHF steps of the judge-scored domain's teacher")
    a = p.parse_args()
    a.quick |= a.smoke  # a smoke run is a quick one (the math race only), smaller
    seeds = [int(s) for s in a.seeds.split(",")][: 1 if a.quick else None]
    if a.quick:
        a.steps, a.eval_every = (1, 1) if a.smoke else (10, 5)
        a.regress_steps = 1 if a.smoke else a.regress_steps
    if not a.smoke and not (JUDGE / "config.json").is_file():
        raise SystemExit(f"{JUDGE} missing: `make judge` builds it (make run does)")
    sft, files = str(sft_model(a.smoke)), builtin_data(a.smoke)
    t0 = time.perf_counter()
    # the runs: kept and resumed past under bench/results, fresh for a smoke run
    root = (Path(tempfile.mkdtemp(prefix="crl-mopd-smoke-")) / "mopd_vs_grpo" if a.smoke else
            results_dir() / ("mopd_vs_grpo_quick" if a.quick else "mopd_vs_grpo"))
    # a smoke run starts from the model itself (its accuracy: the launch's first evaluation)
    begin = (sft, None, None) if a.smoke else regressed_start(root / "shared" / "regress", sft, files, a)
    if not a.quick:
        chat_sft, chat_files = full_sft_model()
        teacher = rlhf_teacher(root / "shared" / "rlhf_teacher_full", str(chat_sft), chat_files, a)
    math_rows, rlhf_rows = [], []
    for seed in seeds:
        out = root / f"seed{seed}"
        math_rows.append(math_race(seed, out / "math", sft, files, a, begin))
        if not a.quick:
            rlhf_rows.append(rlhf_race(seed, out / "rlhf_full", str(chat_sft), chat_files, a, teacher))
        print(json.dumps({"seed": seed, "math": {m: math_rows[-1][m]["steps_to_90"] for m in ("grpo", "mopd")},
                          "rlhf": {m: rlhf_rows[-1][m]["final"] for m in ("rlhf", "mopd")} if rlhf_rows else None}),
              flush=True)

    summary = {
        "name": "mopd_vs_grpo",
        "metric": f"math held-out accuracy after {a.steps} steps from a regressed checkpoint (avg@4), equal rollouts",
        "value": spread([r["mopd"]["final"] for r in math_rows])["mean"],
        "baseline": "GRPO from the same checkpoint, the same rollouts per step",
        "baseline_value": spread([r["grpo"]["final"] for r in math_rows])["mean"],
        "ratio": None, "target": None, "pass": None,
        "seeds": seeds, "steps": a.steps, "eval_every": a.eval_every,
        "math": {"start": math_rows[0]["start_math"], "teacher": math_rows[0]["teacher_math"],
                 "gap": math_rows[0]["gap"], "clearly_above": math_rows[0]["clearly_above"],
                 **{m: {"final": spread([r[m]["final"] for r in math_rows]),
                        "steps_to_90": [r[m]["steps_to_90"] for r in math_rows]} for m in ("grpo", "mopd")}},
        "rlhf": {"start": teacher["start_genrm"], "teacher": teacher["teacher_genrm"],
                 "teacher_gold": teacher["teacher_gold"],
                 **{m: {"final": spread([r[m]["final"] for r in rlhf_rows]),
                        "gold_final": spread([r[m]["gold"][-1][1] for r in rlhf_rows]),
                        "steps_to_90": [r[m]["steps_to_90"] for r in rlhf_rows]} for m in ("rlhf", "mopd")}}
        if rlhf_rows else None,
        "wall_s": time.perf_counter() - t0,
        "machine": machine(),
    }
    write_result(summary, {**summary, "math_per_seed": math_rows, "rlhf_per_seed": rlhf_rows}, smoke=a.smoke,
                 name=root.name)


if __name__ == "__main__":
    main()

"""Streaming a step to the trainer in parts (``orchestrator.stream_tokens``) against the per-step barrier: step time
and the trainer's idle fraction, strictly on-policy both.

    .venv/bin/python bench/streaming.py [--quick | --smoke] [--rounds 2] [--steps 8] [--workloads if_rl,slow_verifier]
                                        [--stream-tokens 2048]

- ``barrier``: ``orchestrator.stream_tokens=0``, the trainer gets the step's groups in one batch once the last is
  scored (the default), each phase on both cores (torch's threads); ``barrier_1t`` the same with the sampler and
  the trainer on one thread each, as the streaming modes run (they overlap: two threads each oversubscribe 2
  cores);
- ``stream``: kept groups go to the trainer as soon as they hold ``--stream-tokens`` tokens; the trainer's
  forward and backward run on them while the rest of the step is sampled and scored, the update after the last;
- ``stream_over``: streaming, and over-dispatch (``orchestrator.over_dispatch=--over-dispatch``) on the workloads
  that filter: replacements sampled ahead from the running keep rate, a complete step's surplus cancelled.

Workloads, each a real ``cascade-rl launch`` on make run's SFT'd tiny model (models/tiny-sft; made if missing):

- ``if_rl``: make run's IF-RL stage (``launch cascade stage=if_rl``, the arithmetic-with-one-instruction prompts,
  16 prompts x 8, 64 tokens, dynamic filtering: groups with uniform rewards are replaced, so a step samples about
  three times what it trains and its refills are where a barrier waits);
- ``slow_verifier``: the arithmetic prompts of make run (8 prompts x 8, 48 tokens) scored by a verifier that
  takes ``--verifier-s`` seconds a rollout (the math verifier behind a sleep, two scoring processes), the sampler
  sending each group as its rows finish (``sampler.stream_groups``): scoring is the step's tail.

The settings run alternately, the order rotating per round; per setting the median over rounds. The trainer's
idle fraction is 1 - summary.json ``trainer_busy_frac`` (its forward, backward, update, publish and checkpoint
time over the window from the first part sent to the last step done). ``--smoke``: one step streamed on a random
tiny model, the slow-verifier workload at 0.01 s, launched ``--inline``, its own baseline: the code path in
seconds.

Writes bench/results/streaming.json; the last stdout line is the summary (stream vs barrier, steps/hour, on the
first workload).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, builtin_data, launch_run, math_data, sft_model, write_result  # noqa: E402

SLOW_VERIFIER = '''"""A math verifier that takes {seconds} s a rollout (bench/streaming.py's slow_verifier workload)."""
import time

from cascade_rl.verifiers.registry import VERIFIERS, register_verifier


@register_verifier("slow_math")
def slow_math(response, reference, metadata):
    time.sleep({seconds})
    return VERIFIERS["math"](response, reference, metadata)
'''


def workloads(work: Path, verifier_s: float, smoke: bool) -> dict[str, list[str]]:
    """Workload -> launch arguments (preset first)."""
    plugin = work / "slow_verifier.py"
    plugin.write_text(SLOW_VERIFIER.format(seconds=verifier_s))
    files = builtin_data(smoke)
    return {
        "if_rl": ["cascade", "stage=if_rl", f"data.files=[{files['rl']['arithmetic_if']}]",
                  "orchestrator.max_refill_rounds=64"],
        "slow_verifier": ["tiny", *math_data(0, smoke), f"verifier.plugins=[{plugin}]",
                          "data.domain_map={math: slow_math}", "run.prompts_per_step=8", "run.group_size=8",
                          "sampling.max_tokens=48", "sampler.stream_groups=true", "verifier.procs=2"],
    }


# overlapping: the sampler and the trainer one thread each (two each oversubscribe 2 cores; as bench/async_vs_sync.py)
OVERLAP = ["sampler.threads=1", "trainer.threads=1"]
MODES = {  # name -> launch overrides ({stream} and {over}: the command line's)
    "barrier": ["orchestrator.stream_tokens=0"],  # one phase at a time: each takes both cores (torch's threads)
    "barrier_1t": ["orchestrator.stream_tokens=0", *OVERLAP],
    "stream": ["orchestrator.stream_tokens={stream}", *OVERLAP],
    "stream_over": ["orchestrator.stream_tokens={stream}", "orchestrator.over_dispatch={over}", *OVERLAP],
}
FILTERING = {"if_rl"}  # the workloads whose stage filters groups: over-dispatch is measured there


def launch(mode: str, workload: list[str], name: str, steps: int, knobs: dict, work: Path, model: Path,
           inline: bool) -> dict:
    run_dir = work / f"{name}-{mode}-{time.monotonic_ns()}"
    preset, *overrides = workload
    args = [preset, *(["--inline"] if inline else []), f"run_dir={run_dir}", f"model.path={model}",
            *overrides, f"run.steps={steps}", "orchestrator.eval_n=0", "orchestrator.eval_greedy=false",
            *(x.format(**knobs) for x in MODES[mode]), "trainer.save_every=0", "supervisor.progress=none"]
    s, metrics = launch_run(args, run_dir, work, f"{name}, {mode}")
    steps_m = [m for m in metrics if "version" in m]
    return {"mode": mode, "workload": name, "steps": steps, "loop_s": s["loop_s"],
            "steps_per_hour": steps / s["loop_s"] * 3600, "trainer_idle_frac": 1 - s["trainer_busy_frac"],
            "parts_mean": statistics.mean(m.get("trainer/parts", 1) for m in steps_m),
            "sampled_per_trained": statistics.mean(m["sampled_per_trained"] for m in steps_m),
            "train_s_mean": statistics.mean(m["trainer/train_s"] for m in steps_m),
            "reward_mean": statistics.mean(m["reward_mean"] for m in steps_m),
            "lost": s["books"]["lost"], "trainer_ids_match": s["books"]["trainer_ids"]["match"]}


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="4 steps, 1 round", smoke="1 streamed step, a random tiny model, inline: seconds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--workloads", default="if_rl,slow_verifier")
    ap.add_argument("--stream-tokens", type=int, default=2048)
    ap.add_argument("--verifier-s", type=float, default=0.05)
    ap.add_argument("--over-dispatch", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.workloads, args.verifier_s = 1, 1, "slow_verifier", 0.01
    rounds, steps = args.rounds or (1 if args.quick else 2), args.steps or (4 if args.quick else 8)
    work = Path(tempfile.mkdtemp(prefix="crl-streaming-"))
    model = sft_model(smoke=args.smoke)
    loads = workloads(work, args.verifier_s, args.smoke)
    settings = [(w, m) for w in args.workloads.split(",") for m in MODES if m != "stream_over" or w in FILTERING]
    if args.smoke:  # one launch, its own baseline
        settings = [("slow_verifier", "stream")]
    knobs = {"stream": args.stream_tokens, "over": args.over_dispatch}
    runs = []
    for r in range(rounds):
        for w, m in settings[r % len(settings):] + settings[: r % len(settings)]:
            runs.append(launch(m, loads[w], w, steps, knobs, work, model, args.smoke))
            x = runs[-1]
            print(f"{w} {m}: {x['steps_per_hour']:.0f} steps/h, trainer idle {x['trainer_idle_frac']:.0%}, "
                  f"{x['parts_mean']:.1f} parts a step, sampled per trained {x['sampled_per_trained']:.2f}",
                  file=sys.stderr)
    table = {}
    for w, m in settings:
        xs = [x for x in runs if x["workload"] == w and x["mode"] == m]
        table[f"{w}_{m}"] = {k: statistics.median(x[k] for x in xs) for k in
                             ("steps_per_hour", "trainer_idle_frac", "parts_mean", "sampled_per_trained",
                              "train_s_mean", "reward_mean")}
    w = settings[0][0]
    stream = table[f"{w}_stream"]
    barrier = table.get(f"{w}_barrier", stream)
    summary = {"name": "streaming", "metric": f"steps/hour, stream_tokens={args.stream_tokens} vs the barrier ({w})",
               "value": round(stream["steps_per_hour"], 1), "baseline": "orchestrator.stream_tokens=0 (a barrier)",
               "baseline_value": round(barrier["steps_per_hour"], 1),
               "ratio": round(stream["steps_per_hour"] / barrier["steps_per_hour"], 3), "target": None, "pass": None,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "trainer_idle_frac": {k: round(v["trainer_idle_frac"], 3) for k, v in table.items()}}
    if f"{w}_stream_over" in table:
        summary["stream_over_ratio"] = round(table[f"{w}_stream_over"]["steps_per_hour"] / barrier["steps_per_hour"], 3)
    assert all(x["lost"] == 0 and x["trainer_ids_match"] for x in runs), "a run lost rollouts"
    return write_result(summary, {**summary, "table": table, "runs": runs, "quick": args.quick}, smoke=args.smoke)


if __name__ == "__main__":
    main()

"""Async vs strictly on-policy, and in-flight weight updates: steps/hour, trainer idle fraction, reward, staleness
and version spans of four schedules.

    .venv/bin/python bench/async_vs_sync.py [--quick | --smoke] [--delays 0,0.5] [--modes sync,ahead,inflight,inflight_keep]
                                            [--workloads short,long]

- ``sync``: max_staleness 0, strictly on-policy (the paper);
- ``ahead``: max_staleness 1, the next batch sampled while the trainer steps, new weights taken between batches;
- ``inflight``: the same, the sampler taking new weights between decode steps (``sampler.inflight_updates``),
  its running rows' K/V recomputed under them;
- ``inflight_keep``: in-flight with the old K/V kept (``sampler.inflight_kv=keep``).

Each setting is one real `cascade-rl launch` on the same task, hardware and seed; the settings run alternately,
the order rotating per round. Two workloads:

- ``short``: the tiny demo model (SFT'd if models/tiny-sft exists), 8 prompts x 8, 32 tokens: generation is
  shorter than a training step. ``--delays`` adds an artificial sampler delay after each generate call
  (``sampler.delay_s``): with a slow sampler the overlap of sampling and training is what async buys; on 2
  shared CPU cores the sampler and the trainer also compete for the same cores, which caps the gain.
- ``long``: the random-weight tiny model (``_common.random_model``), 2 prompts x 2, up to 400 tokens: rows run
  long and unevenly, generation outlasts a training step, so new weights arrive mid-generation (in-flight
  updates happen only here). No delay.

``--smoke``: ahead alone on a ``smoke`` workload (a random tiny model, 2 prompts x 2, 8 tokens, a few rows of
data), 1 step, no delay, launched ``--inline`` (every role a thread of one process: about a third of the CPU of a
launch's process tree): the launch and every figure as above in seconds, its own baseline (ratio 1).

The orchestrator samples one batch ahead when max_staleness >= 1 (rollouts are at most one version old
when trained; k = 2 measured the same as k = 1 before, so it is not run).

Writes bench/results/async_vs_sync.json; the last stdout line is the summary (ahead vs sync, steps/hour,
at the largest delay).
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
from _common import bench_parser, launch_run, math_data, random_model, sft_model, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent


def model_dir() -> str:
    for p in (ROOT.parent / "models" / "tiny-sft", ROOT.parent / "models" / "tiny"):
        if (p / "config.json").exists():
            return str(p)
    from cascade_rl.learner.tiny_model import make_tiny_model

    return str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))


# async: sampler and trainer run at once, one thread each (two each oversubscribe 2 cores; as bench/vs_trl.py)
ASYNC = ["orchestrator.max_staleness=1", "sampler.threads=1", "trainer.threads=1"]
MODES = {  # name -> launch overrides
    "sync": ["orchestrator.max_staleness=0"],
    "ahead": ASYNC,
    "inflight": [*ASYNC, "sampler.inflight_updates=true"],
    "inflight_keep": [*ASYNC, "sampler.inflight_updates=true", "sampler.inflight_kv=keep"],
}


WORKLOADS = {  # name -> (model, launch overrides)
    "short": (model_dir, ["run.prompts_per_step=8", "run.group_size=8", "sampling.max_tokens=32"]),
    "long": (lambda: str(random_model("tiny")[0]),
             ["run.prompts_per_step=2", "run.group_size=2", "sampling.max_tokens=400"]),
    "smoke": (lambda: str(sft_model(smoke=True)), ["run.prompts_per_step=2", "run.group_size=2", "sampling.max_tokens=8"]),
}


def launch(mode: str, workload: str, delay: float, steps: int, work: Path, inline: bool = False) -> dict:
    run_dir = work / f"{workload}-{mode}-d{delay}-{time.monotonic_ns()}"
    model, overrides = WORKLOADS[workload]
    args = ["tiny", *(["--inline"] if inline else []), f"run_dir={run_dir}", f"model.path={model()}",
            f"run.steps={steps}", *MODES[mode], "trainer.correction=icepop", *overrides, "trainer.lr=2e-5",
            *math_data(8, smoke=workload == "smoke"),
            f"sampler.delay_s={delay}", "supervisor.progress=none"]
    s, metrics = launch_run(args, run_dir, work, f"{workload}, {mode}, delay={delay}", timeout=1800)
    rewards = [m["reward_mean"] for m in metrics if "version" in m]
    minutes = s["loop_s"] / 60
    sampler = next((w.get("counters", {}) for w in s.get("workers", []) if w.get("role") == "sampler"), {})
    return {"mode": mode, "workload": workload, "delay_s": delay, "steps": steps, "loop_s": s["loop_s"],
            "steps_per_hour": steps / s["loop_s"] * 3600,
            "version_spanning_frac": s["version_span"]["spanning"] / max(1, s["version_span"]["trained"]),
            "inflight_loads": sampler.get("inflight_loads", 0),
            "recomputed_tokens": sampler.get("inflight_recomputed_tokens", 0),
            "trainer_busy_frac": s["trainer_busy_frac"], "trainer_idle_frac": 1 - s["trainer_busy_frac"],
            "reward_mean": statistics.mean(rewards), "reward_per_minute": sum(rewards) / minutes,
            "staleness_mean": statistics.mean(m["staleness_mean"] for m in metrics if "version" in m),
            "lost": s["books"]["lost"]}


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="6 steps, 1 round",
                      smoke="ahead alone, 1 step, the smoke workload, inline: seconds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--delays", default="0,0.5")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.delays, args.modes, args.workloads = 1, 1, "0", "ahead", "smoke"
    rounds, steps = args.rounds or (1 if args.quick else 2), args.steps or (6 if args.quick else 16)
    delays = [float(x) for x in args.delays.split(",")]
    modes, workloads = args.modes.split(","), args.workloads.split(",")
    work = Path(tempfile.mkdtemp(prefix="crl-async-"))
    settings = [(m, w, d) for w in workloads for d in (delays if w == "short" else [0.0]) for m in modes]
    runs = []
    for r in range(rounds):
        for m, w, d in settings[r % len(settings):] + settings[: r % len(settings)]:
            runs.append(launch(m, w, d, steps, work, inline=args.smoke))
            x = runs[-1]
            print(f"{w} {m} delay={d}: {x['steps_per_hour']:.0f} steps/h, trainer idle {x['trainer_idle_frac']:.0%}, "
                  f"reward {x['reward_mean']:.3f}, staleness {x['staleness_mean']:.2f}, rollouts spanning two "
                  f"versions {x['version_spanning_frac']:.0%}, in-flight loads {x['inflight_loads']}",
                  file=sys.stderr)

    table = {}
    for m, w, d in settings:
        xs = [x for x in runs if x["mode"] == m and x["workload"] == w and x["delay_s"] == d]
        table[f"{w}_{m}_d{d}"] = {key: statistics.median(x[key] for x in xs) for key in
                              ("steps_per_hour", "trainer_idle_frac", "reward_mean", "reward_per_minute",
                               "staleness_mean", "version_spanning_frac", "inflight_loads", "recomputed_tokens")}
    w = workloads[0]
    d = max(delays) if w == "short" else 0.0
    async1 = table[f"{w}_ahead_d{d}"]
    sync = table.get(f"{w}_sync_d{d}", async1)  # a smoke run: ahead alone, its own baseline
    summary = {"name": "async_vs_sync", "metric": f"steps/hour, max_staleness 1 vs 0 ({w} workload, sampler delay {d} s)",
               "value": round(async1["steps_per_hour"], 1), "baseline": "max_staleness 0 (strictly on-policy)",
               "baseline_value": round(sync["steps_per_hour"], 1),
               "ratio": round(async1["steps_per_hour"] / sync["steps_per_hour"], 3), "target": None, "pass": None,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "trainer_idle_frac_async": round(async1["trainer_idle_frac"], 3)}
    if "long" in workloads and {"ahead", "inflight"} <= set(modes):
        summary["inflight_vs_ahead_long"] = round(table["long_inflight_d0.0"]["steps_per_hour"]
                                                  / table["long_ahead_d0.0"]["steps_per_hour"], 3)
    return write_result(summary, {**summary, "table": table, "runs": runs, "quick": args.quick}, smoke=args.smoke)


if __name__ == "__main__":
    main()

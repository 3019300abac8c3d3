"""Chaos: a launch over every role under random SIGKILLs, then its books checked from the files.

    python bench/chaos.py --minutes 60 --every 30     # the hour recorded in BENCHMARKS.md
    python bench/chaos.py --quick                     # 5 minutes, a kill every 15 s
    python bench/chaos.py --smoke                     # 2 minutes, a kill every 8 s (tests/test_chaos.py)

One MOPD launch of the tiny preset with a process of every role: sampler, verifier, teacher (MOPD), environment
(tool rows among the prompts), trainer and orchestrator. In three parts:

1. **Undisturbed** (the baseline): the same launch for ``--baseline-steps`` steps; its steps per minute.
2. **Chaos**: the launch with more steps than it can finish; every ``--every`` seconds one running process of a
   role of ``--roles`` gets SIGKILL (its pid from ``ctl status``; the roles in a random order, each once a round). After ``--minutes`` the kills stop and
   ``ctl stop`` ends it. The supervisor restarts what dies (supervisor/recovery.py): a worker by itself, a trainer
   or orchestrator by rewinding the data plane to the newest checkpoint.
3. **Closing**: ``resume=true`` from the newest checkpoint for ``--close-steps`` more steps, undisturbed: its
   orchestrator settles what the stopped one had in flight, and the run ends with its summary.

Then the books, from the files alone (orchestrator/books.py ``audit``): every dispatched id one terminal fate, the
trainer's ids the ledger's trained ids, every step once in the final weights' history. The figures: kills by role,
restarts, rewinds, steps lost to rewinds (trained, then rolled back), and the overhead: the steps per minute the
chaos run kept against the undisturbed one's, each from its first trained step (startup and the first evaluation
aside). Exits 1 when the books do not close.
"""

from __future__ import annotations

import bisect
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CLI, bench_parser, machine, random_model, results_dir, write_result  # noqa: E402

ROLES = ("sampler", "verifier", "teacher", "environment", "trainer", "orchestrator")
ROLLOUTS_PER_STEP = 8 * 4  # the tiny preset: 8 prompts x 4 responses
SAVE_EVERY = 5  # a checkpoint every 5 steps: a rewind redoes at most 4


def data_files(out: Path) -> tuple[list[str], list[str]]:
    """Arithmetic (math) and tool-use rows (an environment's) as data files; their held-out questions."""
    from cascade_rl.data.builtin import write_task_files

    math = write_task_files("cascade", out / "cascade", {"heldout": 8, "rl": 300, "sft": 0})
    tools = write_task_files("tools", out / "tools", {"heldout": 8, "rl": 300, "sft": 0})
    return [math["rl"]["arithmetic"], tools["rl"]["tool_arithmetic"]], [math["heldout"]["arithmetic"]]


def overrides(model: Path, files: list[str], heldout: list[str], run_dir: Path) -> list[str]:
    return [f"run_dir={run_dir}", f"model.path={model}", f"data.files=[{','.join(files)}]",
            f"data.eval_files=[{','.join(heldout)}]", "stage=mopd", f"+teacher.checkpoints.math={model}",
            f"+teacher.checkpoints.tool_use={model}", f"trainer.save_every={SAVE_EVERY}", "trainer.keep_checkpoints=2",
            "orchestrator.eval_n=1", "supervisor.progress=plain", "supervisor.restart_backoff_s=0.5",
            # the budget scaled to this rate of faults (each role is killed every 6 x --every seconds, far above a
            # week's): a crash loop is 4 deaths of one process within a minute
            "supervisor.max_restarts=3", "supervisor.restart_window_s=60"]


class Launch:
    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.env, self.log = env, open(log, "w")
        self.run_dir = Path(next(a for a in args if a.startswith("run_dir=")).split("=", 1)[1])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*CLI, "launch", "tiny", *args], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def table(self) -> list[dict]:
        r = subprocess.run([*CLI, "ctl", "--run-dir", str(self.run_dir), "status", "--json"], env=self.env,
                           capture_output=True, text=True, timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else []

    def ctl(self, *args: str) -> None:
        subprocess.run([*CLI, "ctl", "--run-dir", str(self.run_dir), *args], env=self.env, capture_output=True,
                       timeout=60)

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout_s)
        self.log.close()
        return rc


def first_trained(run_dir: Path) -> float:
    """When the run's first rollout was settled ``trained`` (Unix time, from the ledger)."""
    from cascade_rl.protocol import records

    return next(r["t"] for r in records.read(run_dir / "ledger.jsonl") if r.get("fate") == "trained")


def steps_trained(run_dir: Path) -> int:
    """Steps in the weights' history so far (trained_ids.jsonl: a rewind removes the lines after its checkpoint)."""
    path = run_dir / "trained_ids.jsonl"
    return sum(1 for _ in open(path)) if path.is_file() else 0


def undisturbed(model: Path, files, heldout, work: Path, env: dict, steps: int) -> dict:
    run_dir = work / "undisturbed"
    launch = Launch([*overrides(model, files, heldout, run_dir), f"run.steps={steps}"], env, work / "undisturbed.log")
    rc = launch.wait(3600)
    wall = time.monotonic() - launch.t0
    if rc:
        raise SystemExit(f"the undisturbed launch failed: see {work / 'undisturbed.log'}")
    from cascade_rl.protocol import records

    last = max(r["t"] for r in records.read(run_dir / "ledger.jsonl") if r.get("fate") == "trained")
    training_s = last - first_trained(run_dir)
    return {"steps": steps, "wall_s": round(wall, 1), "training_s": round(training_s, 1),
            "steps_per_min": round((steps - 1) / training_s * 60, 2)}


def chaos(model: Path, files, heldout, work: Path, env: dict, minutes: float, every: float, roles: list[str],
          seed: int) -> tuple[Launch, dict]:
    """The chaos launch: a kill every ``every`` s for ``minutes``, then ``ctl stop``."""
    rng, order = random.Random(seed), []
    launch = Launch([*overrides(model, files, heldout, work / "run"), "run.steps=1000000"], env, work / "chaos.log")
    kills, misses, t_end = Counter(), 0, launch.t0 + minutes * 60
    next_kill = launch.t0 + every
    while time.monotonic() < t_end:
        if launch.proc.poll() is not None:
            raise SystemExit(f"the chaos launch ended by itself (rc {launch.proc.returncode}): see {work / 'chaos.log'}")
        time.sleep(max(0.0, min(next_kill, t_end) - time.monotonic()))
        if time.monotonic() >= t_end:
            break
        next_kill += every
        if not order:  # the roles in a random order, each once a round: every role is killed as often
            order = rng.sample(roles, len(roles))
        role = order.pop()
        running = [w for w in launch.table() if w["role"] == role and w.get("pid") and w["state"] not in (
            "starting", "rewinding", "hung") and not w["state"].startswith(("exited", "retired", "lost"))]
        if not running:  # that role is restarting right now: its kill waits for the next tick
            misses += 1
            order.append(role)
            continue
        victim = rng.choice(running)
        try:
            os.killpg(victim["pid"], signal.SIGKILL)  # the process and its children (a verifier's pool, torchrun's)
            kills[role] += 1
        except ProcessLookupError:
            misses += 1
    wall, training_s = time.monotonic() - launch.t0, time.time() - first_trained(launch.run_dir)
    table = {w["id"]: w for w in launch.table()}
    kept = steps_trained(launch.run_dir)
    launch.ctl("stop")
    launch.wait(120)
    text = (work / "chaos.log").read_text()
    return launch, {
        "minutes": minutes, "every_s": every, "wall_s": round(wall, 1), "kills": dict(kills),
        "kills_total": sum(kills.values()), "kills_missed": misses,
        "restarts": {w: r["restarts"] for w, r in table.items() if r["restarts"]},
        "rewinds": text.count("start again from"),
        "training_s": round(training_s, 1), "steps_kept": kept, "steps_per_min": round(kept / training_s * 60, 2),
    }


def close(model: Path, files, heldout, work: Path, env: dict, more: int) -> int:
    """resume=true for ``more`` steps after the newest checkpoint: the books of the whole run close."""
    from cascade_rl.learner import checkpoint_dirs

    latest = checkpoint_dirs.latest(work / "run" / "checkpoints")
    start = int(latest.name.removeprefix("step_")) if latest else 0
    steps = start + more
    launch = Launch([*overrides(model, files, heldout, work / "run"), f"run.steps={steps}", "resume=true"], env,
                    work / "close.log")
    if launch.wait(1800):
        raise SystemExit(f"the closing launch failed: see {work / 'close.log'}")
    return steps


def lost_steps(run_dir: Path) -> float:
    """Steps trained and then rolled back by a rewind: rollouts whose fates are trained then rolled_back."""
    from cascade_rl.protocol import records

    fates: dict[str, list[str]] = {}
    for r in records.read(run_dir / "ledger.jsonl"):
        if r.get("fate") in ("trained", "rolled_back"):
            fates.setdefault(r["id"], []).append(r["fate"])
    return sum(f == ["trained", "rolled_back"] for f in fates.values()) / ROLLOUTS_PER_STEP


def rewind_downtimes(run_dir: Path) -> list[float]:
    """Per death of the trainer or the orchestrator: seconds from it (the supervisor's line in the dead one's log)
    to the first rollout settled ``trained`` by the orchestrator started after it (its ``resuming at step`` line):
    what one rewind stops training for."""
    from cascade_rl.protocol import records

    def when(line: str) -> float:
        return datetime.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp() + (
            float("0." + line[20:23]) if line[19:20] == "," else 0.0)

    deaths, starts = [], []
    for worker in ("trainer-0", "orchestrator"):
        for line in open(run_dir / "logs" / f"{worker}.log", errors="replace"):
            if f" supervisor: {worker} " in line:
                deaths.append(when(line))
            elif worker == "orchestrator" and "resuming at step" in line:
                starts.append(when(line))
    trained = sorted(r["t"] for r in records.read(run_dir / "ledger.jsonl") if r.get("fate") == "trained")
    starts.sort()
    out = []
    for t in sorted(deaths):
        s = bisect.bisect_right(starts, t)
        i = bisect.bisect_right(trained, starts[s]) if s < len(starts) else len(trained)
        if i < len(trained):
            out.append(round(trained[i] - t, 1))
    return out


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2] if xs else None, "max": xs[-1] if xs else None,
            "sum": round(sum(xs), 1)}


def main() -> None:
    ap = bench_parser(__doc__, "5 minutes, a kill every 15 s", "2 minutes, a kill every 8 s")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    ap.add_argument("--roles", default=",".join(ROLES), help="the roles whose processes are killed")
    ap.add_argument("--baseline-steps", type=int, default=200)
    ap.add_argument("--close-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="where the runs go (default: a folder under the results)")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.every, args.baseline_steps = 2.0, 8.0, 20
    elif args.quick:
        args.minutes, args.every, args.baseline_steps = 5.0, 15.0, 60
    roles = [r for r in args.roles.split(",") if r]
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise SystemExit(f"--roles: {sorted(unknown)} are not roles; choose among {', '.join(ROLES)}")
    work = Path(args.work) if args.work else results_dir(args.smoke) / "chaos-runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XDG_STATE_HOME=str(work / "state"))
    model, _ = random_model("tiny", work / "models")
    files, heldout = data_files(work / "data")

    base = undisturbed(model, files, heldout, work, env, args.baseline_steps)
    launch, run = chaos(model, files, heldout, work, env, args.minutes, args.every, roles, args.seed)
    steps = close(model, files, heldout, work, env, args.close_steps)

    from cascade_rl.orchestrator.books import audit

    books = audit(work / "run", steps)
    summary_json = json.loads((work / "run" / "summary.json").read_text())
    overhead = 1 - run["steps_per_min"] / base["steps_per_min"]
    record = {
        "machine": machine(), "undisturbed": base, "chaos": run, "closing_steps": args.close_steps,
        "steps": steps, "steps_lost_to_rewinds": lost_steps(work / "run"), "books": books,
        "rewind_downtime_s": _spread(rewind_downtimes(work / "run")),
        "summary_books": summary_json["books"], "work": str(work),
        "summary": {
            "name": "chaos", "metric": "steps/min kept under chaos vs undisturbed", "value": run["steps_per_min"],
            "baseline": "undisturbed launch", "baseline_value": base["steps_per_min"],
            "ratio": round(run["steps_per_min"] / base["steps_per_min"], 3), "target": "books close",
            "pass": books["ok"], "overhead": round(overhead, 3)},
    }
    write_result(record["summary"], record, smoke=args.smoke)
    if not books["ok"]:
        print(f"chaos: the books do not close: {books['problems']}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()

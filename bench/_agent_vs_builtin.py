"""`make agent`: the tool task of `make tools` trained twice from the same SFT model, prompts and seed: through the
built-in ``python`` environment, and with the agent written as a plain ``openai`` client loop
(examples/agents/python_tool_agent.py) through the run's gateway. Both are evaluated the same way (the held-out
questions with the tool, through the built-in path, and without it), so the two gains compare the policies trained.

    .venv/bin/python bench/_agent_vs_builtin.py --data runs/data/tools --model models/tools-sft [--steps 100]

Writes OUT/report.md and OUT/agent_vs_builtin.json (OUT: --out, default runs/agent): each run's held-out gain with the
tool and without, their difference with a paired 95 % interval over the held-out questions, the agent run's segments
per trajectory (a new segment is a re-tokenisation of the history: zero expected for this loop) and its multi-turn
counts. Not in `make bench` (it trains; the underscore keeps it out of the smoke-tested benches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "agents" / "python_tool_agent.py"


def agent_rows(src: Path, dst: Path) -> Path:
    """The tool task's training rows with the user's agent (env ``agent``) in place of the built-in environment."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    dst.write_text("".join(json.dumps({**r, "env": "agent"}) + "\n" for r in rows))
    return dst


def launch(run_dir: Path, model: str, data: Path, steps: int, *extra: str) -> dict:
    """One `cascade-rl launch tools` run; its summary.json."""
    cmd = [sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tools", f"run_dir={run_dir}",
           f"model.path={model}", f"run.steps={steps}", "orchestrator.eval_every=0",
           f"data.eval_files=[{data / 'heldout/tool_arithmetic.jsonl'},{data / 'heldout/tool_arithmetic_direct.jsonl'}]",
           *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = time.perf_counter() - t0
    return summary


def gains(summary: dict, prefix: str) -> np.ndarray:
    """Per held-out question whose row id starts with ``prefix``: accuracy after − before (the sampled mode)."""
    pq = summary["heldout_per_question"]
    keep = np.array([r.startswith(prefix) for r in pq["rows"]])
    mode = "heldout_accuracy"  # avg@eval_n at eval_temperature (orchestrator/evaluate.py modes)
    return (np.array(pq[mode]["after"]) - np.array(pq[mode]["before"]))[keep]


def interval(d: np.ndarray) -> list[float]:
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    return [round(float(d.mean() - half), 4), round(float(d.mean()), 4), round(float(d.mean() + half), 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT / "runs/data/tools")
    p.add_argument("--model", default=str(ROOT / "models/tools-sft"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=ROOT / "runs/agent")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rl = args.data / "rl" / "tool_arithmetic.jsonl"
    common = [f"supervisor.progress={os.environ.get('PROGRESS', 'auto')}"]
    builtin = launch(args.out / "builtin", args.model, args.data, args.steps, f"data.files=[{rl}]", *common)
    rows = agent_rows(rl, args.out / "tool_arithmetic_agent.jsonl")
    agent = launch(args.out / "agent", args.model, args.data, args.steps, f"data.files=[{rows}]",
                   f"agent.fn={AGENT}:agent", *common)
    result = {"steps": args.steps, "runs": {}}
    for name, s in (("builtin", builtin), ("agent", agent)):
        result["runs"][name] = {"tool_use": interval(gains(s, "tool_arithmetic/")),
                                "math": interval(gains(s, "tool_arithmetic_direct/")),
                                "multi_turn": s["multi_turn"], "wall_s": round(s["bench_wall_s"], 1),
                                "loop_s": round(s["loop_s"], 1), "trained": s["books"]["trained"]}
    diff = gains(agent, "tool_arithmetic/") - gains(builtin, "tool_arithmetic/")
    result["agent_minus_builtin"] = interval(diff)
    mt = agent["multi_turn"]
    trajectories = agent["books"]["trained"]
    result["agent_segments"] = {"segments_mean": mt.get("segments_mean", 1.0),
                                "new_segments": round((mt.get("segments_mean", 1.0) - 1) * trajectories)}
    (args.out / "agent_vs_builtin.json").write_text(json.dumps(result, indent=2))
    lines = [f"# The tool task: the built-in python environment vs an openai client loop ({args.steps} steps each)",
             "", "| run | held-out gain with the tool [95 % CI] | without the tool | turns | tool calls | "
             "segments / trajectory | wall s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["runs"].items():
        lo, m, hi = r["tool_use"]
        lines.append(f"| {name} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] | {r['math'][1]:+.3f} | "
                     f"{r['multi_turn']['turns_mean']:.2f} | {r['multi_turn']['tool_calls_mean']:.2f} | "
                     f"{r['multi_turn'].get('segments_mean', 1.0):.2f} | {r['wall_s']:.0f} |")
    lo, m, hi = result["agent_minus_builtin"]
    lines += ["", f"Agent − built-in, paired over the held-out questions: **{m:+.3f} [{lo:+.3f}, {hi:+.3f}]** "
              f"({'within noise' if lo <= 0 <= hi else 'outside noise'}).",
              f"New segments (re-tokenisations of a history) in the agent run: {result['agent_segments']['new_segments']}."]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The gateway's cost per model call against the built-in multi-turn path: one run, the same rollouts.

    .venv/bin/python bench/_agent_gateway.py [--model models/tools-sft] [--data runs/data/tools] [--steps 6]

One `cascade-rl launch tools` whose prompts are the tool task's questions twice: once as built-in rows (the
``python`` environment) and once as agent rows (examples/agents/python_tool_agent.py, a plain openai client loop
through the gateway). Both kinds share the samplers, the batches and the load; what differs is the path of a
model call:

- built-in: a turn after the first is queued by the orchestrator once the environment's reply is in, and comes
  back from a sampler: **turn wait** (queued to sampled, the orchestrator's clock, ``summary.json`` ``turn_wait``);
- agent: every call comes in over HTTP to the gateway (render, tokenise), goes to the orchestrator, is queued,
  sampled, sent back, parsed and answered: **call time** (the gateway's clock, request in to reply out), of which
  **waiting** for the orchestrator and **the gateway's own** (the rest). The orchestrator's turn wait of agent calls
  is reported beside it.

The gateway's overhead per call is the agent's call time (the gateway's clock) less its turn wait (the
orchestrator's clock): the gateway's own work, the HTTP and ZeroMQ hops; against the built-in turn wait of the same
run (its ratio). The turn waits themselves (queueing under the same load) are reported for both kinds. Not in
`make bench` (it needs the SFT'd tools model and the sandbox: `make tools-model`). Writes
bench/results/agent_gateway.json and prints its summary line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "agents" / "python_tool_agent.py"


def both_kinds(src: Path, dst: Path, rows: int) -> Path:
    """The first ``rows`` questions as built-in rows and as agent rows (ids told apart)."""
    records = [json.loads(x) for x in src.read_text().splitlines() if x.strip()][:rows]
    dst.write_text("".join(json.dumps({**r, "id": f"{r['id']}/{kind}", "env": env}) + "\n"
                           for r in records for kind, env in (("builtin", "python"), ("agent", "agent"))))
    return dst


def gateway_counters(log: Path) -> dict:
    """The gateway's counters as it logged them when it stopped."""
    line = next(x for x in reversed(log.read_text().splitlines()) if "stopped: " in x)
    return json.loads(line.split("stopped: ", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/tools-sft"))
    p.add_argument("--data", type=Path, default=ROOT / "runs/data/tools")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--out", type=Path, default=ROOT / "runs/agent-gateway")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = both_kinds(args.data / "rl" / "tool_arithmetic.jsonl", args.out / "rows.jsonl", args.rows)
    run_dir = args.out / "run"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tools", f"run_dir={run_dir}",
                    f"model.path={args.model}", f"data.files=[{data}]", "data.eval_files=[]", "orchestrator.eval_n=0",
                    f"run.steps={args.steps}", "run.prompts_per_step=16", "run.group_size=8",
                    f"agent.fn={AGENT}:agent", "supervisor.progress=none"], check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    waits = summary["turn_wait"]
    gw = gateway_counters(run_dir / "logs" / "gateway-0.log")
    calls = max(1, gw["calls"] - gw["ended"])  # the sampled ones (not those answered empty at a limit)
    call_ms, wait_ms = 1e3 * gw["call_s"] / calls, 1e3 * gw["wait_s"] / calls
    builtin_ms = 1e3 * waits["builtin"]["mean_s"]
    record = {
        "steps": args.steps, "wall_s": round(time.perf_counter() - t0, 1),
        "builtin_turns": waits["builtin"]["turns"], "builtin_turn_wait_ms": round(builtin_ms, 2),
        "agent_calls": gw["calls"], "agent_calls_at_a_limit": gw["ended"], "agent_call_ms": round(call_ms, 2),
        "agent_waiting_for_orchestrator_ms": round(wait_ms, 2), "gateway_own_ms": round(call_ms - wait_ms, 2),
        "agent_turn_wait_ms": round(1e3 * waits["agent"]["mean_s"], 2),
        "overhead_per_call_ms": round(call_ms - 1e3 * waits["agent"]["mean_s"], 2), "new_segments": gw["new_segments"],
        "multi_turn": summary["multi_turn"],
    }
    overhead = record["overhead_per_call_ms"]
    write_result({"name": "agent_gateway", "metric": "gateway overhead ms per call / built-in turn wait ms",
                  "value": overhead, "baseline": "built-in multi-turn turn wait (same run)",
                  "baseline_value": round(builtin_ms, 2), "ratio": round(overhead / builtin_ms, 4),
                  "target": None, "pass": None}, {**record, "name": "agent_gateway"})


if __name__ == "__main__":
    main()

"""One machine vs two nodes: the step time of the same tiny run started by the local launcher and placed by Ray
on a two-node cluster (the head here, a worker node in its own network namespace: tests/helpers/ray_cluster.py).

    sudo .venv/bin/python bench/ray_nodes.py [--quick] [--rounds N] [--steps N]

Settings (each a real ``cascade-rl launch tiny``, make run's SFT'd model, the arithmetic prompts):

- ``local``: launcher=local, ipc endpoints, weights through /dev/shm (the default);
- ``local_stream``: launcher=local with tcp endpoints on the head's address and the stream weight transport: what
  crossing nodes costs in transport alone;
- ``ray_two_nodes``: launcher=ray, orchestrator and trainer on the head, samplers and verifiers on the worker node;
- ``local_2ranks`` / ``ray_2ranks_two_nodes``: the trainer on 2 ranks (FSDP2, gloo), torchrun on this machine vs
  one rank per node placed by Ray (STRICT_SPREAD), samplers and verifiers on the worker node.

Both "nodes" share this machine's 2 cores: the figures measure what the launcher and the network path add, not
what more machines buy. Step time: the median ``step_s`` of the steps after the first two. Settings alternate,
the order rotating per round. Writes bench/results/ray_nodes.json; the last stdout line is the summary
(ray_two_nodes vs local).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import CLI, machine, math_data, sft_model  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "helpers"))
from ray_cluster import RayCluster  # noqa: E402


def settings(cluster: RayCluster) -> dict[str, list[str]]:
    ray = ["launcher=ray", f"ray.address={cluster.address}", f"host={cluster.head_ip}", "weights_transport=stream",
           "ray.orchestrator.labels=[{node: head}]", "ray.sampler.labels=[{pool: rollout}]",
           "ray.verifier.labels=[{pool: rollout}]"]
    return {
        "local": [],
        "local_stream": [f"host={cluster.head_ip}", "weights_transport=stream"],
        "ray_two_nodes": [*ray, "ray.trainer.labels=[{node: head}]"],
        "local_2ranks": ["trainer.world_size=2"],
        "ray_2ranks_two_nodes": [*ray, "trainer.world_size=2", "ray.trainer_strategy=STRICT_SPREAD"],
    }


def launch(name: str, overrides: list[str], steps: int, work: Path) -> dict:
    run_dir = work / f"{name}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    r = subprocess.run([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={sft_model()}", *math_data(),
                        f"run.steps={steps}", "run.prompts_per_step=8", "supervisor.progress=none",
                        *overrides], capture_output=True, text=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [m["step_s"] for m in metrics if "step_s" in m][2:]
    summary = json.loads((run_dir / "summary.json").read_text())
    nodes = sorted({w.get("node") or "local" for w in summary["workers"]})
    return {"setting": name, "step_s": statistics.median(step_s), "wall_s": wall, "nodes": nodes,
            "lost": summary["books"]["lost"], "trained": summary["books"]["trained"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 steps, 1 round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/ray_nodes.py makes a network namespace for the worker node: run it as root")
    rounds, steps = args.rounds or (1 if args.quick else 3), args.steps or (8 if args.quick else 16)
    work = Path(tempfile.mkdtemp(prefix="crl-raynodes-"))
    sft_model(), math_data()  # built before the clock runs, if missing
    runs = []
    with RayCluster(work / "ray") as cluster:
        names = settings(cluster)
        order = list(names)
        for r in range(rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                runs.append(launch(name, names[name], steps, work))
                x = runs[-1]
                print(f"round {r}: {name}: step {x['step_s'] * 1e3:.0f} ms (wall {x['wall_s']:.1f} s, nodes "
                      f"{x['nodes']}, lost {x['lost']})", file=sys.stderr)
    table = {name: {"step_s": statistics.median(x["step_s"] for x in runs if x["setting"] == name),
                    "wall_s": statistics.median(x["wall_s"] for x in runs if x["setting"] == name),
                    "step_s_rounds": [round(x["step_s"], 4) for x in runs if x["setting"] == name]}
             for name in names}
    ours, base = table["ray_two_nodes"]["step_s"], table["local"]["step_s"]
    summary = {"name": "ray_nodes", "metric": "step time, launcher=ray on two nodes vs launcher=local (tiny, s)",
               "value": round(ours, 4), "baseline": "launcher=local, one machine", "baseline_value": round(base, 4),
               "ratio": round(ours / base, 3), "target": None, "pass": None, "machine": machine(),
               "ratios": {name: round(row["step_s"] / base, 3) for name, row in table.items()},
               "ranks_ratio": round(table["ray_2ranks_two_nodes"]["step_s"] / table["local_2ranks"]["step_s"], 3)}
    out = {**summary, "table": table, "runs": runs, "quick": args.quick, "steps": steps,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "ray_nodes.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

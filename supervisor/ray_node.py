"""``cascade-rl ray-node``: the Ray cluster of a ``launcher=ray`` run, one node at a time, as a batch job
(deploy/slurm/ray.sbatch) or a test builds it.

    cascade-rl ray-node head --ip 10.0.0.1 --port 6379 --labels node=head          # on the first node
    cascade-rl ray-node worker --address 10.0.0.1:6379 --ip 10.0.0.2 --labels pool=rollout
    cascade-rl ray-node wait --address 10.0.0.1:6379 --nodes 4                      # until 4 nodes are alive

``head`` and ``worker`` run ``ray start`` with the defaults a run wants (no dashboard, no usage report, the
node's address given, labels and resources declared) and, with ``--block``, stay in the foreground until the
node stops (a batch job's step). ``wait`` returns once the cluster has that many live nodes, or fails with the
nodes it has.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def ray_start_args(args: argparse.Namespace) -> list[str]:
    """The ``ray start`` command line of a head (``args.role == "head"``) or worker node."""
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    cmd = [ray, "start", "--disable-usage-stats"]
    if args.role == "head":
        cmd += ["--head", f"--port={args.port}", "--include-dashboard=false"]
    else:
        cmd.append(f"--address={args.address}")
    if args.ip:
        cmd.append(f"--node-ip-address={args.ip}")
    if args.num_cpus is not None:
        cmd.append(f"--num-cpus={args.num_cpus}")
    if args.num_gpus is not None:
        cmd.append(f"--num-gpus={args.num_gpus}")
    if args.labels:
        cmd.append(f"--labels={args.labels}")
    if args.resources:
        json.loads(args.resources)  # a clear error here rather than Ray's later
        cmd.append(f"--resources={args.resources}")
    if args.object_store_mb:
        cmd.append(f"--object-store-memory={args.object_store_mb * 2**20}")
    if args.temp_dir:
        cmd.append(f"--temp-dir={args.temp_dir}")
    if args.block:
        cmd.append("--block")
    return cmd


def alive_nodes(address: str) -> list[dict]:
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        return [n for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()


def cmd_ray_node(args: argparse.Namespace) -> int:
    if args.role == "wait":
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                nodes = alive_nodes(args.address)
            except (ConnectionError, RuntimeError) as e:
                nodes, why = [], str(e)
            else:
                why = f"{len(nodes)} alive: {', '.join(n['NodeManagerAddress'] for n in nodes)}"
            if len(nodes) >= args.nodes:
                print(f"ray cluster at {args.address}: {why}")
                return 0
            if time.monotonic() > deadline:
                print(f"cascade-rl: the Ray cluster at {args.address} has not {args.nodes} live nodes after "
                      f"{args.timeout:.0f} s ({why}): see the nodes' logs", file=sys.stderr)
                return 1
            time.sleep(1.0)
    if args.role == "worker" and not args.address:
        print("cascade-rl: ray-node worker needs --address HEAD_IP:PORT", file=sys.stderr)
        return 2
    return subprocess.call(ray_start_args(args))


def add_parser(sub) -> None:
    r = sub.add_parser("ray-node", help="start a Ray head or worker node for launcher=ray, or wait for the nodes")
    r.add_argument("role", choices=["head", "worker", "wait"])
    r.add_argument("--address", default="", help="worker, wait: the head's HOST:PORT")
    r.add_argument("--ip", default="", help="this node's address in the cluster (default: Ray's guess)")
    r.add_argument("--port", type=int, default=6379, help="head: the GCS port")
    r.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers (default: its cores)")
    r.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers (default: those it sees)")
    r.add_argument("--labels", default="", help="k=v,k2=v2: what ray.<role>.labels select on")
    r.add_argument("--resources", default="", help='custom resources as JSON, e.g. \'{"rollout": 4}\'')
    r.add_argument("--object-store-mb", type=int, default=0, help="Ray's object store size (default: Ray's)")
    r.add_argument("--temp-dir", default="", help="Ray's session folder root (one per node on a shared machine)")
    r.add_argument("--block", action="store_true", help="stay in the foreground until the node stops")
    r.add_argument("--nodes", type=int, default=1, help="wait: how many live nodes")
    r.add_argument("--timeout", type=float, default=300.0, help="wait: seconds before giving up")
    r.set_defaults(fn=cmd_ray_node)

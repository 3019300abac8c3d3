"""A real two-node Ray cluster on this machine: the head in this network namespace, a worker node in a network
namespace of its own (a veth pair made here), both started with ``cascade-rl ray-node`` as the Slurm script
starts them. Needs root (network namespaces).

    with RayCluster(tmp) as cluster:            # cluster.address, cluster.head_ip, cluster.worker_ip
        cluster.kill_worker()                   # the worker node dies: every process in its namespace, at once
        cluster.start_worker()                  # a fresh worker node
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from netns import Netns

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


def descendants(pids: set[int]) -> set[int]:
    """``pids`` and every process below them (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def kill_matching(text: str) -> None:
    """SIGKILL every process whose command line holds ``text`` (a node's temp dir), and all below them."""
    roots, me = set(), {os.getpid(), os.getppid()}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        if int(cmdline.parent.name) in me:
            continue
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                roots.add(int(cmdline.parent.name))
        except OSError:
            continue
    for pid in descendants(roots) - me:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class RayCluster:
    def __init__(self, root: Path, cpus: int = 4) -> None:
        k = 100 + os.getpid() % 150
        self.head_ip, self.worker_ip = f"10.232.{k}.1", f"10.232.{k}.2"
        self.netns = Netns(f"crlr{os.getpid()}", self.head_ip, self.worker_ip)
        self.ns = self.netns.name
        self.port = 20000 + os.getpid() % 20000
        self.address = f"{self.head_ip}:{self.port}"
        # short: Ray's unix sockets live under them (paths of at most ~107 bytes)
        self.head_tmp, self.worker_tmp = f"/tmp/crlray-h{os.getpid()}", f"/tmp/crlray-w{os.getpid()}"
        self.cpus, self.root = cpus, root
        self.env = dict(os.environ, RAY_prestart_worker_first_driver="0")  # no idle workers to boot on 2 cores

    def __enter__(self) -> RayCluster:
        self.netns.__enter__()
        try:
            self._node("head", "--ip", self.head_ip, "--port", str(self.port), "--labels", "node=head",
                       "--temp-dir", self.head_tmp)
            self.start_worker()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _node(self, role: str, *args: str, netns: bool = False) -> None:
        prefix = ["ip", "netns", "exec", self.ns] if netns else []
        r = subprocess.run([*prefix, *CLI, "ray-node", role, "--num-cpus", str(self.cpus), "--object-store-mb", "100",
                            *args], capture_output=True, text=True, env=self.env, timeout=120)
        assert r.returncode == 0, f"ray-node {role} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"

    def start_worker(self) -> None:
        self._node("worker", "--address", self.address, "--ip", self.worker_ip, "--labels", "pool=rollout",
                   "--temp-dir", self.worker_tmp, netns=True)
        r = subprocess.run([*CLI, "ray-node", "wait", "--address", self.address, "--nodes", "2", "--timeout", "60"],
                           capture_output=True, text=True, env=self.env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr

    def netns_pids(self) -> list[int]:
        return self.netns.pids()

    def kill_worker(self) -> int:
        """The worker node dies as a machine that loses power: every process of its network namespace (its
        raylet, its actors, the workers they started) frozen at once, then killed, so none reacts (a worker's
        death signal would let it drain). Returns how many processes died."""
        pids = self.netns_pids()
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return len(pids)

    def __exit__(self, *exc) -> None:
        self.kill_worker()
        kill_matching(self.worker_tmp)
        kill_matching(self.head_tmp)
        time.sleep(0.5)
        self.netns.__exit__()
        for tmp in (self.head_tmp, self.worker_tmp):
            subprocess.run(["rm", "-rf", tmp], capture_output=True)

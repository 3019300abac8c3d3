"""The Ray launcher: each worker placed on a Ray cluster's nodes, started there by a Ray actor.

    cascade-rl launch tiny launcher=ray ray.address=HEAD:6379 weights_transport=stream

``connect`` joins the running cluster (``ray.init(address=...)``) as a driver; the run's tcp endpoints go on
this machine's address in the cluster (``host``, else Ray's). Every process gets a placement group of its own
(one bundle: what its role's ``ray`` section reserves; the trainer: one bundle per rank under
``ray.trainer_strategy``), on a node its role's label selectors allow (supervisor/launchers/placement_rules.py),
and in that group one ``ProcessHost`` actor (supervisor/launchers/ray_host.py) that starts the very command the
local launcher runs. ZeroMQ stays the data plane: the orchestrator and the trainer bind on their nodes'
addresses (placed before config.yaml is written, ``address_of``), every worker connects with the run's CURVE
keys, weights travel by the stream transport.

The trainer's ranks are started as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR: rank 0's node,
MASTER_PORT: free there; OMP_NUM_THREADS=1 unless set; GLOO_SOCKET_IFNAME: the interface of the rank's node
address), each seeing its own GPU.

A host lost (its node died, or the actor was killed) ends its handle with ``lost`` set; its node is avoided for
``ray.suspect_s`` and the supervisor's restart policy places the worker again, on the nodes left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from . import LaunchError, Start
from .placement_rules import NODE_ID, PlacementError, bundle, choose, describe

LOST = -9  # the exit code a handle reports when its host (its node) was lost


class RayHandle:
    """One worker (the trainer: its ranks) on the cluster: its placement group, its hosts, their exits."""

    def __init__(self, launcher: RayLauncher, pg, hosts: list, infos: list[dict]) -> None:
        import ray

        self._ray, self._launcher, self.pg, self.hosts, self.infos = ray, launcher, pg, hosts, infos
        self.node = infos[0]["ip"]
        self.pid: int | None = None
        self.returncode: int | None = None
        self.lost = ""  # why, when the host (its node) was lost
        self._waits: dict = {}  # each host's wait() reference -> its rank
        self._codes: dict[int, int] = {}  # rank -> exit code, as they exit

    def started(self, pids: list[int]) -> None:
        self.pid = pids[0]
        self._waits = {h.wait.remote(): rank for rank, h in enumerate(self.hosts)}

    def poll(self) -> int | None:
        if self.returncode is not None or not self._waits:
            return self.returncode
        pending = [ref for ref, rank in self._waits.items() if rank not in self._codes]
        ready, _ = self._ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in ready:
            rank = self._waits[ref]
            try:
                self._codes[rank] = int(self._ray.get(ref))
            except self._ray.exceptions.RayError as e:  # the actor is gone: its node died, or it was killed
                self._codes[rank] = LOST
                self.lost = f"host on {self.infos[rank]['ip']} lost ({type(e).__name__})"
                self._launcher.suspect(self.infos[rank]["node_id"])
        failed = [c for c in self._codes.values() if c != 0]
        if failed or len(self._codes) == len(self._waits):
            self.returncode = failed[0] if failed else 0
            self._release(grace_s=5.0 if failed else 0.0)  # a rank failed: the others stop with it (torchrun's rule)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"ray:{self.node}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        for h in self.hosts:
            h.signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        for h in self.hosts:
            h.signal.remote(signal.SIGKILL)
        self._release(grace_s=5.0)
        if self.returncode is None:
            self.returncode = LOST

    def _release(self, grace_s: float) -> None:
        """Stop every rank still running, then the actors and their placement group (its resources freed)."""
        if grace_s and (running := [ref for ref, rank in self._waits.items() if rank not in self._codes]):
            for h in self.hosts:
                h.signal.remote(signal.SIGKILL)
            self._ray.wait(running, num_returns=len(running), timeout=grace_s)
        for h in self.hosts:
            self._ray.kill(h)
        self._launcher.release(self.pg)


class RayLauncher:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.ip = ""
        self._placed: dict[str, tuple] = {}  # worker id -> (pg, hosts, infos) placed ahead (address_of)
        self._suspects: dict[str, float] = {}  # node id -> until when new placements avoid it

    # ------------------------------------------------------------------ the cluster

    def connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise LaunchError("launcher=ray needs Ray on this machine and every node: pip install "
                               "'cascade-rl[ray]'") from None
        address = self.cfg.ray.address
        if unreachable := _unreachable(address):  # ray.init would retry a dead address for minutes
            raise LaunchError(f"launcher=ray: no Ray cluster answers at ray.address={address} ({unreachable}): start "
                              f"one there (cascade-rl ray-node head, or ray start --head) or fix the address")
        try:
            ray.init(address=address, _node_ip_address=self.cfg.host or None, log_to_driver=False,
                     namespace=f"cascade-rl-{self.cfg.run_id}", configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise LaunchError(f"launcher=ray: cannot join the Ray cluster at ray.address={address} ({e}): start "
                               f"one (ray start --head) or set ray.address=HEAD:PORT") from None
        self.ip = self.cfg.host or ray.util.get_node_ip_address()

    def host(self) -> str:
        """This machine's address in the cluster: the supervisor's endpoints bind there."""
        return self.ip

    def nodes(self) -> list[dict]:
        import ray

        return ray.nodes()

    def suspect(self, node_id: str) -> None:
        self._suspects[node_id] = time.monotonic() + self.cfg.ray.suspect_s

    def _avoid(self) -> set[str]:
        now = time.monotonic()
        return {n for n, until in self._suspects.items() if until > now}

    # ------------------------------------------------------------------ placement

    def _place(self, role: str, ranks: int) -> tuple:
        """A placement group for one worker (``ranks`` bundles), ready, with one host actor per bundle."""
        import ray
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .ray_host import ProcessHost

        spec = self.cfg.ray[role]
        need = bundle(spec) or {"CPU": 0.01}  # Ray's bundles cannot be empty
        nodes = self.nodes()
        selector = choose(list(spec.labels), nodes, need, self._avoid())
        strategy = str(self.cfg.ray.trainer_strategy) if ranks > 1 else "PACK"
        pg = placement_group([need] * ranks, strategy=strategy,
                             bundle_label_selector=[selector] * ranks if selector else None)
        try:
            ray.get(pg.ready(), timeout=self.cfg.ray.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise PlacementError(f"{role}: no room for {ranks} x {need} (labels {selector or 'any'}, strategy "
                                 f"{strategy}) within ray.placement_timeout_s={self.cfg.ray.placement_timeout_s}; "
                                 f"the cluster has: {describe(nodes)}") from None
        actor = ray.remote(ProcessHost)
        hosts = [actor.options(max_concurrency=4, num_cpus=need.get("CPU", 0), num_gpus=need.get("GPU", 0),
                               resources={k: v for k, v in need.items() if k not in ("CPU", "GPU")} or None,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                 for i in range(ranks)]
        try:
            infos = ray.get([h.node.remote() for h in hosts], timeout=self.cfg.ray.placement_timeout_s)
        except ray.exceptions.RayError as e:  # its node died meanwhile, or it never started (a timeout)
            for h in hosts:
                ray.kill(h)
            self.release(pg)
            raise LaunchError(f"{role}: its host did not start on the placed node ({type(e).__name__}: {e})") from None
        return pg, hosts, infos

    def address_of(self, worker_id: str, role: str, ranks: int = 1) -> tuple[str, int]:
        """Place ``worker_id`` now (kept for its ``spawn``): its node's address and a port free there, for the
        endpoint it will bind."""
        import ray

        pg, hosts, infos = self._placed[worker_id] = self._place(role, ranks)
        try:
            return infos[0]["ip"], int(ray.get(hosts[0].free_port.remote(), timeout=60))
        except ray.exceptions.RayError as e:
            raise LaunchError(f"{worker_id}: its node stopped answering ({type(e).__name__})") from None

    def spawn(self, start: Start) -> RayHandle:
        import ray

        pg, hosts, infos = self._placed.pop(start.worker_id, None) or self._place(start.role, start.ranks)
        handle = RayHandle(self, pg, hosts, infos)
        env = dict(start.env, CASCADE_RL_NODE_IP=infos[0]["ip"])
        try:
            envs = [env] if start.ranks == 1 else self._rank_envs(env, hosts, infos)
            pids = ray.get([h.start.remote(start.cmd, e, _rank_log(start.log_path, rank))
                            for rank, (h, e) in enumerate(zip(hosts, envs))])
        except ray.exceptions.RayError as e:
            handle.kill()
            raise LaunchError(f"{start.worker_id}: {getattr(e, 'cause', None) or e}") from None
        handle.started(pids)
        return handle

    def _rank_envs(self, env: dict, hosts: list, infos: list[dict]) -> list[dict]:
        """torchrun's environment for each rank: rank 0's node is the rendezvous (MASTER_ADDR:MASTER_PORT)."""
        import ray

        port = ray.get(hosts[0].free_port.remote())
        world = len(hosts)
        out = []
        for rank, info in enumerate(infos):
            e = dict(env, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR=infos[0]["ip"], MASTER_PORT=str(port), CASCADE_RL_NODE_IP=info["ip"])
            if info["interface"] and "GLOO_SOCKET_IFNAME" not in os.environ:
                e["GLOO_SOCKET_IFNAME"] = info["interface"]
            if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default for several ranks (trainer.threads wins)
                e.setdefault("OMP_NUM_THREADS", "1")
            out.append(e)
        return out

    def release(self, pg) -> None:
        import ray

        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed, or the cluster is gone: nothing left to free
            pass

    def close(self) -> None:
        import ray

        for pg, hosts, _ in self._placed.values():  # placed ahead but never started (a failed launch)
            for h in hosts:
                ray.kill(h)
            self.release(pg)
        ray.shutdown()


def _unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why a HOST:PORT address takes no TCP connection ("" when it does, or for ``auto``)."""
    import socket

    host, _, port = address.rpartition(":")
    if address == "auto" or not port.isdigit():
        return ""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return str(e)
    return ""


def _rank_log(path: str, rank: int) -> str:
    return path if rank == 0 else path.removesuffix(".log") + f".rank{rank}.log"


__all__ = ["LOST", "NODE_ID", "RayHandle", "RayLauncher"]

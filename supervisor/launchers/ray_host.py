"""The Ray actor that runs one worker process on the node Ray placed it on (supervisor/launchers/ray_launcher.py).

    host = ray.remote(ProcessHost).options(max_concurrency=4, scheduling_strategy=...).remote()
    ip, port = ray.get(host.node.remote()), ray.get(host.free_port.remote())
    pid = ray.get(host.start.remote(cmd, env, log_path))      # the same command the local launcher runs
    rc = ray.get(host.wait.remote())                           # its exit code, when it exits

The worker is a child of the actor, in its own session, told to die with it (``PR_SET_PDEATHSIG``): the actor
killed, or its node lost, takes the worker with it. Its output goes to ``log_path`` on the run's shared file
system, as the local launcher's does.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from ..procs import _die_with_parent, free_ports

# what Ray sets in its workers' environments that must not reach ours: thread counts follow the config
# (sampler.threads...), as under the local launcher
DROPPED_ENV = ("OMP_NUM_THREADS",)


class ProcessHost:
    def __init__(self) -> None:
        self._popen: subprocess.Popen | None = None
        self._done = threading.Event()
        self._started = threading.Event()
        self._error: str = ""

    def node(self) -> dict:
        """This node: its address in the cluster, hostname, Ray node id, and the interface holding the address."""
        import ray

        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "hostname": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "interface": interface_of(ip)}

    def free_port(self) -> int:
        """A TCP port free on this node now (for an endpoint a process placed here will bind)."""
        return free_ports(1)[0]

    def start(self, cmd: list[str], env: dict[str, str], log_path: str) -> int:
        """Start ``cmd`` (its ``python`` is this node's: the actor's interpreter) with this actor's environment
        plus ``env``; returns its pid. Raises with what to change when this node cannot see the run."""
        missing = [p for p in (str(Path(log_path).parent), *[a for a in cmd if a.endswith("config.yaml")])
                   if not Path(p).exists()]
        if missing:
            raise RuntimeError(f"node {socket.gethostname()} cannot see {missing}: every node of a launcher=ray run "
                               f"must see the run directory, the model and the data at the same paths (a shared "
                               f"file system)")
        cmd = [sys.executable if a == "python" else a for a in cmd]
        full_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        full_env.update(env)
        threading.Thread(target=self._run, args=(cmd, full_env, log_path), daemon=True).start()
        self._started.wait()
        if self._error:
            raise RuntimeError(self._error)
        return self._popen.pid

    def _run(self, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        """Start the worker from this thread and wait for it here: the thread lives as long as the worker, so the
        worker's death signal follows the actor's process, not a pool thread that ended."""
        try:
            with open(log_path, "ab") as log:
                self._popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as e:
            self._error = f"cannot start {cmd[:3]}... on {socket.gethostname()}: {e}"
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self._popen.wait()
        self._done.set()

    def wait(self) -> int:
        """Block until the worker exits; its exit code (negative: the signal that ended it)."""
        self._started.wait()
        self._done.wait()
        return self._popen.returncode if self._popen is not None else 127

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group (it and its children: a verifier's pool, torchrun's)."""
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.killpg(self._popen.pid, signum)
            except ProcessLookupError:
                pass


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip`` ("" if none does): gloo binds the trainer ranks' connections to
    it (GLOO_SOCKET_IFNAME), so ranks on several nodes reach each other on the cluster's network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return ""

"""The local launcher: every worker a child process of the supervisor, on its machine.

A multi-rank trainer runs under torchrun (one process per rank, ``--standalone``); a ``prefix`` (the samplers'
``sampler.launcher``: ``ip netns exec NS``, ``ssh HOST``) runs the command elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from . import Start


class PopenHandle:
    """A ``subprocess.Popen`` with the launcher handle's parts: the worker leads its own process group."""

    node = ""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        return self.popen.wait(timeout)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()


class LocalLauncher:
    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def connect(self) -> None:
        """Nothing to join: endpoints are ipc://, or tcp:// on ``host``."""

    def host(self) -> str:
        return self.cfg.host

    def spawn(self, start: Start) -> PopenHandle:
        from ..procs import _die_with_parent

        cmd = [sys.executable if a == "python" else a for a in start.cmd]
        if start.ranks > 1:  # python -P -m MODULE ... -> python -P -m torch.distributed.run ... -m MODULE ...
            cmd[3:3] = ["torch.distributed.run", "--standalone", f"--nproc-per-node={start.ranks}", "-m"]
        env = dict(os.environ, **start.env)
        with open(start.log_path, "ab") as log:
            popen = subprocess.Popen([*start.prefix, *cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        return PopenHandle(popen)

    def close(self) -> None:
        pass

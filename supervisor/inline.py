"""``cascade-rl launch PRESET --inline``: the same config, every role a thread of this one process.

    cascade-rl launch tiny --inline run_dir=/tmp/r        # then: py-spy dump --pid PID, or a debugger

Each role runs its own ``main()`` (the module the supervisor would start as a process) in a thread named by its
worker id; the sockets are the same, over ``inproc://`` endpoints in one ZeroMQ context; heartbeats, the
orchestrator, the ledger, the books and the summary are those of a normal launch. What differs, because a
process has one environment: every role runs on the CPU (no ``gpus.*``), the trainer has one rank, samplers use
the in-process engines (not SGLang's servers), verifiers score in their own thread (``InThreadPool``: a hung
verifier is not killed), and a role that raises fails the run with its traceback in ``logs/inline.log`` instead
of being restarted. A judge served by the supervisor (``verifier.judge.serve``) is the one process of its own, as in
a normal launch (logs/judge.log; restarted when it dies): it is another program's server, not a role's ``main()``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import traceback
from pathlib import Path


def problems(cfg) -> list[str]:
    """What of ``cfg`` one process cannot run, each with what to change."""
    out = []
    if any(cfg.gpus[k] for k in ("trainer", "samplers", "teachers")):
        out.append("--inline runs every role in one process, which has one set of visible GPUs: leave gpus.* empty "
                   "(the CPU), or launch without --inline")
    if cfg.trainer.world_size != 1:
        out.append("--inline runs one trainer rank: set trainer.world_size=1")
    if cfg.sampler.engine == "sglang":
        out.append("--inline cannot run SGLang's servers: sampler.engine=torch or vllm")
    if cfg.sampler.launcher:
        out.append("--inline starts no processes: empty sampler.launcher")
    if cfg.launcher != "local":
        out.append(f"--inline starts no processes: launcher={cfg.launcher} places processes; drop one of them")
    return out


def configure_logging(run_dir: Path) -> None:
    """One log for every role, each line named by its thread (the worker id); none of it on the console, as the
    workers' logs of a normal launch (supervisor/console.py)."""
    from .console import quiet

    quiet(run_dir / "logs" / "inline.log", inline=True, fmt="%(asctime)s %(threadName)s %(levelname)s %(message)s")


class ThreadProc:
    """A role's ``main(argv)`` in a daemon thread, with the bits of ``subprocess.Popen`` the supervisor reads."""

    def __init__(self, module: str, argv: list[str], name: str) -> None:
        self.pid = os.getpid()
        self.returncode: int | None = None
        self._main = importlib.import_module(module).main
        self._thread = threading.Thread(target=self._run, args=(argv,), name=name, daemon=True)
        self._thread.start()

    def _run(self, argv: list[str]) -> None:
        try:
            self._main(argv)
            self.returncode = 0
        except SystemExit as e:  # a worker's refusal (a config it cannot serve): its message is logged
            self.returncode = e.code if isinstance(e.code, int) else 1
            if self.returncode:
                logging.getLogger(self._thread.name).error("exited: %s", e)
        except BaseException:
            logging.getLogger(self._thread.name).error("failed:\n%s", traceback.format_exc())
            from .console import err

            print(f"{self._thread.name} failed:\n{traceback.format_exc()}", file=err(), flush=True)
            self.returncode = 1

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else (self.returncode if self.returncode is not None else 1)

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.poll()

    node = ""  # this machine

    def terminate(self) -> None:
        """A thread cannot be signalled: it ends with this process (the roles are daemon threads)."""

    def kill(self) -> None:
        """As ``terminate``."""

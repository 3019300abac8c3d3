"""The start of every worker process's ``main()``: arguments, SIGTERM handling, logging, config."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal

from omegaconf import DictConfig, OmegaConf

from . import auth
from .sockets import exit_on_sigterm


def worker_start(description: str, argv: list[str] | None = None,
                 default_id: str | None = None) -> tuple[argparse.Namespace, DictConfig]:
    """Parse ``--config RUN_DIR/config.yaml --worker-id ID``, make SIGTERM a clean exit, set up logging,
    load the run's resolved config (written once by the supervisor; workers never re-derive defaults) and install
    the run's keys (protocol/auth.py: every tcp socket this process makes is then CURVE). SIGUSR1 dumps every
    thread's stack to the process's log (the supervisor's stall report asks for it, supervisor/stall.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True)
    p.add_argument("--worker-id", required=default_id is None, default=default_id)
    p.add_argument("--resume-from", default=None,
                   help="run.resume_from for this process alone: the supervisor's restart of a trainer and an "
                        "orchestrator from the run's newest checkpoint ('latest')")
    args = p.parse_args(argv)
    exit_on_sigterm()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s")
    cfg = OmegaConf.load(args.config)
    if args.resume_from is not None:
        cfg.run.resume_from = args.resume_from
    auth.install_from_config(cfg)
    return args, cfg

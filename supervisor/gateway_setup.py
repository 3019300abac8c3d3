"""The launch's side of the agents' gateway (gateway/server.py): whether it runs, where it listens, its secret.

    if gateway_setup.needed(cfg):               # the data has agent rows (environment.serve names "agent")
        gateway_setup.assign(cfg, run_dir)      # gateway.port, gateway.base_url, gateway.secret_file filled in
        Proc("gateway", "gateway-0")            # in the start order (supervisor/plan.py), restarted like a worker

Like the served judge's URL (supervisor/judge.py ``assign_port``), the gateway's is fixed before any process starts
and written into config.yaml, so the orchestrator hands it to every agent. The secret that signs each trajectory's
session key (protocol/agents.py ``session_key``) is made anew at each launch, like the run's CURVE keys:
``run_dir/gateway.secret``, 32 random bytes as hex, mode 0600; config.yaml holds its path, never the key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from .procs import free_ports

AGENT = "agent"  # the environment name of agent rows (supervisor/run_data.py)
SECRET_FILE = "gateway.secret"  # in run_dir


def needed(cfg) -> bool:
    """Whether the launch runs the gateway: some row's agent is run by the environment workers."""
    return AGENT in (cfg.environment.serve or ())


def write_secret(path: str | Path) -> Path:
    """A new secret at ``path``, readable by this user only (an older file is unlinked first, the new one created
    exclusively: never written through a link someone else planted)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def assign(cfg, run_dir: Path) -> str:
    """Fix the gateway's port (a free one for 0), point ``gateway.base_url`` at it (host: ``gateway.host``, else the
    run's ``host``, else 127.0.0.1) and write its secret; the base URL."""
    gw = cfg.gateway
    gw.port = int(gw.port) or free_ports(1)[0]
    gw.base_url = f"http://{gw.host or cfg.host or '127.0.0.1'}:{gw.port}/v1"
    gw.secret_file = str(write_secret(run_dir / SECRET_FILE))
    return gw.base_url

"""Environment worker: EnvRequests in (the model's last turn), EnvReplies out (the tool turns, or done).

    python -m cascade_rl.environments.worker --config RUN_DIR/config.yaml --worker-id environment-0

Started by the supervisor when some row of the data has an environment. It serves the environments of
``environment.serve`` (filled by the supervisor: those the data uses; empty: every registered one, the
built-in ones of environments/builtin.py and those of ``environment.plugins``) and announces their names as
its ``Ready.domains``. Steps run concurrently in ``environment.threads`` threads: a tool runs
in its own sandboxed processes (the python tool) or is cheap (the calculator), so threads suffice, and a
hanging tool is killed by the sandbox at ``environment.tool_timeout_s``, so no thread hangs for ever.

- The model's mistakes (a bad call, a failing, crashing or hanging tool) are observations in an ``ok`` reply,
  counted in ``tool_errors``/``timeouts``.
- An environment that raises, or returns what cannot be sent, fails the trajectory: ``EnvReply(ok=False)``
  with the reason; so does an unknown environment name (the reply names the registered ones). The worker
  lives on.

Users' agents (``AgentRequest`` → ``AgentDone``, docs/ARCHITECTURE.md §14) run here too when one is configured
(``agent.fn``, ``agent.command`` or ``data.verifiers_env``): environments/agent.py runs them on an event loop of
their own; this worker then announces ``agent`` among its ``Ready.domains``, and refuses agent requests otherwise.

It runs on the worker runtime (protocol/runtime.py): Ready with its slots (``environment.slots``; with an agent,
at least ``agent.concurrency``: one credit count covers both kinds of work, and an agent's trajectory mostly
waits on the gateway, so it takes no step thread), heartbeats with the counters steps, tool_calls, tool_errors,
timeouts, failed, env_s, agents, agent_failed and agent_s, error replies, and SIGTERM drains (no new work, finish what it holds, exit 0). Nothing is lost when a worker dies: a trajectory's state
travels in its requests, so the orchestrator can send the step again to another worker.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from omegaconf import OmegaConf

from cascade_rl.protocol.agents import AgentDone, AgentRequest
from cascade_rl.protocol.messages import EnvReply, EnvRequest
from cascade_rl.protocol.runtime import Pending, Service, WorkerRuntime
from cascade_rl.protocol.worker_main import worker_start

from .agent import AGENT_DOMAIN, AgentRunner
from .base import Environment, EnvSettings
from .registry import ENVIRONMENTS, PluginError, build_environment, load_environments
from .steps import run_step

log = logging.getLogger("environment")

POLL_S = 0.005  # how long ``poll`` waits for a step to finish: a request arriving meanwhile waits at most this


class EnvironmentService(Service):
    """The environment's ``Service`` (protocol/runtime.py): steps run in a thread pool, agents on the
    ``AgentRunner``'s loop; replies come from ``poll``."""

    role = "environment"

    def __init__(self, worker_id: str, envs: dict[str, Environment], slots: int, threads: int,
                 agents: AgentRunner | None = None) -> None:
        self.worker_id, self.envs, self.agents = worker_id, envs, agents
        self.slots = max(slots, agents.concurrency) if agents else slots
        self.domains = sorted(envs) + ([AGENT_DOMAIN] if agents else [])  # announced in Ready
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"{worker_id}-step")
        self.running: dict[Future, EnvRequest] = {}
        self.counters = {"steps": 0, "tool_calls": 0, "tool_errors": 0, "timeouts": 0, "failed": 0, "env_s": 0.0,
                         "agents": 0, "agent_failed": 0, "agent_s": 0.0}

    def status(self) -> dict:
        return {"state": "running", "counters": dict(self.counters, running=self.busy())}

    def check(self, item: Pending) -> str:
        if isinstance(item.request, AgentRequest):
            return "" if self.agents else ("this worker runs no agent: set agent.fn=module:function, "
                                           "agent.command=[program, ...] or data.verifiers_env=MODULE")
        name = item.request.env
        if name in self.envs:
            return ""
        return f"unknown environment {name!r}; this worker serves: {', '.join(self.domains) or 'none'}"

    def serve(self, batch: list[Pending], reply, collect) -> None:
        # every pending request (the default take): the pool queues what its threads cannot start yet (the
        # orchestrator sends at most `slots`)
        for item in batch:
            req = item.request
            if isinstance(req, AgentRequest):
                self.agents.submit(req)
                continue
            self.running[self.pool.submit(run_step, self.envs[req.env], req, self.worker_id, item.arrived)] = req

    def poll(self, reply) -> None:
        if self.agents and self.agents.busy():  # the agents wait when no step runs, else the steps do
            for msg in self.agents.poll(0.0 if self.running else POLL_S):
                self._count_agent(msg)
                reply(None, msg)
            if not self.running:
                return
        done, _ = wait(list(self.running), timeout=POLL_S, return_when=FIRST_COMPLETED)
        for fut in done:
            req = self.running.pop(fut)
            msg = fut.result() if fut.exception() is None else EnvReply(
                req.key, False, ok=False, error=f"environment error: {fut.exception()!r}", worker_id=self.worker_id)
            self._count(msg)
            reply(None, msg)

    def busy(self) -> int:
        return len(self.running) + (self.agents.busy() if self.agents else 0)

    def error_reply(self, req: EnvRequest | AgentRequest, reason: str) -> list[EnvReply | AgentDone]:
        if isinstance(req, AgentRequest):
            done = AgentDone(req.key, ok=False, error=reason, worker_id=self.worker_id)
            self._count_agent(done)
            return [done]
        msg = EnvReply(req.key, False, ok=False, error=reason, worker_id=self.worker_id)
        self._count(msg)
        return [msg]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.agents:
            self.agents.close()

    def _count_agent(self, msg: AgentDone) -> None:
        c = self.counters
        c["agents"] += 1
        c["agent_failed"] += not msg.ok
        c["agent_s"] += msg.t_agent

    def _count(self, msg: EnvReply) -> None:
        c = self.counters
        c["steps"] += 1
        c["failed"] += not msg.ok
        c["tool_calls"] += msg.tool_calls
        c["tool_errors"] += msg.tool_errors
        c["timeouts"] += msg.timeouts
        c["env_s"] += msg.t_env


def build_environments(names: list[str], settings: EnvSettings) -> dict[str, Environment]:
    """One instance of each environment of ``names`` (all registered ones if empty; load the plugins first);
    ValueError names one that is not registered or fails to build."""
    if unknown := sorted(set(names) - set(ENVIRONMENTS)):
        raise ValueError(f"environment.serve names {unknown}, which are not registered (registered: "
                         f"{sorted(ENVIRONMENTS)}; a module of yours can add one: environment.plugins)")
    envs = {}
    for name in sorted(names or ENVIRONMENTS):
        try:
            envs[name] = build_environment(name, settings)
        except Exception as e:
            raise ValueError(f"environment {name!r} could not be built: {type(e).__name__}: {e}") from e
    return envs


def main(argv: list[str] | None = None) -> None:
    # --- config: the environment section (a key missing from an older config: its default)
    args, cfg = worker_start(__doc__.splitlines()[0], argv)
    section = cfg.get("environment") or {}
    try:
        load_environments(list(section.get("plugins") or []))
        settings = EnvSettings.from_config(section)
        serve = list(section.get("serve") or [])
        tools = [name for name in serve if name != AGENT_DOMAIN]  # "agent": the agent runner's, not a tool environment
        envs = build_environments(tools, settings) if tools or not serve else {}
        agents = AgentRunner.from_config(*(OmegaConf.to_container(cfg[k], resolve=True) if cfg.get(k) else {}
                                           for k in ("agent", "data")), args.worker_id)
    except (PluginError, ValueError, TypeError, ImportError) as e:
        raise SystemExit(str(e)) from None

    # --- serve on the worker runtime
    threads = int(section.get("threads", 4))
    service = EnvironmentService(args.worker_id, envs, slots=int(section.get("slots", 16)), threads=threads,
                                 agents=agents)
    log.info("serving environments %s in %d threads%s", sorted(envs), threads,
             f", agents ({agents.concurrency} at once)" if agents else "")
    WorkerRuntime(service, cfg, args.worker_id, batch_window_s=float(section.get("batch_window_s", 0.0)),
                  expect=(EnvRequest, AgentRequest)).run()


if __name__ == "__main__":
    main()

"""Users' agents in the environment worker (docs/ARCHITECTURE.md §14): ``AgentRequest`` in, ``AgentDone`` out.

    runner = AgentRunner.from_config(cfg.agent, cfg.data, worker_id)   # None when no agent is configured
    runner.submit(request); ...; for done in runner.poll(0.005): reply(done)

What runs one trajectory, in this order of precedence:

- ``data.verifiers_env``, for a row of its dataset (``metadata.verifiers_row``, data/verifiers_source.py): the
  ``verifiers`` environment's own rollout, scored by its rubric (environments/verifiers_rollout.py);
- ``agent.fn`` (``module:function`` or ``path/to/file.py:function``): ``await fn(client, row)`` with ``client`` an
  ``openai.AsyncOpenAI`` on the trajectory's session (no retries: the gateway's error reaches the agent);
- ``agent.command``: an external program per trajectory (environments/agent_command.py).

Trajectories run concurrently on ONE asyncio event loop in a background thread, at most ``agent.concurrency`` at
once, each under ``min(agent.timeout_s, request.deadline_s)``. Outcomes: a number → ``ok`` with that reward; None
→ ``ok`` without one (the row's domain verifier scores); anything else, an exception (``agent_error: Type:
message``, the gateway's reason included), a non-zero exit (``agent_exit``) or the deadline (``agent_timeout``)
→ ``ok=False``.

The limit of one loop: an agent that blocks it (``time.sleep`` or CPU-bound work in an ``async def``) stalls every
trajectory of this worker while it blocks, and ``asyncio.wait_for`` cannot fire. The worker itself lives on (the
loop is not its thread): ``poll``'s watchdog answers each request past its deadline (+ ``GRACE_S``) with
``agent_timeout`` whether or not its task has ended, late results are dropped, and a loop stalled past a whole
timeout is abandoned for a fresh one (its thread stays blocked, a daemon; its trajectories were answered).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from cascade_rl.protocol.agents import AgentDone, AgentRequest
from cascade_rl.verifiers.registry import PluginError, load_plugin

from .agent_command import AgentExit, run_command

AGENT_DOMAIN = "agent"  # what a worker running agents adds to its Ready.domains (the rows' env)
GRACE_S = 2.0  # how long past its deadline the watchdog waits for a task's own timeout before answering for it
BEAT_S = 0.2  # the loop's heartbeat: older than GRACE_S, the loop is blocked
ERROR_CHARS = 500  # an error message is cut to this


@dataclass
class _Live:
    """A request being run: when it was submitted and started (0: waiting for a slot), its timeout."""

    request: AgentRequest
    submitted: float
    timeout_s: float
    started: float = 0.0


def load_agent_fn(entry: str):
    """The ``async def`` that ``agent.fn`` names; PluginError saying what is wrong."""
    module_name, _, name = entry.rpartition(":")
    if not module_name or not name:
        raise PluginError(f"agent.fn: {entry!r} is not module:function or path/to/file.py:function")
    fn = getattr(load_plugin(module_name, "agent.fn"), name, None)
    if fn is None:
        raise PluginError(f"agent.fn: {module_name} has no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"agent.fn: {entry} must be an `async def fn(client, row)` (it runs on an event loop)")
    return fn


class AgentRunner:
    """Runs agent trajectories on a background event loop; ``poll`` hands back their ``AgentDone``s."""

    def __init__(self, worker_id: str, fn=None, command: list[str] | None = None, vf_env=None,
                 concurrency: int = 128, timeout_s: float = 300.0) -> None:
        if fn is None and not command and vf_env is None:
            raise ValueError("an AgentRunner needs agent.fn, agent.command or data.verifiers_env")
        self.worker_id, self.fn, self.command, self.vf_env = worker_id, fn, list(command or []), vf_env
        self.concurrency, self.timeout_s = max(1, int(concurrency)), float(timeout_s)
        self.live: dict[Any, _Live] = {}  # request key -> its run (until answered)
        self.lock = threading.Lock()
        self.results: queue.Queue[AgentDone] = queue.Queue()
        self.abandoned = 0  # loops given up on (blocked past a whole timeout)
        self._start_loop()

    @classmethod
    def from_config(cls, agent: Any, data: Any, worker_id: str) -> AgentRunner | None:
        """The runner of the ``agent`` and ``data`` config sections (mappings), or None when no agent is set."""
        agent, data = agent or {}, data or {}
        vf_name = data.get("verifiers_env") or ""
        if not (agent.get("fn") or agent.get("command") or vf_name):
            return None
        vf_env = None
        if vf_name:
            from .verifiers_rollout import load_verifiers_env

            vf_env = load_verifiers_env(vf_name, dict(data.get("verifiers_args") or {}))
        fn = load_agent_fn(agent["fn"]) if agent.get("fn") else None
        return cls(worker_id, fn=fn, command=list(agent.get("command") or []), vf_env=vf_env,
                   concurrency=int(agent.get("concurrency", 128)), timeout_s=float(agent.get("timeout_s", 300.0)))

    # --- the worker's side (its thread)

    def submit(self, req: AgentRequest) -> None:
        timeout = min(self.timeout_s, req.deadline_s)
        with self.lock:
            self.live[req.key] = _Live(req, time.monotonic(), timeout)
        asyncio.run_coroutine_threadsafe(self._run(req, timeout, self.loop), self.loop)

    def poll(self, timeout: float = 0.0) -> list[AgentDone]:
        """The trajectories that ended (waiting up to ``timeout`` for the first), and the watchdog's answers."""
        out = []
        try:
            out.append(self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait())
            while True:
                out.append(self.results.get_nowait())
        except queue.Empty:
            pass
        with self.lock:  # a result of a request the watchdog already answered is dropped
            out = [msg for msg in out if self.live.pop(msg.key, None) is not None]
        return out + self._watchdog()

    def busy(self) -> int:
        return len(self.live)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    # --- the loop's side

    def _start_loop(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.http = None  # the loop's connection pool, made on first use (in the loop)
        self.beat = time.monotonic()
        self.slots = asyncio.Semaphore(self.concurrency)  # bound to self.loop on first use
        self.thread = threading.Thread(target=self._loop_main, args=(self.loop,), daemon=True,
                                       name=f"{self.worker_id}-agents")
        self.thread.start()

    def _loop_main(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(self._heartbeat(loop))
        loop.run_forever()
        tasks = asyncio.all_tasks(loop)  # closed: what still runs is cancelled (a program's group is killed)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=5.0))
        loop.close()

    async def _heartbeat(self, loop: asyncio.AbstractEventLoop) -> None:
        while loop is self.loop:
            self.beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    async def _run(self, req: AgentRequest, timeout: float, loop: asyncio.AbstractEventLoop) -> None:
        slots = self.slots
        async with slots:
            t0 = time.monotonic()
            with self.lock:
                if (live := self.live.get(req.key)) is not None:
                    live.started = t0
            try:
                reward = await asyncio.wait_for(self._trajectory(req), timeout=timeout)
                msg = self._done(req, t0, *_outcome(reward))
            except TimeoutError as e:
                if time.monotonic() - t0 < timeout:  # the agent's own TimeoutError, not its deadline
                    msg = self._done(req, t0, False, None, f"agent_error: TimeoutError: {_cut(str(e))}")
                else:
                    msg = self._done(req, t0, False, None, f"agent_timeout: no end after {timeout:g} s")
            except AgentExit as e:
                msg = self._done(req, t0, False, None, f"agent_exit: {_cut(str(e))}")
            except Exception as e:
                msg = self._done(req, t0, False, None, f"agent_error: {type(e).__name__}: {_cut(str(e))}")
        if loop is self.loop:
            self.results.put(msg)

    async def _trajectory(self, req: AgentRequest) -> float | None:
        verifiers_row = self.vf_env is not None and "verifiers_row" in (req.row.get("metadata") or {})
        if verifiers_row or self.fn is not None or not self.command:
            import httpx
            import openai

            if self.http is None:  # one connection pool for every trajectory of the loop (a client of its own
                # builds an SSL context: 19 ms each, which held the loop for 2.4 s per 128 agents)
                self.http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(
                    max_connections=self.concurrency, max_keepalive_connections=self.concurrency))
            client = openai.AsyncOpenAI(base_url=req.base_url, api_key=req.api_key, max_retries=0,
                                        http_client=self.http)  # not closed: the pool is the loop's
            if verifiers_row or self.fn is None:
                from .verifiers_rollout import run_verifiers_rollout

                return await run_verifiers_rollout(self.vf_env, client, req.row)
            return await self.fn(client, dict(req.row))
        return await run_command(self.command, dict(req.row), req.base_url, req.api_key)

    def _done(self, req: AgentRequest, t0: float, ok: bool, reward: float | None, error: str) -> AgentDone:
        return AgentDone(req.key, ok=ok, reward=reward, error=error, t_agent=time.monotonic() - t0,
                         worker_id=self.worker_id)

    def _watchdog(self) -> list[AgentDone]:
        """Answer the requests past their deadline (+ GRACE_S) that the loop has not: it is blocked."""
        now = time.monotonic()
        stalled = now - self.beat > GRACE_S
        out = []
        with self.lock:
            for key, live in list(self.live.items()):
                since = live.started or (live.submitted if stalled else now)
                if now - since > live.timeout_s + GRACE_S:
                    del self.live[key]
                    out.append(AgentDone(key, ok=False, error=f"agent_timeout: no end after {live.timeout_s:g} s "
                                         "(the agent blocked the event loop: use await, not blocking calls)",
                                         t_agent=now - since, worker_id=self.worker_id))
        if stalled and now - self.beat > self.timeout_s + GRACE_S:  # blocked for good: a fresh loop for new work
            with self.lock:  # what waits on the old loop never runs: answered now
                waiting, self.live = list(self.live), {}
            out += [AgentDone(key, ok=False, error=f"agent_timeout: the agents' event loop was blocked for "
                              f"{now - self.beat:.0f} s by another trajectory", worker_id=self.worker_id)
                    for key in waiting]
            self.abandoned += 1
            self._start_loop()
        return out


def _outcome(reward: Any) -> tuple[bool, float | None, str]:
    """(ok, reward, error) of what an agent returned."""
    if reward is None:
        return True, None, ""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return False, None, f"agent_error: the agent returned a {type(reward).__name__}, not a float or None"
    if not math.isfinite(reward):
        return False, None, f"agent_error: the agent returned {reward}, not a finite number"
    return True, float(reward), ""


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."

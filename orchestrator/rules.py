"""The settings the orchestrator's state machine obeys (orchestrator/core.py ``Core``, orchestrator/trajectories.py
``Trajectories``), read once from the launch config's ``orchestrator`` and ``trainer`` sections.

    rules = Rules.from_config(cfg, context=4096)
    rules = Rules(max_turns=3)                    # a test, an offline evaluation
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Rules:
    """Deadlines, flight limits and the fate of groups; the defaults are the schema's (supervisor/schema.py)."""

    max_inflight_groups: int = 256  # groups held by samplers at once
    sampler_timeout_s: float = 300.0  # a group (or a multi-turn row's next turn) not back by then is sent again
    verifier_timeout_s: float = 60.0  # a score request's deadline
    teacher_timeout_s: float = 120.0  # a teacher request's deadline (MOPD)
    max_staleness: int = 0  # a group whose oldest rollout is more versions behind its step is "stale"
    dynamic_filtering: bool = False  # DAPO: groups of uniform rewards are filtered
    overlong_penalty: bool = False  # a truncated response is rewarded 0
    mask_threshold: float | None = None  # a group with no reward above it trains with its loss masked; None: never
    mopd: bool = False  # training groups need their teacher's log-probs (run.algorithm "mopd")
    env_timeout_s: float = 60.0  # an environment step's deadline (multi-turn)
    max_turns: int = 4  # model turns of a multi-turn trajectory at most
    max_total_tokens: int = 0  # tokens of a trajectory after its prompt at most; 0: max_turns x the group's max_tokens
    context: int = 0  # the model's context length: a trajectory (prompt included) never outgrows it; 0: no limit
    agent_timeout_s: float = 300.0  # an agent's whole run (agent.timeout_s)
    gateway_url: str = ""  # the gateway's OpenAI base URL agents are pointed at ("": no agent rows)
    gateway_secret: bytes = b""  # signs each trajectory's API key (gateway.secret_file's)

    @classmethod
    def from_config(cls, cfg, context: int = 0) -> Rules:
        o = cfg.orchestrator
        return cls(
            max_inflight_groups=o.max_inflight_groups,
            sampler_timeout_s=o.sampler_timeout_s,
            verifier_timeout_s=o.verifier_timeout_s,
            teacher_timeout_s=o.teacher_timeout_s,
            max_staleness=o.max_staleness,
            dynamic_filtering=o.dynamic_filtering,
            overlong_penalty=o.overlong_penalty,
            mask_threshold=o.mask_threshold,
            mopd=cfg.run.algorithm == "mopd",
            env_timeout_s=o.env_timeout_s,
            max_turns=o.max_turns,
            max_total_tokens=o.max_total_tokens,
            context=context,
            agent_timeout_s=cfg.get("agent", {}).get("timeout_s", 300.0),  # older configs: no agents
            gateway_url=cfg.get("gateway", {}).get("base_url", ""),
        )

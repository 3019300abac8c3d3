"""The ``trainer.lora`` section of the launch schema: LoRA RL (learner/lora.py, peft).

    cascade-rl launch tiny trainer.lora.rank=8                       # adapters on the attention and MLP projections
    cascade-rl launch tiny trainer.lora.rank=64 trainer.lora.alpha=128 'trainer.lora.targets=[q_proj,v_proj]'
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraSettings:
    rank: int = 0
    """LoRA rank r; 0 trains the full weights (the paper). With r > 0 only the adapters train, each weight version
    ships only them, and the KL reference is the base with the adapters off."""
    alpha: float = 16.0
    """LoRA alpha: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on each adapter's input (0: the trainer's log-probs are the engine's, as RL needs)."""
    targets: list[str] = field(default_factory=list)
    """Module names the adapters go on (e.g. [q_proj, v_proj]); empty: the attention and MLP projections the model
    has (learner/lora.py DEFAULT_TARGETS). Fused routed experts cannot be targets (learner/lora.py says why)."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"trainer.lora.rank must be >= 0 (0: full fine-tuning), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"trainer.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout}")

"""The launch schema's small fixed choices (supervisor/schema.py): ``StrEnum``s, so OmegaConf refuses any other value
with the list of allowed ones."""

from __future__ import annotations

from enum import StrEnum


class OnBadRow(StrEnum):
    """``data.on_bad_row``."""

    error = "error"  # refuse to launch, listing every bad row
    skip = "skip"  # train without them, counted per reason


class LrDecay(StrEnum):
    """``trainer.lr_decay``: the learning rate after the warm-up (learner/trainer.py ``LR_DECAYS``)."""

    none = "none"  # constant (the paper's RL stages and MOPD)
    cosine = "cosine"  # cosine from lr to 0 at the last step (paper: agentic SWE RL)


class InflightKV(StrEnum):
    """``sampler.inflight_kv``: the running rows' K/V when weights arrive mid-generation (samplers/torch_engine.py)."""

    recompute = "recompute"  # prefilled again under the new weights: each token's log-prob is exactly its version's
    keep = "keep"  # no prefill; later tokens attend to K/V of the old weights


class Progress(StrEnum):
    """``supervisor.progress``: the live display."""

    auto = "auto"  # rich on a terminal, plain lines otherwise
    rich = "rich"
    plain = "plain"
    none = "none"

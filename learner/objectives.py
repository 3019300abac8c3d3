"""The update rules as the trainer applies them, registered by name (``run.algorithm``).

Each objective maps one micro-batch's log-probs to ``(loss, stats)``: the loss is
the micro-batch's share of the step's loss (a mean over its groups or rows; the
trainer scales it by the micro-batch's fraction of the batch), ``stats`` are
detached tensors for logging. The pieces are the pure functions of
learner/losses.py; this module only wires the per-stage options (docs/ARCHITECTURE.md §4):

- grpo: token-level GRPO; each token weighted by ``correction``'s w_t (losses.CORRECTIONS: none | tis | icepop
  | seq_tis | mis | geo_mask); ``kl_coef`` adds β·k3(π_θ‖π_ref); ``entropy_coef`` subtracts c·entropy; all
  three token-averaged per group like the policy term.
- mopd: the reverse-KL distillation loss weighted by ``correction``'s w_t (the paper's: icepop, which
  configs/stage/mopd.yaml sets); teacher log-probs must come with the batch.

Both report ``correction/masked_frac`` and ``correction/truncated_frac``: the loss tokens the correction zeroed
and capped.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from cascade_rl.protocol.registry import Registry

from .losses import CORRECTIONS, correction_stats, group_token_mean, grpo_loss, kl_k3, mopd_loss, mopd_stats

OBJECTIVES = Registry("objective")  # name -> fn(Terms, trainer cfg) -> (loss, stats)


@dataclasses.dataclass
class Terms:
    """One micro-batch, rows ordered group by group; [n, L] tensors are 0 outside ``loss_mask``."""

    logprobs: Tensor  # π_θ, with grad
    entropy: Tensor  # of π_θ's distribution at each token, with grad
    inf_logprobs: Tensor  # the sampler's
    loss_mask: Tensor  # response tokens that carry loss (bool)
    advantages: Tensor  # [n] group-normalised
    group_size: int
    ref_logprobs: Tensor | None = None  # frozen reference, when kl_coef > 0
    teacher_logprobs: Tensor | None = None  # MOPD


def corrected(t: Terms, cfg):
    """``cfg.correction``'s weights for the micro-batch (None for ``none``: the plain loss) and its stats."""
    c = CORRECTIONS[cfg.correction](t.logprobs, t.inf_logprobs, t.loss_mask, (cfg.eps_low, cfg.eps_high),
                                    tuple(cfg.geo_band))
    stats = {f"correction/{k}": v for k, v in correction_stats(c, t.loss_mask).items()}
    return (None if cfg.correction == "none" else c.weights), stats


@OBJECTIVES.register("grpo")
def grpo(t: Terms, cfg) -> tuple[Tensor, dict[str, Tensor]]:
    weights, stats = corrected(t, cfg)
    loss = grpo_loss(t.logprobs, t.advantages, t.loss_mask, t.group_size, weights)
    stats["pg_loss"] = loss.detach()
    if cfg.kl_coef > 0:
        if t.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl = group_token_mean(kl_k3(t.logprobs, t.ref_logprobs), t.loss_mask, t.group_size)
        loss = loss + cfg.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * group_token_mean(t.entropy, t.loss_mask, t.group_size)
    return loss, stats


@OBJECTIVES.register("mopd")
def mopd(t: Terms, cfg) -> tuple[Tensor, dict[str, Tensor]]:
    if t.teacher_logprobs is None:
        raise ValueError("run.algorithm=mopd: the TrainBatch carries no teacher_logprobs")
    weights, stats = corrected(t, cfg)
    if weights is None:
        weights = t.loss_mask.float()
    loss = mopd_loss(t.logprobs, t.teacher_logprobs, t.inf_logprobs, t.loss_mask, weights=weights)
    kl = mopd_stats(t.logprobs, t.teacher_logprobs, t.inf_logprobs, t.loss_mask, cfg.eps_low, cfg.eps_high)
    return loss, {**stats, "mopd/reverse_kl": torch.tensor(kl["reverse_kl"])}

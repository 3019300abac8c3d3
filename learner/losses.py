"""Token-level GRPO as in Nemotron-Cascade 2: pure functions of tensors.

The paper trains strictly on-policy (one gradient step per batch of rollouts),
so the importance ratio is 1 and there is nothing to clip; it also drops the KL
penalty. What remains is REINFORCE with group-normalised rewards, averaged over
tokens within a group:

    Â_{g,i} = (r_{g,i} − mean_i r_{g,·}) / (std_i r_{g,·} + eps)     (sample std, correction=1;
                                                                        Â = 0 if all r_{g,·} are equal)
    L = (1/num_groups) Σ_g  −(1 / Σ_i |y_{g,i}|) Σ_i Σ_t Â_{g,i} · log π(y_{g,i,t} | ·)

so every token of a group weighs the same, and every group weighs the same.
Rows are ordered group by group: rows [g·G, (g+1)·G) belong to group g.

Per-stage options (docs/ARCHITECTURE.md §4): truncated importance weights w_t on the
policy term (``truncated_importance_weights``), a k3 KL penalty to a frozen
reference (``kl_k3``) and an entropy bonus, each token-averaged the same way
(``group_token_mean``). ``mopd_loss`` is the distillation rule: a dense
reverse-KL advantage a_t = log π_teacher − log π_θ per token, weighted by w_t.

Corrections for the engine/trainer mismatch (``trainer.correction``, registered in ``CORRECTIONS``), each
with ρ_t = π_θ/π_inf per loss token and ρ_seq = Π_t ρ_t per row:

    none      w_t = 1
    tis       w_t = min(ρ_t, eps_high)                                   (token-level truncated IS)
    icepop    w_t = ρ_t · 1[eps_low ≤ ρ_t ≤ eps_high]                     (token mask; the paper's MOPD rule)
    seq_tis   w_t = min(ρ_seq, eps_high)                                  (sequence-level truncated IS)
    mis       w_t = ρ_seq · 1[eps_low ≤ ρ_seq ≤ eps_high]                 (sequence mask)
    geo_mask  w_t = 1[geo_low ≤ exp(mean_t log ρ_t) ≤ geo_high]          (geometric-mean sequence mask)

``mismatch_stats`` compares the trainer's log-probs with the inference
engine's, which differ through kernels and precision even at equal weights:

    d = log π_inf − log π_trainer   (per masked token)
    abs_diff_mean = mean |d|,  abs_diff_max = max |d|,  kl_k3 = mean (exp(d) − d − 1)
    outside_band = fraction of tokens whose ratio π_trainer/π_inf = exp(−d) lies outside
                   [0.5, 2.0], the band truncated importance weights keep (docs/ARCHITECTURE.md §4)

Run the hand-computed checks with ``pytest tests/test_losses.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from cascade_rl.protocol.registry import Registry


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages for rewards of shape [num_groups, G]."""
    if rewards.shape[-1] < 2:
        # One sample has no baseline to compare against (and its sample std is NaN).
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, correction=1, keepdim=True)
    adv = (rewards - mean) / (std + eps)
    # A group whose rewards are all equal carries no signal. Its mean can differ from
    # the rewards by a rounding error, which eps would then blow up; so zero it exactly.
    uniform = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(adv), adv)


def group_token_mean(values: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """Mean of ``values [N, T]`` over each group's masked tokens, then over groups (scalar): the
    token-level averaging of every GRPO term. A group with no tokens contributes 0 (and still counts
    in the mean over groups, so micro-batches of whole groups add up to the full batch)."""
    n_rows, length = values.shape
    if group_size < 1 or n_rows % group_size:
        raise ValueError(f"{n_rows} rows do not split into groups of {group_size}")
    num_groups = n_rows // group_size
    keep = mask.bool()
    # where(), not multiply: a padded position may hold -inf, and -inf * 0 = NaN.
    v = torch.where(keep, values, torch.zeros_like(values))
    per_group_sum = v.reshape(num_groups, group_size * length).sum(dim=-1)
    per_group_tokens = keep.reshape(num_groups, group_size * length).sum(dim=-1)
    # An empty group has a zero sum; dividing it by 1 instead of 0 keeps it 0, not NaN.
    return (per_group_sum / per_group_tokens.clamp(min=1).to(v.dtype)).mean()


def grpo_loss(logprobs: Tensor, advantages: Tensor, mask: Tensor, group_size: int,
              weights: Tensor | None = None) -> Tensor:
    """Token-level GRPO loss (scalar) for logprobs [N, T], advantages [N], mask [N, T].

    N must be a multiple of ``group_size``; rows are ordered group by group. The
    gradient wrt logprobs[i, t] is −w[i, t] · Â_i · mask[i, t] / (tokens in i's group · num_groups),
    with ``weights`` w the (detached) truncated importance weights, or 1.
    A group with no tokens contributes 0.
    """
    lp = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
    term = advantages.to(lp.dtype).unsqueeze(-1) * lp
    if weights is not None:
        term = weights.detach().to(lp.dtype) * term
    return -group_token_mean(term, mask, group_size)


def truncated_importance_weights(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, eps_low: float = 0.5,
                                 eps_high: float = 2.0) -> tuple[Tensor, Tensor]:
    """w_t = sg[r_t] · 1[eps_low ≤ r_t ≤ eps_high] with r_t = π_θ / π_inf = exp(log π_θ − log π_inf).

    Returns (w [N, T], truncated [N, T] bool: masked tokens whose ratio fell outside the band).
    Masked-out positions get w = 0 whatever they hold."""
    keep = mask.bool()
    ratio = torch.exp(torch.where(keep, logprobs.detach().float() - inf_logprobs.float(), torch.zeros_like(
        inf_logprobs, dtype=torch.float32)))
    inside = (ratio >= eps_low) & (ratio <= eps_high)
    w = torch.where(keep & inside, ratio, torch.zeros_like(ratio))
    return w, keep & ~inside


# --- corrections for the engine/trainer mismatch (``trainer.correction``) --------------------------------------


class Correction(NamedTuple):
    """What a correction makes of one micro-batch: per-token weights on the policy term, and which loss tokens it
    zeroed (``masked``) or capped (``truncated``); every tensor [N, T], 0 / False outside the mask."""

    weights: Tensor  # float32, detached
    masked: Tensor  # bool
    truncated: Tensor  # bool


# name -> fn(logprobs, inf_logprobs, mask, band=(eps_low, eps_high), geo_band=(low, high)) -> Correction
CORRECTIONS = Registry("correction")


def _log_ratio(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(log π_θ − log π_inf detached in fp32, 0 outside the mask; the mask as bool)."""
    keep = mask.bool()
    d = logprobs.detach().float() - inf_logprobs.float()
    return torch.where(keep, d, torch.zeros_like(d)), keep


def _per_row(values: Tensor, keep: Tensor) -> Tensor:
    """A per-row [N] value on each of the row's loss tokens, [N, T] (0 elsewhere)."""
    return torch.where(keep, values[:, None].expand_as(keep), torch.zeros((), device=keep.device))


@CORRECTIONS.register("none")
def no_correction(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0), geo_band=(0.99, 1.01)
                  ) -> Correction:
    """w_t = 1: strictly on-policy, trusting the engine and the trainer to agree."""
    keep = mask.bool()
    none = torch.zeros_like(keep)
    return Correction(keep.float(), none, none)


@CORRECTIONS.register("tis")
def token_tis(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0), geo_band=(0.99, 1.01)
              ) -> Correction:
    """Token-level truncated IS (Yao et al. 2025): w_t = min(ρ_t, eps_high), ρ_t = π_θ/π_inf; no token dropped."""
    d, keep = _log_ratio(logprobs, inf_logprobs, mask)
    cap = math.log(band[1])
    w = torch.where(keep, torch.exp(d.clamp(max=cap)), torch.zeros_like(d))
    return Correction(w, torch.zeros_like(keep), keep & (d > cap))


@CORRECTIONS.register("icepop")
def token_band_mask(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0), geo_band=(0.99, 1.01)
                    ) -> Correction:
    """Token-level masking (IcePop; the paper's MOPD weights): w_t = ρ_t inside [eps_low, eps_high], 0 outside."""
    w, outside = truncated_importance_weights(logprobs, inf_logprobs, mask, band[0], band[1])
    return Correction(w, outside, torch.zeros_like(outside))


@CORRECTIONS.register("seq_tis")
def sequence_tis(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0), geo_band=(0.99, 1.01)
                 ) -> Correction:
    """Sequence-level truncated IS: ρ_seq = Π_t ρ_t over the row's loss tokens, every token of the row weighted
    min(ρ_seq, eps_high) (computed in log space: a long row's product neither overflows nor underflows to NaN)."""
    d, keep = _log_ratio(logprobs, inf_logprobs, mask)
    cap = math.log(band[1])
    seq = d.sum(dim=-1)
    w = _per_row(torch.exp(seq.clamp(max=cap)), keep)
    return Correction(w, torch.zeros_like(keep), keep & (seq > cap)[:, None])


@CORRECTIONS.register("mis")
def sequence_band_mask(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0),
                       geo_band=(0.99, 1.01)) -> Correction:
    """Sequence-level masked IS: every token of a row weighted ρ_seq when ρ_seq lies in [eps_low, eps_high], the
    whole row dropped (w = 0) when it does not."""
    d, keep = _log_ratio(logprobs, inf_logprobs, mask)
    seq = d.sum(dim=-1)
    inside = (seq >= math.log(band[0])) & (seq <= math.log(band[1]))
    w = _per_row(torch.where(inside, torch.exp(seq.clamp(max=math.log(band[1]))), torch.zeros_like(seq)), keep)
    return Correction(w, keep & ~inside[:, None], torch.zeros_like(keep))


@CORRECTIONS.register("geo_mask")
def geometric_mask(logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor, band=(0.5, 2.0), geo_band=(0.99, 1.01)
                   ) -> Correction:
    """Geometric-mean sequence mask: ρ_geo = exp(mean_t log ρ_t) over the row's loss tokens (a per-token ratio that
    does not grow with length); rows with ρ_geo outside ``geo_band`` are dropped, the others weighted 1."""
    d, keep = _log_ratio(logprobs, inf_logprobs, mask)
    geo = d.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1)
    inside = (geo >= math.log(geo_band[0])) & (geo <= math.log(geo_band[1]))
    w = _per_row(inside.float(), keep)
    return Correction(w, keep & ~inside[:, None], torch.zeros_like(keep))


def correction_stats(c: Correction, mask: Tensor) -> dict[str, Tensor]:
    """The fractions of loss tokens a correction zeroed and capped (detached scalars)."""
    n = mask.bool().sum().clamp(min=1)
    return {"masked_frac": c.masked.sum() / n, "truncated_frac": c.truncated.sum() / n}


def mopd_loss(logprobs: Tensor, teacher_logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor,
              eps_low: float = 0.5, eps_high: float = 2.0, weights: Tensor | None = None) -> Tensor:
    """Multi-domain on-policy distillation (docs/ARCHITECTURE.md §4), a scalar:

        a_t = log π_teacher − log π_θ          (the reverse-KL token advantage, stop-gradient)
        L   = mean over rows of −(1/|V(y)|) Σ_{t∈V(y)} w_t · sg[a_t] · log π_θ

    with w_t the truncated importance weights (or ``weights``: another correction's). The gradient wrt
    logprobs[i, t] is −w[i, t] · a[i, t] / (|V(y_i)| · N). A row with no valid tokens contributes 0 (and counts in N).
    """
    keep = mask.bool()
    w = weights if weights is not None else truncated_importance_weights(logprobs, inf_logprobs, mask, eps_low,
                                                                         eps_high)[0]
    zeros = torch.zeros_like(logprobs)
    advantage = torch.where(keep, teacher_logprobs.to(logprobs.dtype) - logprobs.detach(), zeros)
    term = torch.where(keep, w.to(logprobs.dtype) * advantage * logprobs, zeros)
    per_row = term.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    return -per_row.mean()


def mopd_stats(logprobs: Tensor, teacher_logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor,
               eps_low: float = 0.5, eps_high: float = 2.0) -> dict[str, float]:
    """Per-step MOPD metrics: ``reverse_kl`` = mean over valid tokens of −a_t = log π_θ − log π_teacher
    (a single-sample estimate of KL(π_θ‖π_teacher)), and ``truncated_frac`` of tokens with w_t = 0
    because their ratio left [eps_low, eps_high]. Python floats: call for logging only."""
    keep = mask.bool()
    if not keep.any():
        return {"reverse_kl": 0.0, "truncated_frac": 0.0}
    _, truncated = truncated_importance_weights(logprobs, inf_logprobs, mask, eps_low, eps_high)
    neg_adv = (logprobs.detach().float() - teacher_logprobs.float())[keep]
    return {"reverse_kl": neg_adv.mean().item(), "truncated_frac": truncated[keep].float().mean().item()}


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ‖π_ref) (Schulman): exp(d) − d − 1 with d = log π_ref − log π_θ;
    non-negative, unbiased under samples from π_θ, differentiable through log π_θ."""
    d = ref_logprobs.detach().to(logprobs.dtype) - logprobs
    return torch.expm1(d) - d


BAND = (0.5, 2.0)  # the truncation band of importance ratios (eps_low, eps_high)


def mismatch_stats(trainer_logprobs: Tensor, inf_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the inference engine's log-probs are from the trainer's, over masked tokens.

    With d = inf − trainer, ``kl_k3`` = mean(exp(d) − d − 1) is Schulman's k3 estimator
    with ratio π_inf/π_trainer: non-negative per token and ≈ d²/2 for small d. Strictly
    it is unbiased for KL(π_trainer‖π_inf) under samples from π_trainer; the tokens here
    were sampled by the inference engine, so read it as a mismatch size, not an exact KL.

    Returns Python floats: each ``.item()`` is a device sync, so call it for logging only.
    """
    keep = mask.bool()
    if not keep.any():
        return {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "kl_k3": 0.0, "outside_band": 0.0}
    d = (inf_logprobs.detach().float() - trainer_logprobs.detach().float())[keep]
    ratio = torch.exp(-d)
    return {
        "abs_diff_mean": d.abs().mean().item(),
        "abs_diff_max": d.abs().max().item(),
        "kl_k3": (torch.expm1(d) - d).mean().item(),
        "outside_band": ((ratio < BAND[0]) | (ratio > BAND[1])).float().mean().item(),
    }

"""One optimizer step, built of parts: whole groups in, gradients accumulated, one update out.

    step = Step(policy, optimizer, cfg.trainer, version, reference, run=cfg.run, groups=16)
    step.add(part)            # as each part of the step arrives (orchestrator.stream_tokens): forward + backward
    step.add(last_part)
    metrics = step.finish()   # clip, optimizer step, the step's metrics

A step's loss is a mean over its groups (learner/objectives.py: every term is token-averaged per group, then
averaged over groups; the advantages are each group's own), so a part of k groups adds ``k / groups`` of the
step's gradient whatever else the step holds: the same update whether the groups came in one batch or in parts,
in any order (bit for bit when the parts are the same micro-batches in the same order). ``groups`` is this rank's
share of the step (its groups over every part): each rank steps on its own rows, FSDP2 averages the gradients.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch

from .losses import group_advantages, group_token_mean, mismatch_stats
from .objectives import OBJECTIVES, Terms
from .optim import clip_grad_norm_
from .segments import forward_rows

# after the warm-up: the fraction of lr at progress p in [0, 1) of the remaining steps (trainer.lr_decay)
LR_DECAYS = {
    "none": lambda p: 1.0,  # constant: the paper's RL stages and MOPD
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),  # to 0 at the last step: agentic SWE RL (paper §4.8)
}


def lr_at(step: int, cfg, steps: int) -> float:
    """Linear warm-up from warmup_start_lr to lr over warmup_steps, then lr times ``LR_DECAYS[cfg.lr_decay]``
    of the progress through the steps left of ``steps`` (constant by default: the paper's schedule)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.warmup_start_lr + (cfg.lr - cfg.warmup_start_lr) * step / cfg.warmup_steps
    left = max(1, steps - cfg.warmup_steps)
    return cfg.lr * LR_DECAYS[cfg.lr_decay]((step - cfg.warmup_steps) / left)


class Step:
    """The optimizer step ``step`` of ``run.algorithm`` with the ``trainer`` section ``cfg``, over ``groups``
    groups (this rank's), fed in parts (``add``) and taken once (``finish``)."""

    def __init__(self, policy, optimizer, cfg, step: int, reference=None, *, run, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"a step of {groups} groups")
        self.policy, self.optimizer, self.cfg, self.reference = policy, optimizer, cfg, reference
        self.objective = OBJECTIVES[run.algorithm]
        self.groups, self.seen = groups, 0
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, run.steps)
        self.sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
        self.counts: dict = defaultdict(int)  # summed over rows or groups (tensors: no device sync before finish)
        self.mismatch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (trainer, engine) log-probs of loss tokens
        self.compute_s = 0.0  # forward and backward of the parts (``add``)

    def add(self, batch) -> None:
        """Forward and backward of ``batch`` (a ``Part`` or a ``Batch`` of whole groups, learner/batch.py), in
        micro-batches of ``cfg.micro_batch_groups`` groups, each padded to its own longest row; its gradients
        add to the step's."""
        t0 = time.perf_counter()
        n_groups = len(batch.rewards) // batch.group_size
        if self.seen + n_groups > self.groups:
            raise ValueError(f"parts of {self.seen + n_groups} groups for a step of {self.groups}")
        self.seen += n_groups
        advantages = group_advantages(batch.rewards.view(-1, batch.group_size)).flatten()
        self.policy.train()
        for rows in batch.groups(self.cfg.micro_batch_groups):
            weight = (rows.stop - rows.start) // batch.group_size / self.groups  # the micro-batch's share of the step
            mb = batch.rows(rows)
            logprobs, entropy = forward_rows(self.policy, mb.input_ids, mb.lengths, mb.response_mask,
                                             mb.segment_starts, mb.routes, with_entropy=True)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = forward_rows(self.reference, mb.input_ids, mb.lengths, mb.response_mask,
                                          mb.segment_starts, mb.routes)
            loss, stats = self.objective(Terms(logprobs, entropy, mb.inf_logprobs, mb.loss_mask, advantages[rows],
                                               batch.group_size, ref, mb.teacher_logprobs), self.cfg)
            (loss * weight).backward()
            stats["loss"] = loss.detach()
            stats["entropy"] = group_token_mean(entropy.detach(), mb.loss_mask, batch.group_size)
            for k, v in stats.items():
                self.sums[k] = self.sums[k].to(v.device) + v.detach().float() * weight
            keep = mb.response_mask
            self.mismatch.append((logprobs.detach()[keep], mb.inf_logprobs[keep]))
            self._count(response_tokens=keep.sum(), masked_rows=(keep.any(1) & ~mb.loss_mask.any(1)).sum())
        per_group = advantages.view(-1, batch.group_size)
        self._count(rewards=batch.rewards.sum(), advantages_abs=advantages.abs().sum(), rows=len(batch.rewards),
                    zero_adv_groups=(per_group == 0).all(dim=1).sum(), tokens=batch.lengths.sum())
        self.compute_s += time.perf_counter() - t0

    def _count(self, **values) -> None:
        for k, v in values.items():
            self.counts[k] = self.counts[k] + v

    @property
    def complete(self) -> bool:
        return self.seen == self.groups

    def finish(self) -> dict[str, float]:
        """Clip, step the optimizer, zero the gradients; the step's metrics (Python floats: the ``.item()`` calls
        here are the step's only device syncs)."""
        if not self.complete:
            raise ValueError(f"the step took {self.seen} of its {self.groups} groups")
        grad_norm = clip_grad_norm_(self.policy, self.optimizer, self.cfg.max_grad_norm)  # fp32 accumulated grads
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        trainer_lp = torch.cat([t for t, _ in self.mismatch])[None]
        inf_lp = torch.cat([i for _, i in self.mismatch])[None]
        mismatch = mismatch_stats(trainer_lp, inf_lp, torch.ones_like(inf_lp, dtype=torch.bool))
        c = {k: float(v) for k, v in self.counts.items()}
        metrics = {
            **{k: v.item() for k, v in self.sums.items()},
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "reward_mean": c["rewards"] / c["rows"],
            "advantage_abs_mean": c["advantages_abs"] / c["rows"],
            "response_tokens": int(c["response_tokens"]),
            "zero_adv_groups": int(c["zero_adv_groups"]),
            "masked_rows": int(c["masked_rows"]),
            **{f"mismatch/{k}": v for k, v in mismatch.items()},
            **routing_stats(self.policy),
        }
        return metrics

    @property
    def tokens(self) -> int:
        """Tokens of every row this rank trained in the step (prompt + response)."""
        return int(self.counts["tokens"])  # a device sync: after finish


def routing_stats(policy) -> dict[str, float]:
    """MoE routes the step compared with the engine's: ``routing/disagree_frac``, the fraction of (token, layer)
    routes whose expert set the trainer's own router picks otherwise (replayed or not), and how many were
    compared; nothing when the batch carried no routes."""
    replay = getattr(policy, "replay", None)
    stats = replay.take_stats() if replay is not None else {"routes": 0}
    if not int(stats["routes"]):
        return {}
    return {"routing/disagree_frac": float(stats["disagree"]) / int(stats["routes"]),
            "routing/routes": int(stats["routes"])}

"""Trainer: TrainBatches in, GRPO steps, weights and checkpoints out.

    python -m cascade_rl.learner.trainer --config RUN_DIR/config.yaml --worker-id trainer-0

The model is an HF causal LM loaded from ``model.path`` (policy version 0).
Each ``TrainBatch`` is one optimizer step (version + 1): per-token log-probs
of the response tokens at the sampling temperature, group-normalised
advantages, the token-level GRPO loss (learner/losses.py), AdamW with a
linear warm-up and grad-norm clipping. After the step the new weights are
published through the weight transport (``WeightsReady`` on the PUB socket,
and to the orchestrator so it can hand them to late samplers), then
``StepDone`` carries the step's metrics. Checkpoints are HF directories.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.protocol.messages import Ready, StepDone, TrainBatch
from cascade_rl.protocol.sockets import WorkerLink, send
from cascade_rl.protocol.worker_main import worker_start

from .losses import group_advantages, grpo_loss, mismatch_stats, token_logprobs
from .weights import TRANSPORTS

log = logging.getLogger("trainer")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Batch:
    """A TrainBatch as tensors; rows ordered group by group, right-padded."""

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    response_mask: torch.Tensor  # [N, L] bool
    inf_logprobs: torch.Tensor  # [N, L]
    rewards: torch.Tensor  # [N]
    group_size: int

    @classmethod
    def from_message(cls, msg: TrainBatch) -> Batch:
        response_mask = torch.from_numpy(msg.response_mask.copy())
        positions = torch.arange(response_mask.shape[1])
        # real tokens end with each row's last response token (rows are right-padded)
        lengths = torch.where(response_mask, positions + 1, 0).amax(dim=1)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        return cls(
            input_ids=torch.from_numpy(msg.input_ids.astype("int64")),
            attention_mask=attention_mask,
            response_mask=response_mask,
            inf_logprobs=torch.from_numpy(msg.inf_logprobs.copy()),
            rewards=torch.from_numpy(msg.rewards.copy()),
            group_size=msg.group_size,
        )

    def groups(self, per_chunk: int):
        """Micro-batches of whole groups: (row slice, fraction of all groups)."""
        n_groups = len(self.rewards) // self.group_size
        per_chunk = per_chunk or n_groups
        for g0 in range(0, n_groups, per_chunk):
            g1 = min(n_groups, g0 + per_chunk)
            yield slice(g0 * self.group_size, g1 * self.group_size), (g1 - g0) / n_groups


def lr_at(step: int, cfg) -> float:
    """Linear warm-up from warmup_start_lr to lr over warmup_steps, then constant (the paper's schedule)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.warmup_start_lr + (cfg.lr - cfg.warmup_start_lr) * step / cfg.warmup_steps
    return cfg.lr


def train_step(model, optimizer, batch: Batch, cfg, temperature: float, step: int) -> dict[str, float]:
    """One GRPO optimizer step; returns its metrics (Python floats: one sync at the end)."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    advantages = group_advantages(batch.rewards.view(-1, batch.group_size)).flatten()
    model.train()
    total_loss, trainer_lp = 0.0, torch.zeros_like(batch.inf_logprobs)
    for rows, weight in batch.groups(cfg.micro_batch_groups):
        logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits
        logprobs = token_logprobs(logits, batch.input_ids[rows], temperature=temperature)
        loss = grpo_loss(logprobs, advantages[rows], batch.response_mask[rows], batch.group_size) * weight
        loss.backward()
        total_loss += loss.item()
        trainer_lp[rows] = logprobs.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mismatch = mismatch_stats(trainer_lp, batch.inf_logprobs, batch.response_mask)
    return {
        "loss": total_loss,
        "grad_norm": float(grad_norm),
        "lr": optimizer.param_groups[0]["lr"],
        "reward_mean": float(batch.rewards.mean()),
        "response_tokens": int(batch.response_mask.sum()),
        "zero_adv_groups": int((advantages.view(-1, batch.group_size) == 0).all(dim=1).sum()),
        **{f"mismatch/{k}": v for k, v in mismatch.items()},
    }


def save_checkpoint(model, tokenizer, run_dir: Path, step: int) -> Path:
    out = run_dir / "checkpoints" / f"step_{step:06d}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    # --- config and init
    args, cfg = worker_start(__doc__.splitlines()[0], argv, default_id="trainer-0")
    tcfg, run_dir = cfg.trainer, Path(cfg.run_dir)
    torch.manual_seed(tcfg.seed)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)

    # --- model, tokenizer, optimizer
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=DTYPES[cfg.model.dtype])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0, tcfg), betas=tuple(tcfg.betas),
                                  weight_decay=tcfg.weight_decay)

    # --- sockets: weights PUB (bound here), link to the orchestrator
    transport = TRANSPORTS[cfg.weights_transport](run_id=cfg.run_id)
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(cfg.endpoints.weights)
    state = {"state": "waiting", "version": 0, "counters": {"steps": 0, "train_s": 0.0}}
    link = WorkerLink(args.worker_id, "trainer", cfg.endpoints.orchestrator, cfg.endpoints.get("heartbeat"), None,
                      expect=(TrainBatch,), status=lambda: state, heartbeat_s=cfg.supervisor.heartbeat_s).start()
    link.send(Ready(args.worker_id, "trainer", slots=1, version=0))

    # --- loop: one TrainBatch = one optimizer step = one policy version
    version = 0
    try:
        while version < tcfg.steps:
            msg: TrainBatch = link.inbox.get()
            state["state"] = "training"
            t0 = time.perf_counter()
            metrics = train_step(model, optimizer, Batch.from_message(msg), tcfg, cfg.sampling.temperature, version)
            version += 1
            notice = transport.publish(model, version)
            send(pub, notice)  # samplers apply it at their next safe point
            link.send(notice)  # the orchestrator forwards it to samplers that join late
            checkpoint = ""
            if version == tcfg.steps or (tcfg.save_every and version % tcfg.save_every == 0):
                checkpoint = str(save_checkpoint(model, tokenizer, run_dir, version))
            metrics["train_s"] = time.perf_counter() - t0
            state.update(state="waiting", version=version)
            state["counters"] = {"steps": version, "train_s": state["counters"]["train_s"] + metrics["train_s"]}
            link.send(StepDone(step=msg.step, version=version, metrics=metrics, checkpoint=checkpoint))
            log.info("step %d: loss %.4f reward %.3f grad_norm %.3f (%.2fs)", version, metrics["loss"],
                     metrics["reward_mean"], metrics["grad_norm"], metrics["train_s"])
        state["state"] = "done"
        # keep serving heartbeats until the supervisor stops us, so the final weights stay readable
        while True:
            time.sleep(3600)
    finally:
        link.close()
        transport.close()


if __name__ == "__main__":
    main()

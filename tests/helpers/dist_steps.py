"""Two GRPO steps of the trainer on a fixed batch, on as many ranks as torchrun started (or one).

    torchrun --nproc-per-node 2 tests/helpers/dist_steps.py MODEL_DIR OUT.safetensors [bfloat16]
    python tests/helpers/dist_steps.py MODEL_DIR OUT.safetensors [bfloat16]          # one rank
    DIST_STEPS_CHECKPOINTING=1 torchrun ...       # the policy with activation checkpointing (the resume too)
    DIST_STEPS_CP=2 torchrun ...                  # context parallelism: the ranks split each sequence, not the batch
    DIST_STEPS_PARTS=2 torchrun ...               # each step's groups in 2 parts (orchestrator.stream_tokens)

Writes the final weights (rank 0) and a report next to them (OUT.json: the per-step metrics; the checksums
of the weights published as the trainer does and as one rank would; the largest difference between the
last step taken and the same step resumed from a checkpoint written before it); used by
tests/test_parallel.py to compare 2 ranks with 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from cascade_rl.learner import parallel
from cascade_rl.learner.optim import MasterAdamW
from cascade_rl.learner.step import Step
from cascade_rl.learner.trainer import Batch, load_state, publish, save_state, strip_prefix, train_step
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.rows import from_padded
from cascade_rl.weights.layout import unshared
from cascade_rl.weights.shm import ShmTransport


def batch(step: int) -> Batch:
    rng = np.random.default_rng(step)
    groups, g, prompt, resp = 4, 4, 6, 10
    n = groups * g
    ids = rng.integers(5, 300, size=(n, prompt + resp)).astype(np.int32)
    mask = np.zeros((n, prompt + resp), bool)
    mask[:, prompt:] = True
    for i in range(n):  # ragged responses
        mask[i, prompt + 1 + i % resp:] = False
    rewards = rng.integers(0, 2, size=n).astype(np.float32)
    inf = -rng.random((n, prompt + resp)).astype(np.float32)
    return Batch.from_message(from_padded(step=step, group_size=g, input_ids=ids, response_mask=mask, inf_logprobs=inf,
                                              rewards=rewards, versions=np.zeros(n, np.int32)))


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = parallel.init(world, context_parallel=int(os.environ.get("DIST_STEPS_CP", "1")))
    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(algorithm="grpo", lr=1e-3, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0,
                                micro_batch_groups=1, correction="icepop", geo_band=[0.99, 1.01], eps_low=0.5, eps_high=2.0,
                                kl_coef=0.0, entropy_coef=0.01, steps=100, lr_decay="none"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    checkpointing = os.environ.get("DIST_STEPS_CHECKPOINTING") == "1"
    policy = parallel.parallelize(Policy(model, temperature=1.0, chunk_tokens=7, pack=True,
                                         activation_checkpointing=checkpointing, context_parallel=ranks.context),
                                  ranks)
    optimizer = MasterAdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)  # the trainer's
    metrics = []
    for step in range(2):
        if step == 1:  # a checkpoint before the last step: resumed below, it must take the same step
            ckpt = save_state(policy, optimizer, None, Path(out + ".run"), step, {}, ranks)
        metrics.append(parallel.reduce_metrics(train(policy, optimizer, step, ranks, cfg), ranks))
    state = parallel.full_state_dict(policy, ranks)
    held = parallel.full_state_dict(policy, ranks, master=True)
    report = {"metrics": metrics, "published": published(policy, ranks, model_dir, dtype)}

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)  # what trainer.build does on resume
    resumed = parallel.parallelize(Policy(model, temperature=1.0, chunk_tokens=7, pack=True,
                                          activation_checkpointing=checkpointing, context_parallel=ranks.context),
                                   ranks)
    opt2 = MasterAdamW(resumed.parameters(), lr=cfg.lr, weight_decay=0.0)
    load_state(Path(ckpt), resumed, opt2, ranks)
    train(resumed, opt2, 1, ranks, cfg)
    again = parallel.full_state_dict(resumed, ranks, master=True)
    if ranks.main:
        report["resume_max_diff"] = max((held[k].float() - again[k].float()).abs().max().item() for k in held)
        report["held_dtypes"] = sorted({str(v.dtype) for v in held.values()})
        save_file(unshared(strip_prefix(state)), out)
        with open(out + ".json", "w") as f:
            json.dump(report, f)
    parallel.close(ranks)


def train(policy, optimizer, step: int, ranks, cfg) -> dict:
    """Step ``step`` on this rank's rows: the whole batch (``train_step``), or with DIST_STEPS_PARTS=k its groups in
    k parts, each split among the ranks as the trainer splits a part (``Step``)."""
    parts = int(os.environ.get("DIST_STEPS_PARTS", "1"))
    if parts == 1:
        return train_step(policy, optimizer, my_rows(step, ranks), cfg, step, run=cfg)
    b = batch(step)
    n, g = len(b.rewards) // b.group_size, b.group_size
    one = Step(policy, optimizer, cfg, step, run=cfg, groups=n // ranks.dp_size)
    per = n // parts
    for p in range(parts):
        part = b.rows(slice(p * per * g, (p + 1) * per * g))
        one.add(part.rows(shard_rows(per, g, ranks)))
    return one.finish()


def my_rows(step: int, ranks) -> Batch:
    b = batch(step)
    return b.rows(shard_rows(len(b.rewards) // b.group_size, b.group_size, ranks))


def shard_rows(n_groups: int, group_size: int, ranks) -> slice:
    """This rank's rows, as the orchestrator would send them here: a contiguous, equal share of whole groups (the
    ranks of one context-parallel group: the same share)."""
    per_rank = n_groups // ranks.dp_size
    return slice(ranks.dp_rank * per_rank * group_size, (ranks.dp_rank + 1) * per_rank * group_size)


def published(policy, ranks, model_dir: str, dtype) -> dict | None:
    """Publish through shm as the trainer does (FSDP2: one parameter gathered at a time) and, on rank 0, the
    gathered weights in an unsharded HF model as one rank publishes it: the two files' sizes and checksums."""
    transport = ShmTransport(f"dist-steps-{os.getpid()}") if ranks.main else None
    notice = publish(transport, policy, ranks, 1)
    full = parallel.full_state_dict(policy, ranks)
    if not ranks.main:
        return None
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    ref.load_state_dict(strip_prefix(full), strict=True)
    other = transport.publish(ref, 2)
    transport.close()
    return {"gathered": [notice.nbytes, notice.checksum], "module": [other.nbytes, other.checksum]}


if __name__ == "__main__":
    main()

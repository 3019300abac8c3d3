"""Two GRPO steps of the trainer on a fixed batch, on as many ranks as torchrun started (or one).

    torchrun --nproc-per-node 2 tests/helpers/dist_steps.py MODEL_DIR OUT.safetensors [bfloat16]
    python tests/helpers/dist_steps.py MODEL_DIR OUT.safetensors [bfloat16]          # one rank

Writes the final weights (rank 0) and the per-step metrics next to them (OUT.json); used by
tests/test_parallel.py to compare 2 ranks with 1.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from cascade_rl.learner import parallel
from cascade_rl.learner.optim import MasterAdamW
from cascade_rl.learner.trainer import Batch, strip_prefix, train_step
from cascade_rl.learner.weights import unshared
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.messages import TrainBatch


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
    return Batch.from_message(TrainBatch(step, g, ids, mask, inf, rewards, np.zeros(n, np.int32)))


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = parallel.init(world)
    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(algorithm="grpo", lr=1e-3, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0,
                                micro_batch_groups=1, correction="icepop", geo_band=[0.99, 1.01], eps_low=0.5, eps_high=2.0,
                                kl_coef=0.0, entropy_coef=0.01, steps=100, lr_decay="none"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    policy = parallel.parallelize(Policy(model, temperature=1.0, chunk_tokens=7, pack=True), ranks)
    optimizer = MasterAdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)  # the trainer's
    metrics = []
    for step in range(2):
        b = batch(step)
        b = b.rows(parallel.shard_rows(len(b.rewards) // b.group_size, b.group_size, ranks))
        metrics.append(parallel.reduce_metrics(train_step(policy, optimizer, b, cfg, step), ranks))
    state = parallel.full_state_dict(policy, ranks)
    if ranks.main:
        save_file(unshared(strip_prefix(state)), out)
        with open(out + ".json", "w") as f:
            json.dump(metrics, f)
    parallel.close(ranks)


if __name__ == "__main__":
    main()

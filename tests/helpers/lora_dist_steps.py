"""Two LoRA GRPO steps of the trainer (``trainer.lora.rank=8``, built by ``learner.trainer.build``) on the batch of
dist_steps.py, on as many ranks as torchrun started (or one); then the last step again, resumed from a checkpoint
written before it.

    torchrun --nproc-per-node 2 tests/helpers/lora_dist_steps.py MODEL_DIR OUT.safetensors [bfloat16]
    DIST_STEPS_CP=2 torchrun ...                  # context parallelism: the ranks split each sequence, not the batch

Writes the adapter after the two steps (rank 0, peft's names) and OUT.json: the metrics, the published adapter's
bytes and checksum, and the largest difference between the last step taken and the same step resumed. Used by
tests/test_lora_trainer.py to compare 2 ranks (FSDP2) with 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from cascade_rl.learner import lora, parallel
from cascade_rl.learner.trainer import build, publish, save_state, train_step
from cascade_rl.supervisor.config import compose
from cascade_rl.weights.shm import ShmTransport

sys.path.insert(0, str(Path(__file__).parent))
from dist_steps import my_rows  # noqa: E402


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp = int(os.environ.get("DIST_STEPS_CP", "1"))
    ranks = parallel.init(world, context_parallel=cp)
    run_dir = Path(out + ".run")

    def config(*extra):
        return compose("tiny", [f"model.path={model_dir}", f"run_dir={run_dir}", "trainer.lora.rank=8",
                                "trainer.lr=1e-2", "trainer.micro_batch_groups=1", "trainer.correction=icepop",
                                "trainer.entropy_coef=0.01", "trainer.kl_coef=0.01", f"trainer.world_size={world}", f"trainer.context_parallel={cp}",
                                f"model.dtype={dtype}", "run.prompts_per_step=4", *extra], check=False)

    torch.manual_seed(0)
    cfg = config()
    policy, reference, optimizer, tokenizer, _ = build(cfg, ranks)
    metrics = []
    for step in range(2):
        if step == 1:
            save_state(policy, optimizer, tokenizer, run_dir, step, {}, ranks)
        metrics.append(parallel.reduce_metrics(
            train_step(policy, optimizer, my_rows(step, ranks), cfg.trainer, step, reference, run=cfg.run), ranks))
    adapter = lora.AdapterSource(policy).state_dict()
    transport = ShmTransport(f"lora-dist-{os.getpid()}") if ranks.main else None
    notice = publish(transport, policy, ranks, 2)

    resumed, reference, opt2, _, state = build(config("run.resume_from=latest"), ranks)
    train_step(resumed, opt2, my_rows(1, ranks), cfg.trainer, state["step"], reference, run=cfg.run)
    again = lora.AdapterSource(resumed).state_dict()
    if ranks.main:
        transport.close()
        report = {"metrics": metrics, "published": [notice.nbytes, notice.checksum], "resumed_step": state["step"],
                  "resume_max_diff": max((adapter[k] - again[k]).abs().max().item() for k in adapter),
                  "frozen_dtypes": sorted({str(p.dtype) for n, p in policy.named_parameters() if ".lora_" not in n})}
        save_file(adapter, out)
        with open(out + ".json", "w") as f:
            json.dump(report, f)
    parallel.close(ranks)


if __name__ == "__main__":
    main()

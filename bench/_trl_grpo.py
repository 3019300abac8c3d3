"""TRL's GRPOTrainer on bench/vs_trl.py's setup; runs inside the TRL virtual environment that vs_trl.py builds.

    .venv-trl/bin/python bench/_trl_grpo.py --model DIR --prompts P.jsonl --steps 20 --out run.json

``P.jsonl`` holds one prompt per line, ``{"question": ..., "answer": ..., "prompt_ids": [...]}``, in the order
cascade-rl's orchestrator draws them, ``steps * prompts_per_step`` lines: with ``shuffle_dataset=False`` TRL
trains step k on the same 8 prompts as cascade-rl's step k. ``prompt_ids`` are cascade-rl's own tokenisation
(``tasks.prompt_ids``); this script checks TRL's chat templating gives the same ids before it trains.

The reward is cascade-rl's strict boxed-answer math reward (``verifiers.math.score_math``), given the text
exactly as cascade-rl's orchestrator gives it: the thinking-mode generation prompt ``<think>\\n`` followed by
the decoded completion. Per step this records wall time, generation time and tokens (``_generate_single_turn``
timed), reward time, and the mean reward; the process's peak RSS is ``ru_maxrss``. Not part of the project:
TRL is never one of its dependencies.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from cascade_rl.verifiers.math import score_math


def boxed_math(completions, answer, **_) -> list[float]:
    return [score_math("<think>\n" + c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]


class StepClock(TrainerCallback):
    """Wall time of every optimizer step: from the end of the previous step (the first: from its start) to
    the end of this one, so generation, scoring, loss, backward, update and TRL's logging all count."""

    def __init__(self):
        self.last, self.steps = 0.0, []

    def on_step_begin(self, args, state, control, **kw):
        self.last = self.last or time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.steps.append(now - self.last)
        self.last = now


def timed(trainer: GRPOTrainer, name: str, log: list, count=None):
    """Wrap ``trainer.<name>`` so that every call appends (seconds, count(result)) to ``log``."""
    inner = getattr(trainer, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        log.append((time.perf_counter() - t, count(out) if count else 0))
        return out

    setattr(trainer, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TRL's default; off by default here (a tiny model fits, and recomputation only costs time)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)

    rows = [json.loads(line) for line in open(args.prompts)]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for r in rows[:16]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        if list(ids) != r["prompt_ids"]:
            raise SystemExit(f"TRL's prompt ids differ from cascade-rl's:\n{list(ids)}\n{r['prompt_ids']}")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                              for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    batch = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=args.out + ".trainer", use_cpu=True, bf16=False, fp16=False, use_vllm=False, report_to="none",
        # one optimizer step per 8 x 8 rollouts, all in one micro-batch (the fastest TRL layout here: a
        # 8 x 8 accumulation measured slower), each generation used once (strictly on-policy)
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=args.group_size,
        num_iterations=1, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, beta=0.0,
        # cascade-rl's optimizer: AdamW, lr constant (no warm-up, no decay), no weight decay, clip at 1.0
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.steps, shuffle_dataset=False, seed=args.seed, logging_steps=1, save_strategy="no",
        gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=boxed_math, args=config, train_dataset=data,
                          processing_class=tokenizer)
    clock, gen, score = StepClock(), [], []
    trainer.add_callback(clock)
    timed(trainer, "_generate_single_turn", gen, count=lambda out: sum(len(c) for c in out[0]))
    timed(trainer, "_calculate_rewards", score)
    t_train = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()

    logs = [h for h in trainer.state.log_history if "reward" in h]
    steps = []
    for i, wall in enumerate(clock.steps):
        gen_s, gen_tokens = gen[i]
        steps.append({"step": i + 1, "step_s": wall, "sample_s": gen_s, "gen_tokens": gen_tokens,
                      "gen_tokens_per_s": gen_tokens / gen_s, "score_s": score[i][0],
                      "train_s": wall - gen_s - score[i][0], "reward_mean": logs[i]["reward"],
                      "response_len_mean": logs[i].get("completions/mean_length")})
    out = {"system": "trl", "trl_version": __import__("trl").__version__,
           "gradient_checkpointing": args.gradient_checkpointing, "loss_type": config.loss_type,
           "startup_s": t_train - t_start, "wall_s": t_end - t_start, "loop_s": t_end - t_train,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "steps": steps}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

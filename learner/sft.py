"""SFT warm start: teach the tiny model the task's format and worked solutions.

    cascade-rl make-data cascade --out runs/data/cascade        # the miniature's SFT rows: sft/*.jsonl
    cascade-rl sft model=models/tiny out=models/tiny-sft "files=[runs/data/cascade/sft/arithmetic.jsonl]" steps=400

The paper's cascade starts after SFT; RL from a random model would see zero
reward. Rows come from data files in the schema of data/rows.py with a
``response`` (the assistant turn to learn; ``fields`` remaps names); each
sequence is the prompt in the model's chat template (thinking mode) followed
by the response and the end-of-turn token, with the loss on the response
tokens only. A bad row stops SFT with its ``FILE:LINE: reason``. It deliberately stops early (a few hundred steps): the point is a
policy with non-zero but improvable accuracy, which RL then raises.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.data.prepare import BadLine
from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import BadRow, Fields, parse_messages, parse_response
from cascade_rl.data.sources import DataError, read_records
from cascade_rl.modeling.logprobs import token_logprobs


@dataclasses.dataclass
class SFTConfig:
    model: str = "models/tiny"
    """Input HF directory."""
    out: str = "models/tiny-sft"
    """Output HF directory."""
    files: list = dataclasses.field(default_factory=list)
    """Data files of rows with a prompt and a response (JSONL, JSONL.gz, Parquet, save_to_disk directories);
    the miniature's: ``cascade-rl make-data cascade --out DIR`` writes DIR/sft/*.jsonl."""
    fields: Fields = dataclasses.field(default_factory=Fields)
    """Where prompt and response are in the rows (``fields.response=completion``)."""
    steps: int = 400
    """Optimizer steps (about a minute and a half for the tiny model on 2 cores). 400 suits one task
    (arithmetic: ~0.4 held-out accuracy; 0.75 at 600); the four domains of ``cascade`` share them and
    want 600 (~3.5 min; held-out 0.1-0.55 per domain, where 400 leaves MCQA at chance and JSON at 0.05)."""
    batch_size: int = 32
    """Sequences per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (cosine decay to 10 %)."""
    seed: int = 0
    """Seed of data order and initialisation."""


def read_sft_rows(files: list[str], fields: Fields) -> list[tuple[tuple[dict, ...], str]]:
    """(conversation, response) of every row; raises DataError listing each bad row as FILE:LINE: reason."""
    rows, bad = [], []
    for path in files:
        for line, raw in read_records(path):
            try:
                if isinstance(raw, BadRow):
                    raise raw
                if not isinstance(raw, dict):
                    raise BadRow("not an object", "a row must be a JSON object")
                prompt = raw.get(fields.prompt)
                rows.append((parse_messages(prompt, f"'{fields.prompt}'"), parse_response(raw, fields)))
            except BadRow as e:
                bad.append(str(BadLine(str(path), line, e.kind, e.detail)))
    if bad:
        raise DataError("SFT data has bad rows:\n" + "\n".join(bad))
    if not rows:
        raise DataError("SFT needs rows: files=[FILE,...] of rows with a prompt and a response")
    return rows


def encode_examples(tokenizer, rows: list[tuple[tuple[dict, ...], str]]) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per row; the response ends with the end-of-turn token."""
    render = PromptRenderer(tokenizer, thinking=True)
    out = []
    for messages, response in rows:
        p_ids = render.ids(messages)
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((p_ids + r_ids, len(p_ids)))
    return out


def collate(batch: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (ids, p) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, p : len(ids)] = True
    return input_ids, attention, loss_mask


def run_sft(cfg: SFTConfig) -> dict:
    # --- init
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    fields = cfg.fields if isinstance(cfg.fields, Fields) else Fields(**cfg.fields)  # a dict from the command line
    data = encode_examples(tokenizer, read_sft_rows(list(cfg.files), fields))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(s / cfg.steps * torch.pi)).item())
    )
    # --- loop
    model.train()
    t0, losses = time.perf_counter(), []
    columns = (TextColumn("[bold]SFT"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("loss {task.fields[loss]}"))
    with Progress(*columns) as progress:
        task = progress.add_task("sft", total=cfg.steps, loss="-")
        for _ in range(cfg.steps):
            input_ids, attention, loss_mask = collate(rng.sample(data, cfg.batch_size), tokenizer.pad_token_id)
            logits = model(input_ids=input_ids, attention_mask=attention).logits
            logprobs = token_logprobs(logits, input_ids)
            loss = -(logprobs * loss_mask).sum() / loss_mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # .item() syncs; fine on CPU and it feeds the display
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
    # --- save
    out = Path(cfg.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"steps": cfg.steps, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "wall_s": time.perf_counter() - t0, "out": str(out)}

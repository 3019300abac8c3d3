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

A multi-turn row's ``response`` is the trace after the prompt, a list of
messages: assistant turns, with tool turns between them, the last an
assistant's (``make-data tools``). Each assistant content is the whole turn as
the template renders it in the conversation: from the generation prompt's
``<think>\\n`` on. The sequence is then the token ids a rollout has
(orchestrator/trajectory.py): the template's text up to each generation prompt,
tokenised piece by piece, and after each one the turn the model generates
and its end-of-turn token; the loss is on those generated tokens only, never
on a tool turn or the template's own (role headers, the generation prompt).
For the tiny model's template the ids equal the template's rendering of the
whole conversation tokenised at once, up to the last end-of-turn token
(tests/test_tool_task.py).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.data.prepare import BadLine
from cascade_rl.data.render import PromptRenderer, parting
from cascade_rl.data.rows import BadRow, Fields, message, parse_messages, parse_response
from cascade_rl.data.sources import DataError, parse_spec, read_records
from cascade_rl.modeling.logprobs import token_logprobs

TRACE_ROLES = ("assistant", "tool")
PLAIN_EVERY = 50  # steps between progress lines when stderr is not a terminal


@dataclasses.dataclass
class SFTConfig:
    model: str = "models/tiny"
    """Input HF directory."""
    out: str = "models/tiny-sft"
    """Output HF directory."""
    files: list = dataclasses.field(default_factory=list)
    """Data files of rows with a prompt and a response (JSONL, JSONL.gz, Parquet, save_to_disk directories), each
    ``PATH`` or ``PATH:WEIGHT`` (weights on every file: each file's share of the draws, as ``data.files``);
    the miniature's: ``cascade-rl make-data cascade --out DIR`` writes DIR/sft/*.jsonl (``make-data tools``:
    multi-turn rows, whose response is a list of assistant and tool messages)."""
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
    chunk_tokens: int = 4096
    """Padded tokens per forward pass: a step's rows, sorted by length, run in chunks of at most this many (one
    gradient step for the whole batch), so short rows are not padded to the longest of the batch."""
    seed: int = 0
    """Seed of data order and initialisation."""


class SFTRow(NamedTuple):
    messages: tuple[dict, ...]
    """The prompt: the conversation up to the model's (first) turn."""
    response: str | tuple[dict, ...]
    """The assistant turn to learn (the text after the generation prompt), or a multi-turn trace: the
    assistant and tool messages after the prompt."""
    where: str = ""
    """FILE:LINE, for errors found when the row is encoded."""


def parse_trace(value: list, where: str) -> tuple[dict, ...]:
    """A multi-turn ``response``: {role, content} messages of the assistant and tools, the first and the last
    the assistant's, and a tool turn between any two assistant turns (a turn that calls no tool ends a rollout)."""
    if not value:
        raise BadRow("empty response", f"field {where} is an empty list of messages")
    out = []
    for i, raw in enumerate(value):
        m = message(raw, f"field {where}, message {i}", TRACE_ROLES, " (the prompt holds the system and user turns)")
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadRow("bad message", f"field {where}, message {i}: the assistant turn is empty")
        if m["role"] == "assistant" and out and out[-1]["role"] == "assistant":
            raise BadRow("bad message", f"field {where}, message {i}: two assistant turns in a row; a tool turn "
                                        f"answers the first one's calls")
        out.append(m)
    if out[0]["role"] != "assistant" or out[-1]["role"] != "assistant":
        raise BadRow("bad message", f"field {where}: a trace starts and ends with an assistant turn, got "
                                    f"{out[0]['role']} ... {out[-1]['role']}")
    return tuple(out)


def _response(raw: dict, fields: Fields) -> str | tuple[dict, ...]:
    value = raw.get(fields.response)
    return parse_trace(value, f"'{fields.response}'") if isinstance(value, list) else parse_response(raw, fields)


def row_weights(files: list[str], rows: list[SFTRow]) -> list[float] | None:
    """Each row's chance of being drawn when the files carry weights (``PATH:WEIGHT`` on every file, as
    ``data.files``: each file's share of the draws); None (every row equally likely) when none does."""
    specs = [parse_spec(f) for f in files]
    if all(s.weight is None for s in specs):
        return None
    if any(s.weight is None for s in specs):
        raise DataError(f"files={files}: give every file a weight (PATH:WEIGHT) or none")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.where.rpartition(":")[0]] = counts.get(row.where.rpartition(":")[0], 0) + 1
    share = {str(s.path): s.weight / counts[str(s.path)] for s in specs if counts.get(str(s.path))}
    return [share[row.where.rpartition(":")[0]] for row in rows]


def read_sft_rows(files: list[str], fields: Fields) -> list[SFTRow]:
    """(conversation, response, FILE:LINE) of every row (``PATH:WEIGHT``: the rows of PATH); raises DataError
    listing each bad row as FILE:LINE: reason."""
    rows, bad = [], []
    for path in (str(parse_spec(f).path) for f in files):
        for line, raw in read_records(path):
            try:
                if isinstance(raw, BadRow):
                    raise raw
                if not isinstance(raw, dict):
                    raise BadRow("not an object", "a row must be a JSON object")
                prompt = raw.get(fields.prompt)
                rows.append(SFTRow(parse_messages(prompt, f"'{fields.prompt}'"), _response(raw, fields),
                                   f"{path}:{line}"))
            except BadRow as e:
                bad.append(str(BadLine(str(path), line, e.kind, e.detail)))
    if bad:
        raise DataError("SFT data has bad rows:\n" + "\n".join(bad))
    if not rows:
        raise DataError("SFT needs rows: files=[FILE,...] of rows with a prompt and a response")
    return rows


def _template(render: PromptRenderer, messages: list[dict], add_generation_prompt: bool) -> str:
    return render.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, enable_thinking=render.thinking)




def encode_trace(render: PromptRenderer, prompt: tuple[dict, ...], trace: tuple[dict, ...]
                 ) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of a multi-turn row, as a rollout has them: for each assistant turn, the template's
    text since the last generated token (tool turns, role headers, the generation prompt) tokenised as one
    piece, masked out, then the text the model generates (the content after the generation prompt) and the
    end-of-turn token, learned. Raises BadRow where the template does not render a turn as the continuation of
    its generation prompt (an assistant content that does not start with ``render.prefix``)."""
    tokenizer = render.tokenizer
    eos_text, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[bool] = []
    text = ""  # what ``ids`` hold, as text
    history = list(prompt)
    for i, turn in enumerate(trace):
        if turn["role"] != "assistant":
            history.append(turn)
            continue
        context = _template(render, history, add_generation_prompt=True)
        if not context.startswith(text):
            raise BadRow("bad trace", f"response message {i}: the chat template renders the conversation before it "
                                      f"otherwise than the turns so far ({parting(text, context)})")
        piece = tokenizer(context[len(text):], add_special_tokens=False)["input_ids"]
        history.append(turn)
        rendered = _template(render, history, add_generation_prompt=False)
        end = rendered.rfind(eos_text)
        if not rendered.startswith(context) or end < len(context):
            raise BadRow("bad trace", f"response message {i}: the assistant content must be the whole turn, from "
                                      f"the generation prompt's {render.prefix!r} on: the template renders it "
                                      f"{parting(context, rendered)}")
        generated = rendered[len(context):end]
        turn_ids = tokenizer(generated, add_special_tokens=False)["input_ids"] + [eos_id]
        ids += piece + turn_ids
        mask += [False] * len(piece) + [True] * len(turn_ids)
        text = context + generated + eos_text
    return ids, mask


def encode_examples(tokenizer, rows: list[SFTRow]) -> list[tuple[list[int], list[bool]]]:
    """(token ids, loss mask) per row (``SFTRow``s, or (messages, response) pairs). A single-turn row: the prompt,
    then the response and the end-of-turn token, learned; a multi-turn row: ``encode_trace``. Raises DataError
    listing each row the template cannot render as FILE:LINE: reason."""
    render = PromptRenderer(tokenizer, thinking=True)
    out, bad = [], []
    for row in (SFTRow(*r) for r in rows):
        if not isinstance(row.response, str):
            try:
                out.append(encode_trace(render, tuple(row.messages), tuple(row.response)))
            except BadRow as e:
                bad.append(f"{row.where or 'a row'}: {e.detail}")
            continue
        p_ids = render.ids(row.messages)
        r_ids = tokenizer(row.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((p_ids + r_ids, [False] * len(p_ids) + [True] * len(r_ids)))
    if bad:
        raise DataError("SFT data has bad rows:\n" + "\n".join(bad))
    return out


def by_length(batch: list[tuple[list[int], list[bool]]], chunk_tokens: int) -> list[list]:
    """The batch sorted by length and cut into chunks of at most ``chunk_tokens`` padded tokens (at least one row
    each): a few long rows (a long-context document) no longer pad every short row of the batch to their length."""
    chunks, chunk, width = [], [], 0
    for row in sorted(batch, key=lambda r: len(r[0])):
        width_if = max(width, len(row[0]))
        if chunk and width_if * (len(chunk) + 1) > chunk_tokens:
            chunks.append(chunk)
            chunk, width_if = [], len(row[0])
        chunk.append(row)
        width = width_if
    return chunks + [chunk] if chunk else chunks


def collate(batch: list[tuple[list[int], list[bool]]], pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (ids, mask) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask)
    return input_ids, attention, loss_mask


def run_sft(cfg: SFTConfig) -> dict:
    # --- init
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    fields = cfg.fields if isinstance(cfg.fields, Fields) else Fields(**cfg.fields)  # a dict from the command line
    rows = read_sft_rows(list(cfg.files), fields)
    data, weights = encode_examples(tokenizer, rows), row_weights(list(cfg.files), rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(s / cfg.steps * torch.pi)).item())
    )
    # --- loop
    model.train()
    t0, losses = time.perf_counter(), []
    columns = (TextColumn("[bold]SFT"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("loss {task.fields[loss]}"))
    plain = not sys.stderr.isatty()  # a log file, CI: a line every PLAIN_EVERY steps instead of a live bar
    with Progress(*columns, disable=plain) as progress:
        task = progress.add_task("sft", total=cfg.steps, loss="-")
        for step in range(1, cfg.steps + 1):
            batch = rng.sample(data, cfg.batch_size) if weights is None else rng.choices(data, weights, k=cfg.batch_size)
            n_loss = sum(sum(mask) for _, mask in batch)
            loss = 0.0
            for chunk in by_length(batch, cfg.chunk_tokens):  # the batch's mean token loss, in chunks of like length
                input_ids, attention, loss_mask = collate(chunk, tokenizer.pad_token_id)
                logits = model(input_ids=input_ids, attention_mask=attention).logits
                chunk_loss = -(token_logprobs(logits, input_ids) * loss_mask).sum() / n_loss
                chunk_loss.backward()
                loss = loss + chunk_loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # .item() syncs; fine on CPU and it feeds the display
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
            if plain and (step % PLAIN_EVERY == 0 or step == cfg.steps):
                mean = sum(losses[-PLAIN_EVERY:]) / len(losses[-PLAIN_EVERY:])
                print(f"sft step {step}/{cfg.steps} loss {mean:.4f} {time.perf_counter() - t0:.0f} s", flush=True)
    # --- save
    out = Path(cfg.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"steps": cfg.steps, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "wall_s": time.perf_counter() - t0, "out": str(out)}

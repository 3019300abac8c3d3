"""Atomic training checkpoints that resume exactly: weights, optimizer, step, RNG, data cursor.

A checkpoint is one directory, ``run_dir/checkpoints/step_NNNNNN/``:

    config.json, generation_config.json, model.safetensors   model.save_pretrained (HF layout, so
                                                             transformers / vLLM load it as is)
    tokenizer.json, tokenizer_config.json, ...               tokenizer.save_pretrained
    trainer_state.pt    {"step", "extra", "optimizer": optimizer.state_dict(), "rng": {torch, cuda,
                        numpy, python}}; loads with torch.load(weights_only=True): no pickled objects
    trainer_state.json  the same step and extra, plus the save time, for people and scripts

Atomicity. ``save`` writes everything into a hidden sibling ``.step_NNNNNN.tmp-<pid>``, fsyncs every
file and the directory, then ``os.rename``s it to ``step_NNNNNN`` and fsyncs the parent. A rename
within one filesystem is atomic, so the rename is the commit point: a directory named ``step_N``
is always complete, whatever moment a crash (or SIGKILL, or power loss) strikes. Overwriting an
existing ``step_N`` (a resumed run reaching that step again) first renames the old one aside to
``.step_N.old-<pid>``, commits the new one, then deletes the old; a crash between the two renames
leaves no ``step_N`` at all, so ``latest`` falls back to the previous step, never to a torn one
(an exception there, rather than a crash, puts the old one back).
``latest`` only reads: it returns the highest ``step_N`` holding a ``trainer_state.pt`` (HF-only
directories from older runs are not resumable) and ignores hidden directories. ``save`` removes the
leftovers of crashed saves (``.tmp-``/``.old-`` directories whose process is gone) before it writes.

Resume. ``load`` copies the weights into an existing model, loads the optimizer state and restores
the RNG states last (building or loading a model may draw random numbers), then returns
``{"step", "extra"}``. The learning rate is not stored: ``lr_at(step)`` recomputes it. What the
trainer does not own (the orchestrator's data cursor, the policy version) travels in ``extra``,
a JSON-serialisable dict. Only the calling process's RNG is saved; with several ranks, each rank
restores rank 0's state unless each writes its own.

Weights are saved in the HF checkpoint layout, which for MoE models differs from the in-memory one
(transformers 5 fuses per-expert weights on load and splits them on save). ``load`` therefore reads
them back with ``from_pretrained`` into a temporary model and copies that state: exact (the
fuse/split is a stack and a concatenation) but it holds a second copy of the weights on the CPU.
To avoid that, build the model from the checkpoint directory itself and pass ``model=None``.

FSDP2 (sharded parameters): gather on every rank, write on rank 0 only, e.g.

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd, osd = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, optimizer, options=full)
    if rank == 0:
        save(out, model, tokenizer, None, step, extra, state_dict=sd, optim_state=osd)

On resume, rank 0 reads the full weights (``AutoModelForCausalLM.from_pretrained(path).state_dict()``)
and ``torch.load(path / STATE_FILE, weights_only=True)["optimizer"]``; every rank then calls
``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True,
broadcast_from_rank0=True`` and ``load(path, None, None)`` for step, extra and RNG. (That optimizer
state is keyed by parameter name, a plain ``optimizer.state_dict()`` by index: resume in the mode
the checkpoint was written in.)

Tests (exact resume of a dense and an MoE model, SIGKILL mid-save, HF loadability; ~10 s on 2 cores):

    .venv/bin/pytest tests/test_checkpoint.py
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.protocol import exits

# the directory layout, without torch (the orchestrator and the supervisor read it too)
from .checkpoint_dirs import STATE_FILE, STATE_JSON, clean, latest, prune, resolve, step_dir  # noqa: F401

log = logging.getLogger("checkpoint")


def save(
    out_dir: Path,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    optim_state: dict | None = None,
) -> Path:
    """Write a complete checkpoint to ``out_dir`` atomically (see the module docstring); returns it.

    ``state_dict`` / ``optim_state`` replace ``model.state_dict()`` / ``optimizer.state_dict()``
    when the caller gathered them itself (FSDP2); ``model`` then only supplies config and class.
    """
    out_dir = Path(out_dir)
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean(parent)
    tmp = parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    extra = dict(extra or {})
    if state_dict is not None:  # a gathered dict holds tied weights as separate copies: keep the source only
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        state_dict = {k: v for k, v in state_dict.items() if k not in tied}
    old = None
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, state_dict=state_dict)  # splits fused MoE weights back into the HF layout
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optim_state is None and optimizer is not None:
            optim_state = optimizer.state_dict()
        torch.save({"step": step, "extra": extra, "optimizer": optim_state, "rng": rng_state()}, tmp / STATE_FILE)
        saved_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (tmp / STATE_JSON).write_text(json.dumps({"step": step, "saved_at": saved_at, "extra": extra}, indent=1))
        for f in tmp.rglob("*"):
            _fsync(f)
        _fsync(tmp)
        if out_dir.exists():  # rename() cannot replace a non-empty directory: move the old one aside first
            old = parent / f".{out_dir.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)  # the commit point
        _fsync(parent)
    except BaseException as e:
        full = exits.disk_full(e, tmp)  # judged before the partial save is removed and frees its room
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not out_dir.exists():
            os.rename(old, out_dir)  # the commit failed after the old one was moved aside: put it back
        if full and not isinstance(e, OSError):  # torch.save's "file write failed" carries no errno: say what it was
            raise OSError(errno.ENOSPC, f"no space left on device saving {out_dir} ({e})") from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def load(path: Path, model=None, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore weights (if ``model``), optimizer state (if ``optimizer``) and all RNG states from a
    checkpoint written by ``save``; returns ``{"step": int, "extra": dict}``."""
    path = Path(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if model is not None:
        load_weights(path, model)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])  # casts state to each parameter's device
    set_rng_state(state["rng"])  # last: building or loading models may draw random numbers
    return {"step": state["step"], "extra": state["extra"]}


def load_weights(path: Path, model) -> None:
    """Copy the weights of HF directory ``path`` into ``model`` (same architecture).

    Goes through ``from_pretrained`` so that the HF-layout to in-memory conversion (fused MoE
    experts), sharded files and tied embeddings are handled exactly as transformers does it; costs
    a second copy of the weights on the CPU while it runs.
    """
    dtype = next(model.parameters()).dtype
    source = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.load_state_dict(source.state_dict(), strict=True)


# --- RNG state: every generator a training step may draw from


def rng_state() -> dict:
    """torch CPU, every CUDA device, numpy's global and Python's ``random`` generator, as tensors and
    plain tuples (so ``torch.load(weights_only=True)`` reads them). ``np.random.Generator`` objects
    made by the caller are not global state: put what they need into ``extra``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("checkpoint has CUDA RNG states for %d devices; not restoring them here", len(state["cuda"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# --- filesystem helpers


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk (rename durability needs both)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

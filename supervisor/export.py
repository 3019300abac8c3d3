"""``cascade-rl export``: a checkpoint as a model anyone loads, a LoRA checkpoint merged into its base.

    cascade-rl export --merge runs/r/checkpoints/step_000040 --out models/r-40   # a checkpoint
    cascade-rl export --merge runs/r --out models/r                               # a run: its newest checkpoint
    cascade-rl export runs/r --out models/r-adapter                               # a LoRA run's adapter, as it is

A LoRA run's checkpoint (``trainer.lora``) is peft's adapter directory, not a model: with ``--merge`` the export
is its base (``base_model_name_or_path``) with the adapter merged into the weights (peft's ``merge_and_unload``,
in the base's own dtype), saved by ``save_pretrained`` with the checkpoint's tokenizer: a directory
``AutoModelForCausalLM.from_pretrained``, vLLM and the cascade's next stage load. Without ``--merge`` an adapter
is copied as peft's files and the tokenizer (``PeftModel.from_pretrained`` or vLLM's ``LoRARequest`` take it);
a full checkpoint is copied as its HF files either way. The trainer's resume state (trainer_state.*) is left
behind. The output appears whole (written beside it, then renamed).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cascade_rl.learner import checkpoint_dirs
from cascade_rl.weights.adapters import is_adapter

LEFT_BEHIND = (checkpoint_dirs.STATE_FILE, checkpoint_dirs.STATE_JSON)


class ExportError(ValueError):
    """A path that is not a checkpoint or a run, or an output that cannot be written: one line for the user."""


def resolve(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself (an HF model or an adapter directory), or a run directory's newest
    checkpoint. ExportError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory: name a checkpoint (run_dir/checkpoints/step_N) or a run")
    if is_adapter(path) or (path / "config.json").is_file():
        return path
    for checkpoints in (path / "checkpoints", path):  # a run directory, or its checkpoints/
        if (newest := checkpoint_dirs.latest(checkpoints)) is not None:
            return newest
    raise ExportError(f"{path} is neither a checkpoint (an HF model or a LoRA adapter directory) nor a run with "
                      "checkpoints (run_dir/checkpoints/step_N)")


def _written_whole(out: Path, write) -> Path:
    """``write(tmp)`` into a directory beside ``out``, then renamed to ``out`` (which must not exist)."""
    if out.exists():
        raise ExportError(f"{out} exists: choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _tokenizer_source(checkpoint: Path, base: str) -> str:
    return str(checkpoint) if any(checkpoint.glob("tokenizer*")) else base


def merge_to(adapter: str | Path, out: str | Path) -> Path:
    """The LoRA adapter directory ``adapter`` merged into its base, written to ``out`` as an HF model directory
    (weights in the base's dtype, the adapter's tokenizer, else the base's). ValueError when the base is
    missing (modeling/models.py ``adapter_base``)."""
    from transformers import AutoModelForCausalLM

    from cascade_rl.data.tokenizer import load_tokenizer
    from cascade_rl.modeling.models import adapter_base, merge_adapter

    adapter, out = Path(adapter), Path(out)
    base = adapter_base(adapter)

    def write(tmp: Path) -> None:
        model = merge_adapter(AutoModelForCausalLM.from_pretrained(base, dtype="auto"), adapter)
        model.save_pretrained(tmp)
        load_tokenizer(_tokenizer_source(adapter, base)).save_pretrained(tmp)

    return _written_whole(out, write)


def copy_checkpoint(checkpoint: Path, out: Path) -> Path:
    """The checkpoint's files but the trainer's state, copied to ``out``."""
    def write(tmp: Path) -> None:
        for f in checkpoint.iterdir():
            if f.is_file() and f.name not in LEFT_BEHIND:
                shutil.copy2(f, tmp / f.name)

    return _written_whole(out, write)


def export(source: str | Path, out: str | Path, merge: bool) -> Path:
    """``cascade-rl export``: the checkpoint ``source`` names (``resolve``) written to ``out``."""
    checkpoint = resolve(source)
    if Path(out).exists():
        raise ExportError(f"{out} exists: choose another --out or remove it")
    if merge and is_adapter(checkpoint):
        return merge_to(checkpoint, out)
    return copy_checkpoint(checkpoint, Path(out))


def cmd_export(args) -> int:
    try:
        out = export(args.source, args.out, args.merge)
    except ValueError as e:  # ExportError, or an adapter whose base is missing
        raise ExportError(str(e)) from None
    print(f"exported {resolve(args.source)} -> {out}" + (" (merged)" if args.merge else ""))
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("export", help="a checkpoint or a run's newest as a model directory (LoRA: --merge)")
    e.add_argument("source", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    e.add_argument("--out", required=True, help="the directory to write (must not exist)")
    e.add_argument("--merge", action="store_true",
                   help="a LoRA checkpoint merged into its base: a full HF model (without: the adapter as it is)")
    e.set_defaults(fn=cmd_export)

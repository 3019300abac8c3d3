"""LoRA checkpoints read as models: ``load_model`` of an adapter directory is its base with the adapter merged
(modeling/models.py), a base that is not there is a ValueError that says what to do, and ``cascade-rl export
--merge`` (supervisor/export.py) writes an HF directory whose logits are peft's (base + adapter, unmerged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.learner import checkpoint_dirs
from cascade_rl.modeling.models import load_model
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.export import merge_to, resolve

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(base: str, out: Path, seed: int) -> Path:
    """A LoRA checkpoint of ``base`` as the trainer writes one: peft's adapter files (random, nonzero B), the
    tokenizer and a trainer_state.pt."""
    from peft import LoraConfig, get_peft_model

    from cascade_rl.data.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    load_tokenizer(base).save_pretrained(out)
    torch.save({"step": 1, "extra": {}}, out / checkpoint_dirs.STATE_FILE)
    return out


def peft_logits(base: str, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> Path:
    """A LoRA run directory with two checkpoints (steps 1 and 2, different adapters)."""
    run_dir = tmp_path_factory.mktemp("lora-run")
    make_adapter(tiny_model, checkpoint_dirs.step_dir(run_dir / "checkpoints", 1), seed=1)
    make_adapter(tiny_model, checkpoint_dirs.step_dir(run_dir / "checkpoints", 2), seed=2)
    return run_dir


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def test_load_model_of_an_adapter_is_the_merged_model(tiny_model, run, ids, tmp_path):
    adapter = checkpoint_dirs.step_dir(run / "checkpoints", 2)
    cfg = compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}"], check=False)
    merged = load_model(str(adapter), cfg)
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain HF model
    assert type(merged) is type(load_model(tiny_model, cfg))
    want = peft_logits(tiny_model, adapter, ids)
    torch.testing.assert_close(logits(merged, ids), want, atol=1e-5, rtol=0)
    # the adapter changes the function (the comparison above is not the base against itself)
    assert (logits(load_model(tiny_model, cfg), ids) - want).abs().max() > 1e-3
    # the merged export is the same model as load_model's
    out = merge_to(adapter, tmp_path / "merged")
    torch.testing.assert_close(logits(load_model(str(out), cfg), ids), logits(merged, ids), atol=1e-6, rtol=0)


def test_an_adapter_without_its_base_says_what_to_do(tiny_model, run, tmp_path):
    adapter = tmp_path / "orphan"
    make_adapter(tiny_model, adapter, seed=3)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                             "base_model_name_or_path": str(tmp_path / "gone")}))
    cfg = compose("tiny", [f"model.path={tiny_model}", f"run_dir={tmp_path}"], check=False)
    with pytest.raises(ValueError, match=r"base model .*gone.* is not a directory here.*export --merge"):
        load_model(str(adapter), cfg)
    r = subprocess.run([*CLI, "export", "--merge", str(adapter), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is not a directory here" in r.stderr
    assert not (tmp_path / "x").exists()


def test_export_merge_of_a_run_writes_a_loadable_model(tiny_model, run, ids, tmp_path):
    from cascade_rl.data.tokenizer import load_tokenizer

    assert resolve(run) == checkpoint_dirs.step_dir(run / "checkpoints", 2)  # a run: its newest checkpoint
    out = tmp_path / "export"
    r = subprocess.run([*CLI, "export", "--merge", str(run), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not (out / "adapter_config.json").exists() and not (out / checkpoint_dirs.STATE_FILE).exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    want = peft_logits(tiny_model, checkpoint_dirs.step_dir(run / "checkpoints", 2), ids)
    torch.testing.assert_close(logits(model, ids), want, atol=1e-5, rtol=0)
    assert load_tokenizer(out).encode("1+2=3") == load_tokenizer(tiny_model).encode("1+2=3")

    # a checkpoint directory, and without --merge: the adapter as it is (peft loads it)
    step1 = checkpoint_dirs.step_dir(run / "checkpoints", 1)
    copy = tmp_path / "adapter"
    r = subprocess.run([*CLI, "export", str(step1), "--out", str(copy)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (copy / "adapter_config.json").is_file() and not (copy / checkpoint_dirs.STATE_FILE).exists()
    torch.testing.assert_close(peft_logits(tiny_model, copy, ids), peft_logits(tiny_model, step1, ids))


@pytest.mark.parametrize("case", ["missing", "empty", "exists"])
def test_export_refuses_in_one_line(run, tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "exists").mkdir()
    source, out = {"missing": (tmp_path / "nope", tmp_path / "o"), "empty": (tmp_path / "empty", tmp_path / "o"),
                   "exists": (run, tmp_path / "exists")}[case]
    r = subprocess.run([*CLI, "export", "--merge", str(source), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cascade-rl: "), r.stderr
    assert {"missing": "is not a directory", "empty": "neither a checkpoint", "exists": "exists"}[case] in lines[0]


def test_a_lora_stage_hands_the_next_stage_its_merged_model(tiny_model, run, ids, tmp_path):
    from types import SimpleNamespace

    from cascade_rl.supervisor.cascade import Cascade

    final = checkpoint_dirs.step_dir(run / "checkpoints", 2)
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    model = Cascade.handoff(str(final), stage_dir)
    assert model == str(stage_dir / "merged")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(model), ids),
                               peft_logits(tiny_model, final, ids), atol=1e-5, rtol=0)
    mtime = (stage_dir / "merged" / "model.safetensors").stat().st_mtime_ns
    assert Cascade.handoff(str(final), stage_dir) == model  # once: a rerun reuses it
    assert (stage_dir / "merged" / "model.safetensors").stat().st_mtime_ns == mtime
    assert Cascade.handoff(tiny_model, stage_dir) == tiny_model  # a full checkpoint: itself
    # evaluation samples a merged copy of an adapter checkpoint, deleted after
    holder = SimpleNamespace(run_dir=tmp_path)
    with Cascade.servable(holder, str(final)) as path:
        assert (Path(path) / "config.json").is_file() and Path(path).is_relative_to(tmp_path)
    assert not Path(path).exists() and not list(tmp_path.glob(".merged-*"))
    with Cascade.servable(holder, tiny_model) as path:
        assert path == tiny_model

"""learner/checkpoint.py: exact resume (dense and MoE), crash safety, HF loadability."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade_rl.learner import checkpoint
from cascade_rl.learner.checkpoint import latest, load, load_weights, resolve, save, step_dir


@pytest.fixture(params=["tiny_dense_model", "tiny_model"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def make(model_dir: str | Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_step(model, optimizer) -> None:
    """One AdamW step on a batch drawn from torch's RNG, scaled by numpy's and Python's: a resume
    that misses any of the three generators takes a different step."""
    ids = torch.randint(5, model.config.vocab_size, (4, 12))
    scale = 1.0 + random.random() + float(np.random.rand())
    (model(input_ids=ids, labels=ids).loss * scale).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


@pytest.mark.parametrize("into", ["existing_model", "model_from_checkpoint"])
def test_resume_takes_the_same_next_step(model_dir, into, tmp_path, deterministic):
    k = 3
    seed_all(0)
    model_a, opt_a = make(model_dir)
    for _ in range(k):
        train_step(model_a, opt_a)
    extra = {"policy_version": k, "data_cursor": {"orchestrator_step": k, "seq": 17}}
    ckpt = save(step_dir(tmp_path, k), model_a, AutoTokenizer.from_pretrained(model_dir), opt_a, k, extra)
    train_step(model_a, opt_a)  # step k+1, uninterrupted

    seed_all(123)  # a restarted process: other RNG states, weights and optimizer state from scratch
    if into == "existing_model":
        model_b, opt_b = make(model_dir)
        state = load(ckpt, model_b, opt_b)
    else:
        model_b, opt_b = make(ckpt)
        state = load(ckpt, None, opt_b)
    assert state == {"step": k, "extra": extra}
    train_step(model_b, opt_b)  # step k+1, resumed

    a, b = model_a.state_dict(), model_b.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max |A-B| = {(a[name] - b[name]).abs().max().item()}"
    assert_same_optimizer_state(opt_a, opt_b)


def test_saved_directory_is_a_plain_hf_model(model_dir, tmp_path):
    model, opt = make(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ckpt = save(step_dir(tmp_path, 1), model, tokenizer, opt, 1, {"policy_version": 1})
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(reloaded) is type(model)
    want, got = model.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied embeddings stay tied
    text = "<|im_start|>user\n12+7=<|im_end|>"
    assert AutoTokenizer.from_pretrained(ckpt)(text).input_ids == tokenizer(text).input_ids
    assert (ckpt / "trainer_state.json").is_file()


CRASHING_SAVE = r"""
import sys, time
from pathlib import Path
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from cascade_rl.learner import checkpoint

model_dir, out, ready = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters())

def hang(*args, **kwargs):  # weights and tokenizer are written, trainer_state.pt is next
    Path(ready).touch()
    time.sleep(600)

torch.save = hang
checkpoint.save(Path(out), model, AutoTokenizer.from_pretrained(model_dir), optimizer, 2)
"""


def test_sigkill_mid_save_leaves_no_complete_looking_checkpoint(tiny_dense_model, tmp_path):
    ckpts = tmp_path / "checkpoints"
    model, opt = make(tiny_dense_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_model)
    first = save(step_dir(ckpts, 1), model, tokenizer, opt, 1)
    (ckpts / "step_000009").mkdir()  # an HF-only directory (no trainer state) is not resumable

    ready, log = tmp_path / "ready", tmp_path / "child.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CRASHING_SAVE, tiny_dense_model, str(step_dir(ckpts, 2)), str(ready)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert child.poll() is None, log.read_text()
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child never reached the middle of its save")
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()

    leftover = ckpts / f".step_000002.tmp-{child.pid}"
    assert (leftover / "model.safetensors").is_file()  # the crash did strike mid-write
    assert not step_dir(ckpts, 2).exists()
    assert latest(ckpts) == first

    save(step_dir(ckpts, 2), model, tokenizer, opt, 2)
    assert latest(ckpts) == resolve("latest", tmp_path) == step_dir(ckpts, 2)
    assert not leftover.exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002", "step_000009"]


def test_failed_save_keeps_the_previous_one_and_overwrite_is_clean(tiny_dense_model, tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    model, opt = make(tiny_dense_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_model)
    save(step_dir(ckpts, 1), model, tokenizer, opt, 1, {"policy_version": 1})
    real_rename = checkpoint.os.rename

    def failing_commit(src, dst):
        if ".tmp-" in Path(src).name:
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing_commit)
    for step in (2, 1):  # a new step, then an overwrite (the old step 1 is moved aside, then put back)
        with pytest.raises(OSError, match="disk full"):
            save(step_dir(ckpts, step), model, tokenizer, opt, step, {"policy_version": 9})
        assert [p.name for p in ckpts.iterdir()] == ["step_000001"]  # temp directories removed
    monkeypatch.undo()
    assert load(latest(ckpts))["extra"] == {"policy_version": 1}

    with torch.no_grad():  # overwrite step 1 with other weights
        model.model.embed_tokens.weight.add_(1.0)
    save(step_dir(ckpts, 1), model, tokenizer, opt, 1, {"policy_version": 7})
    assert [p.name for p in ckpts.iterdir()] == ["step_000001"]
    fresh, _ = make(tiny_dense_model)
    assert load(latest(ckpts), fresh, None)["extra"] == {"policy_version": 7}
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_save_from_a_gathered_state_dict(tiny_model, tmp_path):
    """The FSDP2 path: weights come from a full state dict (separate tensors, tied ones included),
    not from the module. The directory must equal a normal save's, and load must fuse the HF-layout
    MoE experts back into the in-memory ones."""
    model, opt = make(tiny_model)
    gathered = {name: t.detach().clone() * 0.5 for name, t in model.state_dict().items()}
    ckpt = save(step_dir(tmp_path, 4), model, None, opt, 4, state_dict=gathered)
    reference = save(step_dir(tmp_path, 5), model, None, opt, 5)
    with safe_open(ckpt / "model.safetensors", "pt") as a, safe_open(reference / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    fresh, _ = make(tiny_model)
    load_weights(ckpt, fresh)
    assert all(torch.equal(gathered[name], t) for name, t in fresh.state_dict().items())


def test_resolve_resume_from(tmp_path):
    assert resolve("", tmp_path) is None
    for missing in ("latest", str(tmp_path / "nowhere")):  # no checkpoints yet, a wrong path
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            resolve(missing, tmp_path)

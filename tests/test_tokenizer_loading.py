"""data/tokenizer.py: ``load_tokenizer`` gives the tokenizer ``AutoTokenizer`` gives (its class, its ids, its chat
template), and the processes that only render text (the orchestrator) or check a launch (the supervisor) start
without importing torch or transformers' auto classes: ~4 s of CPU each, at every launch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

from cascade_rl.data.tokenizer import TRUSTED_TYPES, fast_path, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def model_dir(tiny_model: str, root: Path, model_type: str, tokenizer_class: str | None = None) -> Path:
    """The tiny model's tokenizer files beside a config.json of another model type (its defaults otherwise)."""
    out = root / f"{model_type}-{tokenizer_class}"
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (Path(tiny_model) / name).is_file():
            shutil.copy(Path(tiny_model) / name, out / name)
    if tokenizer_class:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": tokenizer_class}))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


def assert_same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    messages = [{"role": "user", "content": "What is 12 + 30? Answer in one word."}]
    for kw in ({"enable_thinking": True}, {"enable_thinking": False}):
        assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
                == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw))
    text = "<think>\n12 + 30 = 42</think>\nforty-two<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (theirs.eos_token_id, theirs.pad_token_id, len(theirs))


def test_no_trusted_model_type_is_one_whose_hub_class_transformers_overrides():
    assert not TRUSTED_TYPES & set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)


@pytest.mark.parametrize("model_type", sorted(TRUSTED_TYPES))
def test_the_fast_path_loads_what_autotokenizer_loads(model_type, tiny_model, tmp_path):
    path = model_dir(tiny_model, tmp_path, model_type)
    assert fast_path(path)
    assert_same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("model_type, tokenizer_class", [("qwen3_moe", "Qwen2Tokenizer"),  # a named class
                                                         ("deepseek_v3", None)])  # a type whose hub class is overridden
def test_anything_else_goes_through_autotokenizer(model_type, tokenizer_class, tiny_model, tmp_path):
    path = model_dir(tiny_model, tmp_path, model_type, tokenizer_class)
    assert not fast_path(path)
    assert_same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_the_orchestrator_and_the_launch_check_start_without_torch_or_transformers_auto_classes(tiny_model, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2", "domain": "math"}) + "\n")
    probe = f"""
import sys
import cascade_rl.orchestrator.main
from cascade_rl.data.tokenizer import load_tokenizer
from cascade_rl.orchestrator.evaluate import model_context
load_tokenizer({tiny_model!r}), model_context({tiny_model!r})
assert "torch" not in sys.modules, "the orchestrator imported torch"
from cascade_rl.supervisor.config import compose
compose("tiny", ["model.path={tiny_model}", "data.files=[{data}]"])  # the launch's checks, registries included
heavy = [m for m in ("transformers.models.auto.auto_factory", "transformers.configuration_utils") if m in sys.modules]
assert not heavy, heavy
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

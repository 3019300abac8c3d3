"""A model directory's tokenizer, loaded without torch where transformers would load the same class anyway.

``AutoTokenizer.from_pretrained`` reads the model's config through ``AutoConfig``, whose imports pull in torch
(generation config -> logits processors): about 4 s of CPU at the start of every process that only renders
text (the orchestrator, a launch's first process to come up). A directory whose ``tokenizer_config.json`` names
the generic fast backend (what transformers 5 writes for a tokenizer built from ``tokenizer.json``, as
``make-tiny-model`` does), with no remote code, of a model type for which ``AutoTokenizer`` trusts that name,
loads that class directly: the class ``AutoTokenizer`` would pick (tests/test_tokenizer_loading.py checks both
against each other). Everything else goes through ``AutoTokenizer``, unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC = {"TokenizersBackend", "PreTrainedTokenizerFast"}  # transformers 5's fast backend (and its old name)
# Model types for which AutoTokenizer loads the generic backend a tokenizer_config.json names (none is in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, which overrides it: a test keeps it so).
TRUSTED_TYPES = frozenset({"qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "llama",
                           "mistral", "nemotron_h", "gpt_oss"})


def fast_path(path: str | Path) -> bool:
    """Whether ``path`` is a local model directory whose tokenizer loads as the generic backend directly."""
    path = Path(path)
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tok_cfg.get("tokenizer_class") in GENERIC and "auto_map" not in tok_cfg
            and model_type in TRUSTED_TYPES and (path / "tokenizer.json").is_file())


def load_tokenizer(path: str | Path):
    """The tokenizer of model directory (or hub id) ``path``, as ``AutoTokenizer.from_pretrained`` gives it."""
    if fast_path(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

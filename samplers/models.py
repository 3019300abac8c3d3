"""The torch engine's models by HF ``model_type``: which class implements each one (a registry, no if-chain).

    cls = model_class(AutoConfig.from_pretrained(path).model_type)   # UnservedModelError names the way out
    model = cls.from_pretrained(path, dtype, device, moe_impl="grouped")

Every class here has the interface samplers/torch_engine.py calls: ``from_pretrained``, ``forward(tokens,
positions, cache_pass, last=)``, ``decode(tokens, positions, cache, kv_len)``, ``new_cache(slots, max_len, dtype,
device)`` (its cache: ``prefill``, ``extend``, ``decode``, ``save``, ``restore``, ``move``), ``load_hf_state_dict``
/ ``hf_state_dict``, ``record_routes`` / ``last_routes``, ``args`` (``vocab_size``, ``max_position_embeddings``,
``moe_layers``, ``top_k``), ``Args`` (its arguments' class: ``Args.from_hf(hf_config)`` refuses what the class does
not implement) and ``cpu_kernels_refusal``: why kernels/cpu_decode.cpp cannot run it ('' if it can).

Entries name their module rather than import it, so that samplers/torch_model.py can re-export
``SERVED_MODEL_TYPES`` (the supervisor's launch checks read it there) without an import cycle; a model's module is
imported the first time it is asked for.
"""

from __future__ import annotations

import importlib

# model_type -> "module:Class" in this package. Others (llama, qwen2, ...) differ in ways no class here models
# (no q/k norms, q/k/v biases, ...); vLLM samples them.
MODELS: dict[str, str] = {
    "qwen3": "torch_model:Transformer",
    "qwen3_moe": "torch_model:Transformer",
    "nemotron_h": "nemotron_h_model:NemotronH",
}
SERVED_MODEL_TYPES = tuple(MODELS)  # the HF model_types the torch engine samples


class UnservedModelError(ValueError):
    """A checkpoint whose ``model_type`` is not in ``SERVED_MODEL_TYPES``; the message names the way out."""

    def __init__(self, model_type: str) -> None:
        super().__init__(f"model_type {model_type!r} is not served by the torch engine (it serves "
                         f"{', '.join(SERVED_MODEL_TYPES)}): sample with sampler.engine=vllm")
        self.model_type = model_type


def model_class(model_type: str) -> type:
    """The class that implements ``model_type``; ``UnservedModelError`` for one no class here implements."""
    if model_type not in MODELS:
        raise UnservedModelError(model_type)
    module, name = MODELS[model_type].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """The model's EOS ids: its generation config's, else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    return [eos] if isinstance(eos, int) else list(eos)

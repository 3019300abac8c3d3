"""Build a small, randomly initialised HF model directory entirely offline.

    cascade-rl make-tiny-model --out models/tiny [--arch qwen3_moe|qwen3|qwen2|llama|nemotron_h] [--untied]
                               [--size tiny|10m|50m] [--task cascade]

The tokenizer is a byte-level BPE trained here (``tokenizers``) on the task's
own text (a task or mixture of data/tasks.py; ``cascade`` covers every
domain of the single-turn cascade, ``tools`` the python tool's traces), with
digits split one per token (as Qwen does; it makes arithmetic learnable).
``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` are single
added tokens that decoding keeps. The chat template follows the paper: a generation prompt in
thinking mode ends with ``<think>\\n``; non-thinking mode (``enable_thinking
=False``) emits an empty ``<think>\\n\\n</think>\\n\\n`` block. The output is a
plain HF directory that ``transformers`` and vLLM load. Embeddings are tied by
default (as in the small Qwen3 models); ``--untied`` gives the LM head its own
matrix. The built-in torch sampling engine serves qwen3 and qwen3_moe only;
sample qwen2 and llama with ``sampler.engine=vllm``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from cascade_rl.data.tasks import load_task

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
    "{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, dense intermediate, expert intermediate)
SIZES = {
    "tiny": (128, 4, 4, 2, 384, 128),
    "10m": (256, 6, 8, 4, 768, 256),
    "50m": (512, 8, 8, 4, 1536, 512),
}


def _moe_kwargs(expert_ffn: int) -> dict:
    return dict(moe_intermediate_size=expert_ffn, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                decoder_sparse_step=1)


# Nemotron-3-Nano-30B-A3B's 52 layers (its config's ``hybrid_override_pattern``): M Mamba-2, E MoE, * attention;
# 23 / 23 / 6. It repeats MEMEM*E, so a tiny model of 7 layers keeps its order and proportions.
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_H_LAYERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _nemotron_h_kwargs(common: dict, expert_ffn: int) -> dict:
    """Nano's architecture scaled down: its layer pattern cut at a multiple of 7 layers (at least the size's count);
    squared-ReLU experts without a gate beside one shared expert (twice an expert's width, as in Nano); the sigmoid
    router with its score-correction bias, group-limited top-k (2 groups of 4 experts, 1 group picked: the limit
    changes choices) and Nano's routed scaling factor 2.5; Mamba-2 layers whose heads, groups and state are scaled
    like the hidden size, with a 32-token chunk so that a 512-token context spans many chunks. No RoPE: Nemotron-H's
    attention has none (the Mamba layers carry position)."""
    hidden, layers = common["hidden_size"], common.pop("num_hidden_layers")
    common.pop("rope_theta")
    pattern = NANO_PATTERN[: 7 * -(-layers // 7)]
    return dict(common, layers_block_type=[NEMOTRON_H_LAYERS[c] for c in pattern], mamba_num_heads=hidden // 16,
                mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=32, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=expert_ffn, moe_shared_expert_intermediate_size=2 * expert_ffn,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def _deepseek_v3_kwargs(common: dict, expert_ffn: int) -> dict:
    """DeepSeek-V3 in miniature: multi-head latent attention (q and kv low-rank, a RoPE part and a no-RoPE part per
    head), the first layer dense, then MoE layers of SwiGLU experts beside a shared expert, the sigmoid router with
    group-limited top-k (2 groups of 4, 1 picked) and routed scaling 2.5. Trainer and teachers only (transformers);
    the torch engine does not serve it."""
    common.pop("head_dim")
    rope_theta = common.pop("rope_theta")
    common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: every head its own K and V from the latent
    return dict(common, moe_intermediate_size=expert_ffn, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


def _gpt_oss_kwargs(common: dict, expert_ffn: int) -> dict:
    """gpt-oss in miniature: sliding-window and full attention layers in turn (64-token window), attention sinks,
    8 experts top-2 of biased, clamped SwiGLU (its experts keep transformers' own implementation here:
    kernels/moe_families.py says why). Trainer and teachers only."""
    rope_theta = common.pop("rope_theta")
    layers = common["num_hidden_layers"]
    return dict(common, intermediate_size=expert_ffn, num_local_experts=8, num_experts_per_tok=2, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


def _qwen3_5_moe_kwargs(common: dict, expert_ffn: int) -> dict:
    """Qwen3.5-MoE's text model in miniature: three gated-delta-net (linear attention) layers to one full attention
    layer, as in the real model, every layer MoE (8 experts top-2) beside a sigmoid-gated shared expert. Trains
    padded (modeling/mamba.py does not know its recurrent layer); the torch engine does not serve it."""
    layers = common["num_hidden_layers"]
    return dict(common, moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=expert_ffn, num_experts=8,
                num_experts_per_tok=2, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * -(-layers // 4),
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


# arch -> (config class, model class, the config kwargs given the common ones (model_config's dimensions) and the
# size's expert width). Qwen2Config has no head_dim field, but hidden // heads is what Qwen2 uses anyway.
ARCHS: dict[str, tuple[type, type, Callable[[dict, int], dict]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, lambda common, expert_ffn: common),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, lambda common, expert_ffn: common | _moe_kwargs(expert_ffn)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, lambda common, expert_ffn: common),  # q/k/v biases, no q/k norms
    "llama": (LlamaConfig, LlamaForCausalLM, lambda common, expert_ffn: common),
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM, _nemotron_h_kwargs),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, _deepseek_v3_kwargs),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, _gpt_oss_kwargs),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, _qwen3_5_moe_kwargs),
}


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # <think> and <tool_call> tags are ordinary added tokens (as in Qwen3): decoding keeps them, so a verifier
    # can tell the reasoning from the final answer, and an environment find the calls, even with
    # skip_special_tokens=True
    tok.add_tokens([AddedToken(t, special=False) for t in (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def chat_text(messages: list[dict]) -> str:
    """A conversation as ``CHAT_TEMPLATE`` renders it (no generation prompt)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def corpus(task: str, size: int) -> list[str]:
    """Text the tokenizer is trained on: chat-formatted prompts and worked solutions of a task or mixture (the
    whole trace of a multi-turn task: its tool calls, the tool's turns and the answer)."""
    train = load_task(task, {"sft": size})["sft"]
    return [chat_text([{"role": "user", "content": ex.prompt},
                       *(ex.turns or [{"role": "assistant", "content": f"{THINK}\n{ex.solution}"}])]) for ex in train]


def model_config(arch: str, size: str, vocab_size: int, pad_id: int, eos_id: int, max_len: int,
                 tie_word_embeddings: bool = True):
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    config_cls, model_cls, extra = ARCHS[arch]
    hidden, layers, heads, kv_heads, ffn, expert_ffn = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        intermediate_size=ffn,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_len,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    return config_cls(**extra(common, expert_ffn)), model_cls


def make_tiny_model(
    out: str | Path,
    arch: str = "qwen3_moe",
    size: str = "tiny",
    task: str = "arithmetic",
    vocab_size: int = 512,
    max_len: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """``tie_word_embeddings=False``: the LM head is a matrix of its own (initialised separately)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus(task, 2000), vocab_size)
    tokenizer.save_pretrained(out)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD, IM_END])
    cfg, cls = model_config(arch, size, len(tokenizer), pad_id, eos_id, max_len, tie_word_embeddings)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # a trained router's correction bias is not zero: random, so that it changes choices
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.05, 0.05)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    meta = {"task": task, "arch": arch, "size": size, "params": n_params, "tie_word_embeddings": tie_word_embeddings}
    (out / "cascade_rl.json").write_text(json.dumps(meta))
    return out

"""The fixed choices of the model settings, as types the launch schema declares (supervisor/config.py).

Torch-free, so the schema can import them without loading torch; the modules that implement each
choice take their lists from here (one source for what is accepted)."""

from __future__ import annotations

from enum import StrEnum


class AttnImpl(StrEnum):
    """``model.attn_impl``: attention of the trainer and the teachers (modeling/attention.py)."""

    auto = "auto"  # varlen on CUDA, sdpa on the CPU
    varlen = "varlen"  # torch's FlashAttention varlen kernel on packed rows (CUDA)
    flash_attention_2 = "flash_attention_2"  # the flash-attn package
    sdpa = "sdpa"
    eager = "eager"


class MoeImpl(StrEnum):
    """``model.moe_impl``: how the trainer's and teachers' MoE experts run (modeling/experts.py)."""

    hf = "hf"  # transformers' own experts (grouped_mm)
    grouped = "grouped"  # kernels/moe.py: transformers' grouped_mm with faster gathers (the default; fastest on CPU)
    torch = "torch"  # kernels/moe.py's reference
    triton = "triton"  # kernels/moe.py's Triton kernel (CUDA; TRITON_INTERPRET=1 for tests)

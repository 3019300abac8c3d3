"""Triton kernels with torch references of the same signature (issue 5).

- ``moe``: Qwen3-MoE sparse block, forward and backward (block-padded expert layout, grouped GEMMs with SwiGLU,
  weighted combine); ``moe_forward(..., impl="torch" | "triton")``.
- ``logprob``: fused linear → log-prob.

Without a GPU the Triton kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` before import; the tests
set it).
"""

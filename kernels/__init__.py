"""Triton kernels (MoE routing/permute/grouped GEMM, fused linear→log-prob) with torch references (issue 5; empty so far)."""

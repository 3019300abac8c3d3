"""Samplers: the engine interface and registry, the torch/vllm/sglang engines, the sampler worker."""

"""The vLLM sampler's options from the run config, on the CPU (no vLLM needed): on a GPU the plan shares with
other processes its KV cache is fixed (``kv_cache_memory_bytes``) from its memory share, since vLLM's start-up
profile would count the others' allocations as its own; on a GPU of its own vLLM profiles
(``gpu_memory_utilization``). samplers/vllm_engine.py ``vllm_options``.

    pytest tests/test_vllm_options.py
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cascade_rl.samplers.vllm_engine import kv_cache_bytes, shares_gpu, vllm_options, weight_bytes
from cascade_rl.supervisor.config import compose

GIB = 2**30
H200 = 141 * GIB  # any total: the tests pass it as the engine reads it from the device on CUDA
CUDA = torch.device("cuda", 0)


def cfg_of(*overrides: str):
    return compose(None, ["model.dtype=bf16", *overrides], check=False)


@pytest.mark.parametrize("overrides, shared", [
    (["gpus.trainer=[0]", "gpus.samplers=[1]"], False),
    (["gpus.trainer=[0]", "gpus.samplers=[1,2]", "gpus.teachers=[3]"], False),
    (["gpus.trainer=[0]", "gpus.samplers=[0]"], True),
    (["gpus.samplers=[1,1]"], True),  # two samplers on one GPU
    (["gpus.trainer=[0]", "gpus.samplers=[1]", "gpus.teachers=[1]"], True),
    (["launcher=ray", "ray.sampler.gpus=1"], False),
    (["launcher=ray", "ray.sampler.gpus=0.5"], True),
])
def test_which_layouts_share_a_samplers_gpu(overrides, shared):
    assert shares_gpu(cfg_of(*overrides)) is shared


def test_an_exclusive_gpu_keeps_vllms_own_profile():
    cfg = cfg_of("gpus.trainer=[0]", "gpus.samplers=[1]", "gpus.memory.sampler=0.3")
    options = vllm_options(cfg, CUDA, total_memory=H200)
    assert options["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in options
    cfg.gpus.memory.sampler = 0.0
    options = vllm_options(cfg, CUDA, total_memory=H200)
    assert options["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in options


def test_a_shared_gpu_gets_a_kv_cache_from_the_samplers_share(tiny_model):
    cfg = cfg_of(f"model.path={tiny_model}", "gpus.trainer=[0]", "gpus.samplers=[0]",
                 "gpus.memory={trainer: 0.5, sampler: 0.3}", "sampler.vllm.activation_margin_gib=1.5")
    options = vllm_options(cfg, CUDA, total_memory=H200)
    weights = 2 * sum(t.numel() for t in load_file(f"{tiny_model}/model.safetensors").values())  # bf16
    assert weight_bytes(tiny_model, "bf16") == weights == weight_bytes(tiny_model, "fp32") // 2
    kv = int(0.3 * H200) - weights - int(1.5 * GIB)
    assert options["kv_cache_memory_bytes"] == kv
    assert options["gpu_memory_utilization"] == pytest.approx((weights + kv) / H200)  # its start-up free-memory check
    assert options["gpu_memory_utilization"] < 0.3


def test_the_configured_kv_cache_wins(tiny_model):
    for layout in (["gpus.samplers=[0]"], ["gpus.trainer=[0]", "gpus.samplers=[0]"]):
        cfg = cfg_of(f"model.path={tiny_model}", *layout, "gpus.memory={trainer: 0.5, sampler: 0.3}",
                     f"sampler.vllm.kv_cache_memory_bytes={8 * GIB}")
        options = vllm_options(cfg, CUDA, total_memory=H200)
        assert options["kv_cache_memory_bytes"] == 8 * GIB and options["gpu_memory_utilization"] == 0.3


def test_a_share_too_small_for_the_weights_says_what_to_change():
    with pytest.raises(ValueError, match="raise the sampler's share.*sampler.vllm.kv_cache_memory_bytes"):
        kv_cache_bytes(total_memory=80 * GIB, share=0.1, weights=7 * GIB, margin=2 * GIB)
    assert kv_cache_bytes(total_memory=80 * GIB, share=0.5, weights=15 * GIB, margin=2 * GIB) == 23 * GIB


def test_the_cpu_takes_no_gpu_options(tiny_model):
    cfg = cfg_of(f"model.path={tiny_model}", "gpus.memory.sampler=0.3")
    options = vllm_options(cfg, torch.device("cpu"))
    assert "gpu_memory_utilization" not in options and "kv_cache_memory_bytes" not in options

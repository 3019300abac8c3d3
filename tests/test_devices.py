"""Device and dtype plumbing, on the CPU: every role builds its model where the config says and in the dtype it
says, through the code that picks ``cuda`` on a GPU machine (protocol/devices.py ``role_device``)."""

from __future__ import annotations

import pytest
import torch

from cascade_rl.protocol.devices import DeviceError, dtype_name, role_device, torch_dtype
from cascade_rl.supervisor.config import compose


def cfg_of(model: str, *overrides: str):
    return compose(None, [f"model.path={model}", *overrides], check=False)


def params_of(module: torch.nn.Module) -> set[tuple[str, torch.dtype]]:
    return {(p.device.type, p.dtype) for p in module.parameters()}


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("fp32", torch.float32), ("float32", torch.float32)])
def test_dtype_names(name, dtype):
    assert torch_dtype(name) is dtype
    assert dtype_name(name) == str(dtype).removeprefix("torch.")


def test_unknown_dtype_is_refused_at_launch(tiny_model):
    from cascade_rl.supervisor.config_errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.dtype: Invalid value 'fp8', expected one of \[bf16, bfloat16, fp32"):
        cfg_of(tiny_model, "model.dtype=fp8", "data.files=[x.jsonl]")


@pytest.mark.parametrize("role", ["trainer", "sampler", "teacher"])
def test_a_role_without_gpus_runs_on_the_cpu(role, tiny_model):
    assert role_device(cfg_of(tiny_model), role) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("role, key", [("trainer", "trainer"), ("sampler", "samplers"), ("teacher", "teachers")])
def test_a_role_given_a_gpu_it_cannot_see_says_so(role, key, tiny_model):
    with pytest.raises(DeviceError, match=rf"gpus.{key}=\[0\] but this {role} process sees no CUDA device"):
        role_device(cfg_of(tiny_model, f"gpus.{key}=[0]"), role)


def test_trainer_builds_on_its_device_in_bf16_with_fp32_optimizer_state(tiny_model, tmp_path):
    from cascade_rl.learner import parallel
    from cascade_rl.learner.optim import MasterAdamW
    from cascade_rl.learner.trainer import build

    cfg = cfg_of(tiny_model, "model.dtype=bf16", f"run_dir={tmp_path}", "trainer.kl_coef=0.1")
    device = role_device(cfg, "trainer")
    policy, reference, optimizer, _, _ = build(cfg, parallel.Ranks(), device)
    assert params_of(policy) == {("cpu", torch.bfloat16)}
    assert params_of(reference) == {("cpu", torch.bfloat16)}
    assert policy.model.config._attn_implementation == "sdpa"  # auto on the CPU
    assert isinstance(optimizer, MasterAdamW)
    for p in policy.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    state = [s for s in optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == s["master"].dtype == torch.float32
                         for s in state)


def test_teacher_loads_on_its_device_in_the_run_dtype(tiny_model):
    from cascade_rl.teachers.server import Teacher

    cfg = cfg_of(tiny_model, "model.dtype=bf16")
    teacher = Teacher.load(tiny_model, ["math"], cfg, role_device(cfg, "teacher"))
    assert params_of(teacher.model) == {("cpu", torch.bfloat16)}
    assert teacher.device == torch.device("cpu")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_torch_sampler_builds_on_its_device_in_the_run_dtype(tiny_model, dtype):
    import cascade_rl.samplers.worker  # noqa: F401  (registers every engine)
    from cascade_rl.samplers.engine import build_engine

    engine = build_engine(cfg_of(tiny_model, f"model.dtype={dtype}"))
    assert params_of(engine.model) == {("cpu", torch_dtype(dtype))}


def test_vllm_options_from_the_config():
    from cascade_rl.samplers.vllm_engine import vllm_options

    cfg = compose(None, ["model.dtype=bf16", "gpus.samplers=[0]", "gpus.memory.sampler=0.3",
                         "sampler.vllm.max_model_len=2048", "+sampler.vllm.options.max_num_seqs=64"], check=False)
    on_gpu = vllm_options(cfg, torch.device("cuda", 0))
    assert on_gpu["dtype"] == "bfloat16" and on_gpu["gpu_memory_utilization"] == 0.3
    assert on_gpu["max_model_len"] == 2048 and on_gpu["max_num_seqs"] == 64 and on_gpu["enforce_eager"] is True
    cfg.gpus.memory.sampler = 0.0  # no split: vLLM's own setting
    assert vllm_options(cfg, torch.device("cuda", 0))["gpu_memory_utilization"] == 0.9
    assert "gpu_memory_utilization" not in vllm_options(cfg, torch.device("cpu"))


def test_sglang_server_command_from_the_config(tiny_model):
    from cascade_rl.samplers.sglang_engine import server_command

    cfg = cfg_of(tiny_model, "model.dtype=bf16", "gpus.samplers=[1]", "gpus.memory.sampler=0.4",
                 "sampler.sglang.args=[--chunked-prefill-size,'4096']")
    cmd = server_command(cfg, 31000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--model-path") == tiny_model and value("--port") == "31000" and value("--dtype") == "bfloat16"
    assert value("--mem-fraction-static") == "0.4" and cmd[-2:] == ["--chunked-prefill-size", "4096"]

"""The supervisor's GPU plan (supervisor/placement.py), on the CPU: which GPUs each process sees, and the
layouts refused before launch. Machines of several GPUs are simulated by the ``visible`` count."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.placement import check, cuda_env, gpus_of

ONE_GPU_SPLIT = "gpus.memory={trainer: 0.4, sampler: 0.3, teacher: 0.2}"


def cfg_of(*overrides: str):
    return compose(None, list(overrides), check=False)


def test_each_process_sees_its_roles_gpus():
    cfg = cfg_of("trainer.world_size=2", "gpus.trainer=[0,1]", "sampler.count=2", "gpus.samplers=[2,3]",
                 "gpus.teachers=[3]", "gpus.memory={sampler: 0.6, teacher: 0.3}")
    assert check(cfg, teachers=1, visible=4) == []
    assert cuda_env(gpus_of(cfg, "trainer"), visible="") == {"CUDA_VISIBLE_DEVICES": "0,1"}  # torchrun: one per rank
    assert [cuda_env(gpus_of(cfg, "sampler", i), visible="")["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["2", "3"]
    assert cuda_env(gpus_of(cfg, "teacher", 0), visible="") == {"CUDA_VISIBLE_DEVICES": "3"}
    # the orchestrator, the verifiers and every role without GPUs see none
    assert cuda_env(gpus_of(cfg, "verifier"), visible="") == {"CUDA_VISIBLE_DEVICES": ""}
    assert cuda_env(gpus_of(cfg_of(), "trainer"), visible="") == {"CUDA_VISIBLE_DEVICES": ""}


def test_config_ids_index_the_supervisors_own_visible_devices():
    # a scheduler gave the supervisor physical GPUs 4-7: config ids 0-3 are those, in that order
    cfg = cfg_of("gpus.trainer=[0]", "gpus.samplers=[3]")
    assert cuda_env(gpus_of(cfg, "trainer"), visible="4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "4"}
    assert cuda_env(gpus_of(cfg, "sampler", 0), visible="4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "7"}
    assert cuda_env(gpus_of(cfg, "sampler", 0), visible="GPU-aa,GPU-bb,GPU-cc,GPU-dd") == {
        "CUDA_VISIBLE_DEVICES": "GPU-dd"}


def test_one_gpu_for_every_role_with_a_memory_split():
    cfg = cfg_of("gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.teachers=[0]", ONE_GPU_SPLIT)
    assert check(cfg, teachers=1, visible=1) == []
    assert {cuda_env(gpus_of(cfg, r, 0), visible="")["CUDA_VISIBLE_DEVICES"] for r in ("trainer", "sampler", "teacher")} \
        == {"0"}


@pytest.mark.parametrize("overrides, teachers, visible, wanted", [
    (["gpus.trainer=[0]"], 0, 0, "no CUDA device"),
    (["gpus.trainer=[0]", "gpus.samplers=[2]"], 0, 2, "names GPUs [2] but this machine has 2"),
    (["trainer.world_size=2", "gpus.trainer=[0]"], 0, 4, "one GPU per rank"),
    (["trainer.world_size=2", "gpus.trainer=[1,1]"], 0, 4, "names a GPU twice"),
    (["sampler.count=3", "gpus.samplers=[1,2]"], 0, 4, "2 GPUs for sampler.count=3"),
    (["gpus.teachers=[1]"], 2, 4, "1 GPUs for 2 teacher checkpoints"),
    (["gpus.memory={trainer: 1.5}"], 0, 1, "must lie in [0, 1]"),
    # two roles on one GPU without a memory split
    (["gpus.trainer=[0]", "gpus.samplers=[0]"], 0, 1, "GPU 0 is shared by trainer-0/rank0, sampler-0 without a memory split"),
    (["gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.memory={trainer: 0.5}"], 0, 1, "set gpus.memory.sampler=SHARE"),
    # two samplers on one GPU: each takes the sampler share
    (["sampler.count=2", "gpus.samplers=[0,0]", "gpus.memory={sampler: 0.6}"], 0, 1, "sum to 1.20 > 1"),
    (["gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.teachers=[0]", "gpus.memory={trainer: 0.5, sampler: 0.4, "
      "teacher: 0.2}"], 1, 1, "sum to 1.10 > 1"),
])
def test_refused_layouts_say_what_to_change(overrides, teachers, visible, wanted):
    problems = check(cfg_of(*overrides), teachers=teachers, visible=visible)
    assert any(wanted in p for p in problems), problems


def test_an_unknown_role_in_the_memory_split_is_a_config_error():
    from cascade_rl.supervisor.config_errors import ConfigError

    with pytest.raises(ConfigError, match="learner"):
        cfg_of("gpus.memory.learner=0.5")


def test_unlisted_teachers_and_spare_sampler_entries():
    # spare entries of gpus.samplers (for `ctl scale`) are checked as if used
    cfg = cfg_of("gpus.trainer=[0]", "gpus.samplers=[1,0]", "gpus.memory={trainer: 0.5}")
    assert "sampler-1" in " ".join(check(cfg, teachers=0, visible=2))
    assert check(cfg_of("gpus.trainer=[0]", "gpus.samplers=[1,1]", "gpus.memory={sampler: 0.5}"), 0, 2) == []
    with pytest.raises(IndexError, match="sampler-2 has no GPU"):
        gpus_of(cfg_of("gpus.samplers=[1,1]"), "sampler", 2)


IPC_ONE_GPU = ("weights_transport=cuda_ipc", "gpus.trainer=[0]", "gpus.samplers=[0]",
               "gpus.memory={trainer: 0.5, sampler: 0.4}")


def test_cuda_ipc_wants_trainer_and_samplers_on_one_gpu():
    assert check(cfg_of(*IPC_ONE_GPU), teachers=0, visible=1) == []
    assert check(cfg_of(*IPC_ONE_GPU, "sampler.engine=vllm"), teachers=0, visible=1) == []
    two = cfg_of(*IPC_ONE_GPU, "sampler.count=2", "gpus.samplers=[0,0]", "gpus.memory={trainer: 0.5, sampler: 0.2}")
    assert check(two, teachers=0, visible=1) == []
    # the same layouts with the file transports are not this rule's business
    assert check(cfg_of("gpus.trainer=[0]", "gpus.samplers=[1]"), teachers=0, visible=2) == []


@pytest.mark.parametrize("overrides, visible, wanted", [
    # on the CPU: no GPU buffer to share
    (["weights_transport=cuda_ipc"], 0, "needs the trainer on one GPU (trainer.world_size=1 and gpus.trainer=[G]), "
                                       "got world_size=1, gpus.trainer=[]: set gpus.trainer=[0], or use weights_transport=shm"),
    # two ranks (FSDP2): the gathered weights are on rank 0 only, and samplers could be on neither GPU
    (["weights_transport=cuda_ipc", "trainer.world_size=2", "run.prompts_per_step=2", "gpus.trainer=[0,1]",
      "gpus.samplers=[0]", "gpus.memory={trainer: 0.5, sampler: 0.4}"], 2, "train on one GPU, or use weights_transport=shm"),
    # a sampler on another GPU cannot open the trainer's handle
    (["weights_transport=cuda_ipc", "gpus.trainer=[0]", "gpus.samplers=[1]"], 2,
     "needs every sampler on the trainer's GPU 0 (a process sees only its own GPU"),
    (["weights_transport=cuda_ipc", "gpus.trainer=[0]", "sampler.count=2", "gpus.samplers=[0,1]",
      "gpus.memory={trainer: 0.5, sampler: 0.4}"], 2, "set gpus.samplers=[0, 0] with a gpus.memory split"),
    (["weights_transport=cuda_ipc", "gpus.trainer=[0]"], 1, "got gpus.samplers=[]"),
    # an engine whose model is in a server process
    ([*IPC_ONE_GPU, "sampler.engine=sglang"], 1, "got sampler.engine=sglang: choose one of those"),
])
def test_cuda_ipc_layouts_refused_before_launch(overrides, visible, wanted):
    problems = check(cfg_of(*overrides), teachers=0, visible=visible)
    assert any(wanted in p for p in problems), problems


def test_nccl_wants_samplers_on_gpus_other_than_the_trainers():
    assert check(cfg_of("weights_transport=nccl", "gpus.trainer=[0]", "gpus.samplers=[1]"), 0, 2) == []
    assert check(cfg_of("weights_transport=nccl"), 0, 0) == []  # on the CPU: gloo
    shared = ("weights_transport=nccl", "gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.memory={trainer: 0.5, "
              "sampler: 0.4}")
    assert check(cfg_of(*shared, "weights_options.nccl.backend=gloo"), 0, 1) == []
    assert "sampler-0 on the trainer's GPU 0, where NCCL cannot" in " ".join(check(cfg_of(*shared), 0, 1))
    alone = check(cfg_of("weights_transport=nccl", "gpus.trainer=[0]"), 0, 1)
    assert "the samplers have no GPU (gpus.samplers=[])" in " ".join(alone)
    cpu = check(cfg_of("weights_transport=nccl", "weights_options.nccl.backend=nccl"), 0, 0)
    assert "backend=nccl needs the trainer on a GPU" in " ".join(cpu)


def test_launch_refuses_gpus_the_machine_lacks(tmp_path, tiny_model, math_data):
    """Through the command line, before any process starts: exit 2 and the layout's problem, no traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is of GPUs a machine lacks")
    out = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"run_dir={tmp_path}",
                          f"model.path={tiny_model}", *math_data, "gpus.samplers=[0]"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "GPU layout" in out.stderr and "no CUDA device" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "logs" / "trainer-0.log").exists()  # nothing started


def test_an_sglang_sampler_is_its_server_on_the_gpu_and_a_worker_on_none(tiny_model):
    from cascade_rl.supervisor.launch import sampler_procs

    cfg = cfg_of(f"model.path={tiny_model}", "sampler.engine=sglang", "sampler.count=2",
                 "gpus.samplers=[2,3]", "sampler.sglang.port=31000")
    server, sampler = sampler_procs(cfg, "sampler-1", 1)
    assert (server.role, server.worker_id, server.gpus, server.serves) == ("sglang", "sglang-1", (3,), "sampler-1")
    assert server.cmd[server.cmd.index("--port") + 1] == "31001"
    assert (sampler.gpus, sampler.args) == ((), ["--engine-url", "http://127.0.0.1:31001"])
    # a server of your own: the samplers use it, nothing more starts
    own = cfg_of(f"model.path={tiny_model}", "sampler.engine=sglang", "sampler.sglang.url=http://h:30000")
    assert [p.role for p in sampler_procs(own, "sampler-0", 0)] == ["sampler"]


def test_launch_refuses_sglang_where_it_cannot_run(tmp_path, tiny_model, math_data):
    from cascade_rl.samplers.sglang_engine import sglang_unavailable

    if not (reason := sglang_unavailable()):
        pytest.skip("SGLang runs here")
    out = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"run_dir={tmp_path}",
                          f"model.path={tiny_model}", *math_data, "sampler.engine=sglang"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"sampler.engine=sglang: {reason}" in out.stderr, out.stderr

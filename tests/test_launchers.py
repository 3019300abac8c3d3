"""The launchers' rules without a cluster: where a process may go (placement_rules), what launcher=ray refuses
before any process starts, the ``ray start`` lines of ``cascade-rl ray-node``, GPUs asked through Ray."""

from __future__ import annotations

import argparse

import pytest
from omegaconf import OmegaConf

from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.config_errors import ConfigError
from cascade_rl.supervisor.launchers.placement_rules import NODE_ID, PlacementError, bundle, choose, matches
from cascade_rl.supervisor.launchers.rules import launch_problems
from cascade_rl.supervisor.ray_node import ray_start_args


def node(node_id: str, alive: bool = True, cpus: float = 4, **labels) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"10.0.0.{node_id[-1]}",
            "Labels": {NODE_ID: node_id, **labels}, "Resources": {"CPU": cpus, "node:10.0.0.1": 1.0}}


HEAD, ROLLOUT, ROLLOUT2 = node("n1", node="head"), node("n2", pool="rollout"), node("n3", pool="rollout")


def test_a_bundle_is_what_one_process_reserves():
    spec = OmegaConf.create({"cpus": 2, "gpus": 0.5, "resources": {"rollout_slot": 1, "unused": 0}})
    assert bundle(spec) == {"CPU": 2.0, "GPU": 0.5, "rollout_slot": 1.0}
    assert bundle(OmegaConf.create({"cpus": 0, "gpus": 0, "resources": {}})) == {}


@pytest.mark.parametrize("selector,labels,ok", [
    ({"pool": "rollout"}, {"pool": "rollout"}, True),
    ({"pool": "rollout"}, {"pool": "train"}, False),
    ({"pool": "rollout"}, {}, False),
    ({"pool": "!rollout"}, {"pool": "train"}, True),
    ({"pool": "!rollout"}, {}, True),
    ({"pool": "in(a, b)"}, {"pool": "b"}, True),
    ({"pool": "!in(a,b)"}, {"pool": "b"}, False),
    ({}, {"anything": "x"}, True),
])
def test_label_selectors_match_as_ray_reads_them(selector, labels, ok):
    assert matches(selector, labels) is ok


def test_the_first_preference_a_live_node_matches_is_taken():
    prefs = [{"pool": "rollout"}, {}]
    assert choose(prefs, [HEAD, ROLLOUT], {"CPU": 1}) == {"pool": "rollout"}
    # the rollout node dead: any node
    assert choose(prefs, [HEAD, node("n2", alive=False, pool="rollout")], {"CPU": 1}) == {}
    # no preference: anywhere
    assert choose([], [HEAD], {"CPU": 1}) == {}
    # a node too small for the bundle does not count
    assert choose(prefs, [HEAD, node("n2", cpus=1, pool="rollout")], {"CPU": 2}) == {}


def test_a_node_where_a_host_was_lost_is_avoided_while_another_can_hold_it():
    prefs = [{"pool": "rollout"}, {}]
    # n2 lost a host (Ray still calls it alive): the other rollout node, and never n2
    assert choose(prefs, [HEAD, ROLLOUT, ROLLOUT2], {"CPU": 1}, avoid={"n2"}) == \
        {"pool": "rollout", NODE_ID: "!in(n2)"}
    # the only rollout node is suspect: the head, by the fallback preference
    assert choose(prefs, [HEAD, ROLLOUT], {"CPU": 1}, avoid={"n2"}) == {NODE_ID: "!in(n2)"}
    # nothing else can hold it: the suspect node after all (it may have recovered; Ray waits for room)
    assert choose([{"pool": "rollout"}], [HEAD, ROLLOUT], {"CPU": 1}, avoid={"n2"}) == {"pool": "rollout"}


def test_no_live_node_that_could_ever_hold_it_is_a_clear_error():
    with pytest.raises(PlacementError, match=r"no live node can hold \{'GPU': 1.0\}.*10.0.0.1 \(alive, labels "
                                             r"\{'node': 'head'\}"):
        choose([], [HEAD], {"GPU": 1.0})
    with pytest.raises(PlacementError, match="labels {'pool': 'gpu'}"):
        choose([{"pool": "gpu"}], [HEAD, ROLLOUT], {"CPU": 1})


RAY = ["launcher=ray", "weights_transport=stream"]


def cfg_with(tiny_model, *overrides: str):
    return compose("tiny", [f"model.path={tiny_model}", "data.files=[x.jsonl]", *overrides], check=False)


@pytest.mark.parametrize("overrides,expect", [
    (["launcher=ray"], "weights_transport=shm reaches processes of one machine only"),
    ([*RAY, "gpus.trainer=[0]"], "gpus.trainer name one machine's GPUs"),
    ([*RAY, "sampler.launcher=[ssh,h]"], "drop sampler.launcher"),
    ([*RAY, "sampler.engine=sglang"], "does not start SGLang servers"),
    ([*RAY, "verifier.judge.serve=torch", "verifier.judge.path=/m"], "does not start the judge's server"),
    ([*RAY, "ray.sampler.cpus=-1"], "ray.sampler: cpus, gpus and resources must be >= 0"),
    ([*RAY, "ray.trainer.gpus=2"], "one GPU per rank"),
    ([*RAY, "ray.sampler.gpus=1.5"], "a fraction of one GPU, or a whole number"),
])
def test_launcher_ray_refuses_what_it_cannot_place(tiny_model, overrides, expect):
    assert any(expect in p for p in launch_problems(cfg_with(tiny_model, *overrides))), \
        launch_problems(cfg_with(tiny_model, *overrides))


def test_a_ray_config_that_can_run_passes_and_local_is_unchanged(tiny_model):
    assert launch_problems(cfg_with(tiny_model, *RAY, "ray.sampler.labels=[{pool: rollout},{}]",
                                    "ray.trainer.gpus=1", "ray.sampler.gpus=0.5")) == []
    assert launch_problems(cfg_with(tiny_model, "gpus.trainer=[0]")) == []


def test_the_launch_refuses_it_with_one_message(tiny_model):
    with pytest.raises(ConfigError, match="weights_transport=stream"):
        compose("tiny", [f"model.path={tiny_model}", "data.files=[x.jsonl]", "launcher=ray"])
    with pytest.raises(ConfigError, match="launcher"):
        compose("tiny", [f"model.path={tiny_model}", "data.files=[x.jsonl]", "launcher=slurm"])


def test_gpus_asked_through_ray_put_the_role_on_cuda(tiny_model):
    """Under launcher=ray a role runs on cuda when ray.<role>.gpus > 0 (Ray sets its CUDA_VISIBLE_DEVICES): on
    this CPU machine that is the no-CUDA refusal, naming the setting, rather than a silent CPU run."""
    from cascade_rl.protocol.devices import DeviceError, role_device, uses_gpus

    cfg = cfg_with(tiny_model, *RAY, "ray.trainer.gpus=1")
    assert uses_gpus(cfg, "trainer") and not uses_gpus(cfg, "sampler")
    assert str(role_device(cfg, "sampler")) == "cpu"
    with pytest.raises(DeviceError, match=r"ray.trainer.gpus=1.0 but this trainer process sees no CUDA device"):
        role_device(cfg, "trainer")


def ns(**kw) -> argparse.Namespace:
    base = dict(role="head", address="", ip="", port=6379, num_cpus=None, num_gpus=None, labels="", resources="",
                object_store_mb=0, temp_dir="", block=False)
    return argparse.Namespace(**{**base, **kw})


def test_ray_node_starts_heads_and_workers_with_the_runs_defaults():
    head = ray_start_args(ns(ip="10.0.0.1", labels="node=head", num_cpus=8, block=True))
    assert head[1:] == ["start", "--disable-usage-stats", "--head", "--port=6379", "--include-dashboard=false",
                        "--node-ip-address=10.0.0.1", "--num-cpus=8", "--labels=node=head", "--block"]
    worker = ray_start_args(ns(role="worker", address="10.0.0.1:6379", resources='{"rollout": 4}', num_gpus=8))
    assert worker[1:] == ["start", "--disable-usage-stats", "--address=10.0.0.1:6379", "--num-gpus=8",
                          '--resources={"rollout": 4}']
    with pytest.raises(ValueError):
        ray_start_args(ns(role="worker", address="h:1", resources="{rollout: 4"))


def test_a_launch_without_a_cluster_says_where_it_looked(tiny_model, math_data, tmp_path):
    """No Ray cluster at ray.address: one line saying so and how to start one, quickly (ray.init alone retries a
    dead address for minutes)."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("ray", reason="Ray is the optional extra 'ray' (make test installs it)")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "cascade_rl.supervisor.cli", "launch", "tiny", f"run_dir={tmp_path}/r",
                        f"model.path={tiny_model}", *math_data, "launcher=ray", f"ray.address=127.0.0.1:{port}",
                        "weights_transport=stream", "supervisor.progress=none"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert f"no Ray cluster answers at ray.address=127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr

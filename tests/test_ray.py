"""launcher=ray on a real two-node Ray cluster (tests/helpers/ray_cluster.py): the head here, a worker node in
its own network namespace. A tiny run with its samplers and verifiers on the worker node; the worker node killed
mid-run (its workers placed again on the head, nothing lost); two trainer ranks on two nodes equal to one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]
ray = pytest.importorskip("ray", reason="Ray is the optional extra 'ray' (make test installs it)")

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from ray_cluster import RayCluster  # noqa: E402

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RayCluster(tmp_path_factory.mktemp("ray")) as c:
        yield c


def ray_overrides(cluster, *extra: str) -> list[str]:
    """The orchestrator and the trainer on the head, samplers and verifiers on the rollout node while it lives."""
    return ["launcher=ray", f"ray.address={cluster.address}", f"host={cluster.head_ip}", "weights_transport=stream",
            "ray.orchestrator.labels=[{node: head}]", "ray.trainer.labels=[{node: head}]",
            "ray.sampler.labels=[{pool: rollout},{}]", "ray.verifier.labels=[{pool: rollout},{}]",
            "supervisor.progress=none", *extra]


def status(run_dir: Path, env: dict) -> dict[str, dict]:
    r = subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), "status", "--json"], capture_output=True, text=True,
                       env=env, timeout=30)
    return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}


def launch(run_dir: Path, overrides: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(pred, proc: subprocess.Popen, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if value := pred():
            return value
        time.sleep(0.3)
    out = proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
    raise AssertionError(f"{what} within {timeout_s} s; launch output:\n{out[-3000:]}")


def test_a_tiny_run_places_samplers_and_verifiers_on_the_worker_node(cluster, tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps = 5  # each generate call 1 s longer: the run outlasts a scale-up
    proc = launch(run_dir, [f"model.path={tiny_model}", *math_data, f"run.steps={steps}", "sampler.delay_s=1",
                            *ray_overrides(cluster)], env)
    rows = wait_for(lambda: (r := status(run_dir, env)) and all(
        r.get(w, {}).get("state", "starting") != "starting" for w in ("sampler-0", "verifier-0")) and r,
                    proc, 120, "sampler-0 and verifier-0 running")
    # ctl status names each worker's node, and the sampler really runs in the worker node's network namespace
    assert rows["sampler-0"]["node"] == rows["verifier-0"]["node"] == cluster.worker_ip
    assert rows["orchestrator"]["node"] == rows["trainer-0"]["node"] == cluster.head_ip
    assert rows["sampler-0"]["pid"] in cluster.netns_pids()
    table = subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), "status"], capture_output=True, text=True,
                           env=dict(env, COLUMNS="200"), timeout=30).stdout
    assert cluster.worker_ip in table and cluster.head_ip in table
    # ctl scale: a second sampler placed where the cluster has room (the rollout node, by its labels)
    r = subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), "scale", "samplers=2"], capture_output=True,
                       text=True, env=env, timeout=150)
    assert r.returncode == 0 and json.loads(r.stdout)["started"] == ["sampler-1"], r.stdout + r.stderr
    rows = wait_for(lambda: (r := status(run_dir, env)) and r.get("sampler-1", {}).get("state", "starting")
                    != "starting" and r, proc, 120, "sampler-1 running")
    assert rows["sampler-1"]["node"] == cluster.worker_ip
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    config = (run_dir / "config.yaml").read_text()
    assert f"orchestrator: tcp://{cluster.head_ip}:" in config and "ipc://" not in config
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["lost"] == 0 and summary["books"]["trained"] == steps * 8 * 4
    nodes = {w["id"]: w["node"] for w in summary["workers"]}
    assert nodes["sampler-0"] == cluster.worker_ip and nodes["trainer-0"] == cluster.head_ip


def test_a_role_no_node_can_hold_fails_the_launch_with_what_it_asked(cluster, tiny_model, math_data, tmp_path):
    r = subprocess.run([*CLI, "launch", "tiny", f"run_dir={tmp_path}/run", f"model.path={tiny_model}", *math_data,
                        *ray_overrides(cluster), "ray.verifier.labels=[{pool: gpu}]"], capture_output=True,
                       text=True, env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state")), timeout=180)
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "no live node can hold {'CPU': 1.0} with labels {'pool': 'gpu'}" in out and "Traceback" not in out
    assert f"{cluster.worker_ip} (alive, labels {{'pool': 'rollout'}}" in out  # what the cluster has


def test_losing_the_worker_node_places_its_workers_on_the_head(cluster, tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps = 4
    # each generate call of the sampler lasts 3 s more: it holds a batch's groups when its node dies
    proc = launch(run_dir, [f"model.path={tiny_model}", *math_data, f"run.steps={steps}", "sampler.delay_s=3",
                            *ray_overrides(cluster)], env)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and any('"version"' in line for line in metrics.read_text().splitlines())
             and status(run_dir, env).get("sampler-0", {}).get("state") == "generating", proc, 180,
             "a first training step, then the sampler generating")
    rows = status(run_dir, env)
    assert rows["sampler-0"]["node"] == cluster.worker_ip
    killed = cluster.kill_worker()  # mid-batch: the sampler and the verifier die with their node
    assert killed >= 3
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    workers = {w["id"]: w for w in summary["workers"]}
    assert workers["sampler-0"]["node"] == workers["verifier-0"]["node"] == cluster.head_ip  # placed again
    assert summary["restarts"]["sampler-0"] >= 1 and summary["restarts"]["verifier-0"] >= 1
    books = summary["books"]
    assert books["lost"] == 0 and books["trained"] == steps * 8 * 4  # every rollout accounted for
    assert books["redispatched"] > 0  # what the dead sampler held was sampled again
    cluster.start_worker()  # for the tests after this one


def test_losing_the_trainers_node_stops_the_run_with_how_to_resume(cluster, tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = launch(run_dir, [f"model.path={tiny_model}", *math_data, "run.steps=50", "trainer.save_every=1",
                            "supervisor.max_restarts=1", "supervisor.restart_backoff_s=0.5",
                            "ray.placement_timeout_s=10",  # a try to place the trainer again gives up after 10 s
                            *ray_overrides(cluster), "ray.trainer.labels=[{pool: rollout}]"], env)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and any('"version"' in line for line in metrics.read_text().splitlines()),
             proc, 180, "a first training step")
    assert status(run_dir, env)["trainer-0"]["node"] == cluster.worker_ip
    cluster.kill_worker()
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        cluster.start_worker()  # for the tests after this one, whatever this one does
    assert proc.returncode == 1
    # the trainer's death rewinds the data plane; with no node to place it on, the run stops with how to go on
    assert "trainer-0 could not be placed again" in out.replace("\n", "") and f"run_dir={run_dir} resume=true" in \
        out.replace("\n", ""), out[-3000:]
    assert (run_dir / "checkpoints").is_dir()  # what resume=true continues from


def test_two_trainer_ranks_on_two_nodes_equal_one_rank(cluster, tiny_model, tmp_path):
    """The FSDP2 equivalence of tests/test_parallel.py, its two ranks placed by the Ray launcher one per node
    (STRICT_SPREAD: gloo between the namespaces, rendezvous on rank 0's node)."""
    import torch
    from safetensors.torch import load_file
    from test_parallel import HELPER, TOL
    from test_parallel import run as run_local

    from cascade_rl.supervisor.config import compose
    from cascade_rl.supervisor.launchers import Start
    from cascade_rl.supervisor.launchers.ray_launcher import RayLauncher

    one, m1 = run_local(1, tiny_model, tmp_path / "one.safetensors")
    cfg = compose("tiny", [f"model.path={tiny_model}", "data.files=[x.jsonl]", *ray_overrides(cluster),
                           "ray.trainer.labels=[]", "ray.trainer_strategy=STRICT_SPREAD", "trainer.world_size=2"],
                  check=False)
    cfg.run_id = "ranks"
    launcher = RayLauncher(cfg)
    launcher.connect()
    try:
        out = tmp_path / "two.safetensors"
        handle = launcher.spawn(Start("ranks", "trainer", ["python", "-P", str(HELPER), tiny_model, str(out)],
                                      {"OMP_NUM_THREADS": "1"}, str(tmp_path / "ranks.log"), ranks=2))
        assert sorted(i["ip"] for i in handle.infos) == sorted([cluster.head_ip, cluster.worker_ip])
        rc = handle.wait(300)
    finally:
        launcher.close()
    logs = "".join(p.read_text() for p in tmp_path.glob("ranks*.log"))
    assert rc == 0, logs[-3000:]
    two, m2 = load_file(out), json.loads(Path(str(out) + ".json").read_text())
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=TOL, rtol=0, msg=k)
    # the helper's report (tests/helpers/dist_steps.py): across nodes too, the two ranks published the one-rank
    # file byte for byte and resumed exactly, as test_parallel.run checks of its local runs
    assert m2["published"]["gathered"] == m2["published"]["module"], m2["published"]
    assert m2["resume_max_diff"] == 0, m2["resume_max_diff"]
    for a, b in zip(m1["metrics"], m2["metrics"], strict=True):
        for k in ("loss", "grad_norm", "response_tokens"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k

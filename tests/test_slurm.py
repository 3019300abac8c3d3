"""deploy/slurm/ray.sbatch under a real Slurm: two nodes on this machine (n2 in its own network namespace,
tests/helpers/slurm_cluster.py); the script starts a Ray cluster over the allocation and runs a tiny launch on it
with the samplers and verifiers on n2. Skipped, saying what to install, where Slurm's daemons are missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from ray_cluster import kill_matching  # noqa: E402
from slurm_cluster import SlurmCluster, missing  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "ray.sbatch"


def test_the_slurm_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and Slurm's daemons need root")
@pytest.mark.skipif(bool(missing()), reason=f"Slurm is not installed here (missing {', '.join(missing())}: "
                                            f"apt install slurmctld slurmd slurm-client munge)")
def test_sbatch_runs_a_ray_cluster_and_a_launch_over_two_slurm_nodes(tiny_model, math_data, tmp_path):
    pytest.importorskip("ray", reason="Ray is the optional extra 'ray' (make test installs it)")
    ray_tmp = f"/tmp/crls{os.getpid()}"  # short: Ray's unix sockets live under each node's folder there
    run_dir = tmp_path / "run"
    with SlurmCluster() as slurm:
        venv = Path(sys.executable).parent
        env = dict(slurm.env, CRL_SETUP=f"export PATH={venv}:$PATH", CRL_RAY_TMPDIR=ray_tmp, CRL_NODE_WAIT_S="60",
                   CRL_RAY_PORT=str(21000 + os.getpid() % 20000), XDG_STATE_HOME=str(tmp_path / "state"))
        try:
            r = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/job-%j.log", str(SCRIPT),
                                "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                                "ray.orchestrator.labels=[{node: head}]", "ray.trainer.labels=[{node: head}]",
                                "ray.sampler.labels=[{pool: rollout}]", "ray.verifier.labels=[{pool: rollout}]"],
                               capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
            assert r.returncode == 0, r.stderr
            state = slurm.wait_job(r.stdout.strip(), timeout_s=400)  # sbatch --wait polls every 2..32 s
        finally:
            kill_matching(ray_tmp)  # any Ray process of the job still shutting down
            shutil.rmtree(ray_tmp, ignore_errors=True)
    log = "".join(p.read_text() for p in tmp_path.glob("job-*.log"))
    assert state == ("COMPLETED", "0:0"), f"{state}\n{log[-4000:]}"
    assert "2 alive" in log  # the script waited for both nodes
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["lost"] == 0 and summary["books"]["trained"] == 3 * 8 * 4
    nodes = {w["id"]: w["node"] for w in summary["workers"]}
    assert nodes["sampler-0"] == nodes["verifier-0"] == slurm.netns.ns_ip  # n2, in its namespace
    assert nodes["orchestrator"] == nodes["trainer-0"] == slurm.netns.host_ip

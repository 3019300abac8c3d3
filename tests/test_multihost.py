"""Multi-host: the sampler runs in its own network namespace (a veth pair made here) and reaches the
orchestrator, trainer and supervisor over TCP only; weights come as a stream over TCP too (no shared file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: host side 10.231.<k>.1, namespace .2."""
    k = os.getpid() % 250
    ns, host_if, ns_if = f"crl{os.getpid()}", f"crlh{os.getpid()}"[:15], f"crln{os.getpid()}"[:15]
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"10.231.{k}.1/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        for cmd in (["ip", "addr", "add", f"10.231.{k}.2/24", "dev", ns_if], ["ip", "link", "set", ns_if, "up"],
                    ["ip", "link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", ns, *cmd)
        yield ns, f"10.231.{k}.1"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
def test_a_sampler_in_another_network_namespace_over_tcp(netns, tiny_model, math_data, tmp_path):
    ns, host = netns
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             f"host={host}", f"sampler.launcher=[ip,netns,exec,{ns}]",
                             "weights_transport=stream",
                             "supervisor.progress=none"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sampler_ns = None
    t_end = time.monotonic() + 90
    while sampler_ns is None and time.monotonic() < t_end and proc.poll() is None:
        r = subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), "status", "--json"], capture_output=True,
                           text=True, env=env, timeout=30)
        if r.returncode == 0:
            rows = {w["id"]: w for w in json.loads(r.stdout)}
            pid = rows.get("sampler-0", {}).get("pid")
            if pid and rows["sampler-0"]["state"] != "starting":
                sampler_ns = os.readlink(f"/proc/{pid}/ns/net")
        time.sleep(0.3)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert sampler_ns is not None and sampler_ns != os.readlink("/proc/self/ns/net")  # really elsewhere
    config = (run_dir / "config.yaml").read_text()
    assert f"tcp://{host}:" in config and "ipc://" not in config
    log = (run_dir / "logs" / "sampler-0.log").read_text()
    assert "cannot load weights" not in log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness_mean"] for m in metrics if "version" in m] == [0.0, 0.0, 0.0]  # streamed weights in use
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["lost"] == 0 and summary["books"]["trained"] == 3 * 8 * 4

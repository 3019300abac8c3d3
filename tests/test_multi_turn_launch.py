"""A real launch of the ``tools`` preset: multi-turn GRPO with the sandboxed python tool, every role its own process
over ZeroMQ, and an environment worker SIGKILLed while it holds trajectories' steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from test_launch import CLI, cli, read_ledger

from cascade_rl.verifiers.sandbox import isolation_available

pytestmark = pytest.mark.skipif(not isolation_available(), reason="the python tool's sandbox needs root on Linux")


@pytest.mark.slow
def test_tools_launch_with_an_environment_worker_killed_mid_trajectory(tools_model, tools_data, tmp_path):
    run_dir, steps = tmp_path / "run", 6
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [*CLI, "launch", "tools", f"run_dir={run_dir}", f"model.path={tools_model}",
         f"data.files=[{tools_data['rl']['tool_arithmetic']}]",
         f"data.eval_files=[{tools_data['heldout']['tool_arithmetic']},{tools_data['heldout']['tool_arithmetic_direct']}]",
         f"run.steps={steps}", "run.prompts_per_step=8", "run.group_size=4", "orchestrator.eval_n=1",
         "supervisor.progress=none", "supervisor.restart_backoff_s=0.2", "orchestrator.env_timeout_s=20"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def table() -> dict:
        r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
        return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}

    t_end = time.monotonic() + 240
    while table().get("orchestrator", {}).get("version", 0) < 2:
        assert time.monotonic() < t_end and proc.poll() is None, "the run never reached version 2"
        time.sleep(0.2)
    pid = table()["environment-0"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # frozen: the steps the orchestrator hands it stay in its hands
    t_end = time.monotonic() + 90
    while not table().get("orchestrator", {}).get("counters", {}).get("workers", {}).get("environment-0", {}).get(
            "items"):
        assert time.monotonic() < t_end, "the environment worker never held a step"
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"]["environment-0"] >= 1
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trainer_ids"]["match"]
    ledger = read_ledger(run_dir)  # every trajectory exactly one fate, the trainer's ids the ledger's
    assert len(ledger) == books["dispatched"]
    assert sum(r["fate"] == "trained" for r in ledger.values()) == books["trained"] == steps * 8 * 4
    mt = summary["multi_turn"]
    assert mt["turns_mean"] > 1 and mt["tool_calls_mean"] > 0 and 0 < mt["observation_token_frac"] < 1
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["multi_turn/turns_mean"] >= 1 for m in metrics if "multi_turn/turns_mean" in m)
    assert {"tool_use", "math"} <= set(summary["heldout_domains"])  # with tools and without, the same questions

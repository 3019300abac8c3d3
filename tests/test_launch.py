"""Integration: the real processes over real ZeroMQ sockets, a few GRPO steps on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from cascade_rl.orchestrator.books import audit

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from console_lines import foreign_lines  # noqa: E402

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, **kw)


def read_ledger(run_dir: Path, steps: int | None = None) -> dict[str, dict]:
    """The ledger, checked rollout by rollout: every dispatched id has exactly one terminal fate (one fate, or one
    then ``rolled_back``: orchestrator/books.py), every duplicate line names an attempt no newer than that fate's,
    and the trainer's ids (trained_ids.jsonl) are exactly, step by step, the ledger's trained ids; with ``steps``,
    the final weights' history trains each step once. Returns each id's terminal line."""
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    by_id = defaultdict(list)
    for r in lines:
        if "fate" in r:  # a group's dispatch is an event line
            by_id[r["id"]].append(r)
    terminal = {}
    for rid, rs in by_id.items():
        fates = [r for r in rs if r["fate"] != "duplicate"]
        assert len(fates) == 1 and fates[0]["fate"] in ("trained", "filtered", "stale", "rolled_back") or [
            f["fate"] for f in fates][1:] == ["rolled_back"], (rid, rs)
        terminal[rid] = fates[-1]
        assert all(r["attempt"] <= fates[0]["attempt"] for r in rs if r["fate"] == "duplicate"), (rid, rs)
    books = audit(run_dir, steps if steps is not None else 1 + max(r["step"] for r in terminal.values()))
    assert books["ok"] or (steps is None and set(books["problems"]) <= {"steps_not_once"}), books["problems"]
    trainer = sorted((r["step"], rid) for r in map(json.loads, (run_dir / "trained_ids.jsonl").read_text().splitlines())
                     for rid in r["ids"])
    assert trainer == sorted((r["step"], rid) for rid, r in terminal.items() if r["fate"] == "trained")
    return terminal


def cuda_visible(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES in the environment process ``pid`` was started with (None: unset)."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    return env.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_launch_tiny_end_to_end(tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    (tmp_path / "a-file").write_text("")  # MLflow cannot make its store under a file: the dashboard fails
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             "supervisor.progress=plain", "logger=[jsonl,mlflow]",
                             f"mlflow.tracking_uri='sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}'"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # while it runs: the live process table answers over the control socket
    table, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "supervisor.json").is_file():
            r = cli("ctl", "status", "--json", env=env, timeout=30)  # newest run, from XDG_STATE_HOME
            if r.returncode == 0:
                table = json.loads(r.stdout)
                if all(w["pid"] for w in table):
                    visible = {w["id"]: cuda_visible(w["pid"]) for w in table}
                    break
        time.sleep(0.3)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert table is not None, "ctl status never answered during the run"
    assert {w["role"] for w in table} == {"orchestrator", "trainer", "sampler", "verifier"}
    assert all({"role", "id", "pid", "state", "version", "restarts"} <= set(w) for w in table)
    # no gpus.* in the config: every process was started with no GPU visible (supervisor/placement.py)
    assert visible == {w["id"]: "" for w in table}

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    steps, groups, g = 3, 8, 4  # configs/run/tiny.yaml
    assert summary["steps"] == steps and summary["policy_version"] == steps
    assert books["lost"] == 0 and books["in_flight"] == 0
    assert books["dispatched"] == books["trained"] + books["filtered"] + books["stale"]
    assert books["trained"] == steps * groups * g
    ledger = read_ledger(run_dir)  # one fate per id, the trainer's ids equal to the ledger's
    assert len(ledger) == books["dispatched"] and books["trainer_ids"]["match"]
    assert all(r["step"] - r["version"] == 0 for r in ledger.values())  # strictly on-policy: staleness 0
    assert 0.0 <= summary["heldout_accuracy_before"] <= 1.0
    assert {"heldout_accuracy_before", "heldout_accuracy_after", "steps", "wall_s", "books"} <= set(summary)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in metrics if "version" in m]
    # what filtering cost: the orchestrator's count of rollouts sampled per step against the ledger's books
    assert sum(m["sampled_per_trained"] * groups * g for m in train_steps) == pytest.approx(books["dispatched"])
    assert summary["sampled_per_trained"] == pytest.approx(books["dispatched"] / books["trained"])
    assert all(m["sampled_per_trained"] >= 1.0 for m in train_steps)
    assert [m["version"] for m in train_steps] == [1, 2, 3]
    for m in train_steps:
        assert m["staleness_mean"] == 0.0  # strictly on-policy
        assert m["trainer/mismatch/abs_diff_max"] <= 1e-4  # engine and trainer agree on log-probs

    # the final checkpoint is an HF directory that transformers loads; a random model scores 0 on
    # every rollout, so every group's advantage is 0 and GRPO must leave the weights exactly as
    # they were -- unless some group had a signal (learner updates are tested in test_trainer.py)
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == f"step_{steps:06d}" and (ckpt / "tokenizer.json").is_file()
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    changed = any(not before[k].equal(after[k]) for k in before)
    signal = any(m["trainer/zero_adv_groups"] < groups for m in train_steps)
    assert changed == signal
    assert "run summary" in out

    # the console holds the supervisor's own lines (the progress, the summary) and no dependency's; what the
    # libraries print stays in the processes' logs (supervisor/console.py): transformers' bar in the trainer's
    assert not foreign_lines(out), "\n".join(foreign_lines(out))
    # a dashboard that fails is said once, and the run goes on without it
    assert len([line for line in out.splitlines() if line.startswith("logger=mlflow failed")]) == 1, out
    assert f"step {steps}/{steps} | " in out and "summary.json" in out
    assert "Loading weights" in (run_dir / "logs" / "trainer-0.log").read_text()
    assert (run_dir / "logs" / "supervisor.log").is_file()

    # engine/trainer log-prob mismatch: per step in the live line, over the run in the summary and its table
    mismatch = summary["mismatch"]
    assert mismatch["abs_diff_max"] == max(m["trainer/mismatch/abs_diff_max"] for m in train_steps)
    assert mismatch["abs_diff_mean"] <= 1e-5 and mismatch["outside_band"] == 0.0  # torch engine, fp32
    assert "logp mismatch" in out and "log-prob mismatch" in out

    # each model role reports where its model ran: the CPU, in the run's dtype
    devices = {w["id"]: w["counters"].get("device", "") for w in summary["workers"]}
    assert devices["trainer-0"].startswith("cpu float32 sdpa") and devices["sampler-0"] == "cpu float32"


def test_launch_dry_run_prints_resolved_config(tiny_model, math_data):
    r = cli("launch", "tiny", f"model.path={tiny_model}", *math_data, "run.steps=5", "--dry-run", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "steps: 5" in r.stdout and "prompts_per_step: 8" in r.stdout


def test_launch_rejects_bad_config_with_a_clear_message(tmp_path):
    r = cli("launch", "tiny", f"model.path={tmp_path / 'missing'}", "run.group_size=1", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "group_size must be >= 2" in r.stderr and "is not a directory" in r.stderr
    assert "data.files is empty" in r.stderr  # every problem at once, not the first only


@pytest.mark.slow
def test_stopping_the_supervisor_stops_every_worker(tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             "run.steps=1000", "supervisor.progress=none"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline and not pids:
        r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
        if r.returncode == 0:
            table = json.loads(r.stdout)
            if all(w["pid"] and w["state"] != "starting" for w in table):
                pids = [w["pid"] for w in table]
        time.sleep(0.3)
    assert len(pids) == 4, "workers never all came up"
    proc.terminate()  # SIGTERM, as a CI timeout or `kill` would send
    assert proc.wait(timeout=30) != 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_two_rank_trainer_then_resume_from_its_checkpoint(tiny_model, math_data, tmp_path):
    """trainer.world_size=2: the supervisor starts the trainer under torchrun (FSDP2, gloo); a second launch
    with run.resume_from=latest continues at the checkpoint's step with the saved data cursor. Both log to W&B
    (offline) and MLflow (a sqlite store) too: the resumed launch continues the same runs, and each holds what
    metrics.jsonl holds, read back through the library's own files and client."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data, "supervisor.progress=plain",
              "logger=[jsonl,wandb,mlflow]", "wandb.mode=offline", f"mlflow.tracking_uri='{uri}'"]
    r = cli("launch", "tiny", *common, "trainer.world_size=2", "run.steps=2", "orchestrator.stream_tokens=1",
            "sampler.slots=8", "sampler.delay_s=0.2", env=env, timeout=240)  # 2 groups a generate call: parts
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "trainer rank 0 of 2" in log and "trainer rank 1 of 2" in log  # two ranks under torchrun
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["steps"] == 2 and first["books"]["lost"] == 0 and first["books"]["trainer_ids"]["match"]
    for line in map(json.loads, (run_dir / "trained_ids.jsonl").read_text().splitlines()):
        # each rank was sent only its own rows: half the step's groups each (streamed: every part split in two)
        mine, theirs = line["ranks"]
        assert len(mine) == len(theirs) == 4 * 4 and not set(mine) & set(theirs), line
        assert sorted(mine + theirs) == sorted(line["ids"]) and len(line["parts"]) > 1
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["extra"]["orchestrator"]["examples_drawn"] >= 2 * 8

    r = cli("launch", "tiny", *common, "run.steps=4", "run.resume_from=latest", env=env, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["resumed_from_step"] == 2 and second["policy_version"] == 4
    # the books of the whole run: the resumed launch read the ledger back (steps 1 and 2), then trained 3 and 4
    assert second["books"]["trained"] == 4 * 8 * 4 and second["books"]["lost"] == 0
    assert second["books"]["rolled_back"] == 0  # the checkpoint was the first launch's last step: nothing undone
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics if "version" in m] == [1, 2, 3, 4]
    assert all(m["staleness_mean"] == 0.0 for m in metrics if "version" in m)
    dashboards_hold_metrics_jsonl(run_dir, uri, runs=2)


def dashboards_hold_metrics_jsonl(run_dir: Path, uri: str, runs: int) -> None:
    """The run's W&B runs (offline files) and its MLflow run hold what metrics.jsonl holds; ``runs`` launches of
    this run_dir made one W&B run and one MLflow run between them."""
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from dashboards import jsonl_by_step, mlflow_metrics, wandb_runs

    ids = json.loads((run_dir / "trackers.json").read_text())
    expected = jsonl_by_step(run_dir / "metrics.jsonl")
    found = wandb_runs(run_dir)
    assert [r["id"] for r in found] == [ids["wandb"]] * runs
    history = {}
    for r in found:
        history.update(r["history"])
    assert history == expected
    assert mlflow_metrics(uri, ids["mlflow"]) == expected


@pytest.mark.slow
def test_swapping_a_verifier_during_a_run_loses_and_doubles_no_score(tiny_model, math_data, tmp_path):
    """`ctl swap verifier math math` mid-run: new workers start, the old one drains and exits; every rollout
    is scored exactly once and trained once."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps = 8
    # each generate call 0.5 s longer: the run outlasts the swap (a new verifier's start, the old one's drain); with
    # launches ~5 s quicker to start, 8 plain steps once ended first ("supervisor stopped answering")
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             f"run.steps={steps}", "supervisor.progress=none", "sampler.delay_s=0.5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # wait until training has begun (some scores are in)
        r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
        if r.returncode == 0 and any(w["role"] == "verifier" and w["counters"].get("scored", 0) > 40
                                     for w in json.loads(r.stdout)):
            break
        time.sleep(0.3)
    swap = cli("ctl", "--run-dir", str(run_dir), "swap", "verifier", "math", "math", env=env, timeout=150)
    assert swap.returncode == 0, swap.stdout + swap.stderr
    done = json.loads(swap.stdout.splitlines()[-1])
    assert done["retired"] == ["verifier-0"] and done["serving"] == ["verifier-1"]
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["duplicates_dropped"] == 0
    assert books["trained"] == steps * 8 * 4 == books["dispatched"]
    verifiers = {w["id"]: w for w in summary["workers"] if w["role"] == "verifier"}
    assert verifiers["verifier-0"]["state"] == "retired(0)"  # drained, exited cleanly
    old, new = (verifiers[v]["counters"]["scored"] for v in ("verifier-0", "verifier-1"))
    assert old > 0 and new > 0  # both scored: the swap happened mid-run
    evaluations = 2 * 16 * 2  # before and after: 16 held-out questions, avg@1 and greedy
    assert old + new == books["dispatched"] + evaluations  # every rollout scored exactly once
    assert all(v["counters"]["failed"] == 0 for v in verifiers.values())


@pytest.mark.slow
def test_scaling_samplers_up_and_down_during_a_run(tiny_model, math_data, tmp_path):
    """`ctl scale samplers=2` mid-run starts a sampler that loads the current weights before it takes work;
    `ctl scale samplers=1` drains the newest one; nothing is lost."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps = 30
    # each generate call 0.2 s longer: the run outlasts a sampler's start, its first rollouts and its drain (with
    # launches ~5 s quicker to start, 30 plain steps once ended while sampler-1 drained)
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             f"run.steps={steps}", "supervisor.progress=none", "sampler.delay_s=0.2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def table() -> dict:
        r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
        return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}

    def wait_for(cond, what: str, limit: float = 90) -> dict:
        t_end = time.monotonic() + limit
        while time.monotonic() < t_end and proc.poll() is None:
            if cond(t := table()):
                return t
            time.sleep(0.3)
        ended = "" if proc.poll() is None else f" (the run ended first: {proc.communicate()[0][-2000:]})"
        raise AssertionError(f"never: {what}{ended}")

    wait_for(lambda t: t.get("orchestrator", {}).get("version", 0) >= 2, "training began")
    up = cli("ctl", "--run-dir", str(run_dir), "scale", "samplers=2", env=env, timeout=30)
    assert up.returncode == 0 and json.loads(up.stdout)["started"] == ["sampler-1"], up.stdout + up.stderr
    wait_for(lambda t: t.get("sampler-1", {}).get("counters", {}).get("rollouts", 0) > 0, "sampler-1 sampled")
    down = cli("ctl", "--run-dir", str(run_dir), "scale", "samplers=1", env=env, timeout=30)
    assert down.returncode == 0 and json.loads(down.stdout)["draining"] == ["sampler-1"], down.stdout + down.stderr
    # drained and exited while the run goes on (on a loaded machine the run's last steps can outpace the exit)
    wait_for(lambda t: t.get("sampler-1", {}).get("state", "").startswith("retired"), "sampler-1 retired")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0
    assert books["trained"] == steps * 8 * 4
    workers = {w["id"]: w for w in summary["workers"]}
    assert workers["sampler-1"]["state"] == "retired(0)"  # drained and exited cleanly
    assert workers["sampler-1"]["counters"]["weight_loads"] >= 1  # joined late: current weights first
    assert workers["sampler-0"]["restarts"] == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["staleness_mean"] == 0.0 for m in metrics if "version" in m)  # still strictly on-policy


@pytest.mark.slow
def test_faults_killed_workers_are_restarted_and_their_work_redispatched(tiny_model, math_data, tmp_path):
    """SIGKILL a sampler, a verifier and a teacher mid-run (MOPD), each while it holds work: they restart, the run
    completes, and every dispatched rollout has exactly one fate, the trainer's ids the ledger's. (A killed trainer
    or orchestrator: tests/test_recovery.py.)"""
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    common = [f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data, "supervisor.progress=none",
              "supervisor.restart_backoff_s=0.2", "orchestrator.sampler_timeout_s=20",
              "orchestrator.verifier_timeout_s=10", "trainer.save_every=2"]

    def table() -> dict:
        r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
        return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}

    def wait_version(v: int) -> dict:
        t_end = time.monotonic() + 90
        while time.monotonic() < t_end:
            if (t := table()).get("orchestrator", {}).get("version", 0) >= v:
                return t
            time.sleep(0.2)
        raise AssertionError(f"version {v} never reached")

    steps = 10
    proc = subprocess.Popen([*CLI, "launch", "tiny", *common, f"run.steps={steps}", "stage=mopd",
                             f"+teacher.checkpoints.math={tiny_model}", "orchestrator.teacher_timeout_s=10"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_version(2)
    for worker in ("sampler-0", "verifier-0", "teacher-0"):  # each killed while it holds work
        pid = table()[worker]["pid"]
        os.kill(pid, signal.SIGSTOP)  # frozen: what the orchestrator hands it stays in its hands
        t_end = time.monotonic() + 90
        while not table().get("orchestrator", {}).get("counters", {}).get("workers", {}).get(worker, {}).get("items"):
            assert time.monotonic() < t_end, f"{worker} never held work"
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["redispatched"] > 0  # the sampler's groups went out again, under a new attempt
    assert all(summary["restarts"][w] >= 1 for w in ("sampler-0", "verifier-0", "teacher-0"))
    assert books["lost"] == 0 and books["in_flight"] == 0
    assert books["trained"] == steps * 8 * 4
    ledger = read_ledger(run_dir)  # rollout by rollout: exactly one fate each, the trainer's ids the ledger's
    assert len(ledger) == books["dispatched"] and books["trainer_ids"]["match"]
    assert sum(r["fate"] == "trained" for r in ledger.values()) == steps * 8 * 4
    assert any(r["attempt"] > 0 for r in ledger.values())  # trained on a later attempt: re-dispatched ids


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_async_mode_samples_up_to_k_batches_while_the_trainer_steps(k, tiny_model, math_data, tmp_path):
    """max_staleness=k: no trained rollout is more than k versions old and some are older than the newest
    weights (the sampler is slowed, so the trainer keeps up), nothing is lost; the launch refuses async GRPO
    without a correction."""
    run_dir = tmp_path / "run"
    if k == 1:
        bad = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                  "orchestrator.max_staleness=1", timeout=60)
        assert bad.returncode != 0 and "trainer.correction" in bad.stderr
    r = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
            f"orchestrator.max_staleness={k}", "trainer.correction=icepop", "run.steps=6",
            "supervisor.progress=none", "sampler.delay_s=0.5", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["lost"] == 0 and summary["books"]["trained"] == 6 * 8 * 4
    assert 0.0 < summary["trainer_busy_frac"] <= 1.0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staleness = [m["staleness_max"] for m in metrics if "version" in m]
    assert staleness[0] == 0 and 0 < max(staleness) <= k, staleness  # measured here: k=2 reaches 2
    trained = [r for r in read_ledger(run_dir).values() if r["fate"] == "trained"]
    assert len(trained) == 6 * 8 * 4 and max(r["step"] - r["version"] for r in trained) == max(staleness)
    assert all(0.0 <= m["trainer/correction/masked_frac"] <= 1.0 for m in metrics if "version" in m)


@pytest.mark.slow
def test_inline_runs_every_role_in_one_process_to_the_same_books(tiny_model, math_data, tmp_path):
    """`launch tiny --inline`: every role a thread of the supervisor's process (inproc sockets); the books, the
    ledger and the trainer's ids are those of a launch of processes. MOPD: a teacher too, so three threads load a
    model at once (before protocol/devices.py MODEL_LOADING, 2 launches of 3 failed with meta tensors)."""
    run_dir = tmp_path / "run"
    r = cli("launch", "tiny", "--inline", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
            "supervisor.progress=plain", "stage=mopd", f"+teacher.checkpoints.math={tiny_model}", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["trained"] == 3 * 8 * 4 == books["dispatched"] and books["lost"] == 0
    assert books["trainer_ids"]["match"] and len(read_ledger(run_dir)) == books["dispatched"]
    pids = {w["pid"] for w in summary["workers"]}
    assert len(pids) == 1 and {w["role"] for w in summary["workers"]} == {"orchestrator", "trainer", "sampler",
                                                                            "verifier", "teacher"}
    log = (run_dir / "logs" / "inline.log").read_text()
    assert "trainer-0 INFO" in log and "orchestrator INFO" in log  # one log, lines named by thread
    assert not (run_dir / "auth.keys").exists()  # inproc: nothing to authenticate


@pytest.mark.slow
def test_a_hung_verifier_makes_the_run_explain_itself(tiny_model, tmp_path):
    """A verifier that never returns (and a deadline far away): after orchestrator.stall_timeout_s the supervisor
    writes stall.txt naming the verifier and what it holds, what the orchestrator waits for, and every
    process's stack, the hung scoring function's among them."""
    run_dir = tmp_path / "run"
    data = tmp_path / "hang.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "domain": "test_hang", "answer": str(i + 1)}) + "\n"
                            for i in range(20)))
    plugin = Path(__file__).parent / "helpers" / "hostile_verifiers.py"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}",
                             f"data.files=[{data}]", f"verifier.plugins=[{plugin}]", "orchestrator.eval_n=0",
                             "orchestrator.eval_greedy=false", "orchestrator.verifier_timeout_s=600",
                             "orchestrator.stall_timeout_s=4", "supervisor.progress=plain"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stall, report = run_dir / "stall.txt", ""
    try:  # a slow start (no heartbeat yet within the 4 s) is a stall too: wait for the report of step 0's
        deadline = time.monotonic() + 120
        # (rewritten every stall_timeout_s while it lasts: wait for the one written once the scoring process hangs)
        while time.monotonic() < deadline and not ("step 0:" in report and "in hang" in report) \
                and proc.poll() is None:
            time.sleep(0.5)
            report = stall.read_text() if stall.is_file() else ""
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "waiting for: step 0: 0 of 8 groups kept, 8 being sampled and scored" in report, report
    verifier = next(line for line in report.splitlines() if line.strip().startswith("verifier"))
    assert "verifier-0" in verifier and "holds 32 items" in verifier and "s0g" in verifier, verifier
    sampler = next(line for line in report.splitlines() if line.strip().startswith("sampler"))
    assert "holds nothing" in sampler
    assert "--- verifier-0.log ---" in report and "--- orchestrator.log ---" in report and "--- trainer-0.log ---" in report
    assert 'in hang' in report and "hostile_verifiers.py" in report  # the scoring process's stack: where it hangs
    assert "stall.txt" in out  # and the supervisor said where to read it


def test_the_stall_watch_reports_past_the_timeout_again_while_it_lasts_and_resets_on_progress():
    from cascade_rl.supervisor.stall import StallWatch

    w = StallWatch(4.0)
    seen = [w.stalled({"progress": 1}, t) for t in (0.0, 3.9, 4.1, 5.0, 8.0, 8.2)]
    assert seen == [False, False, True, False, False, True]
    assert not w.stalled({"progress": 2}, 9.0) and not w.stalled({"progress": 2}, 12.9)
    assert w.stalled({"progress": 2}, 13.1)
    never = StallWatch(0.0)
    assert not any(never.stalled({"progress": 1}, t) for t in (0.0, 100.0, 10_000.0))

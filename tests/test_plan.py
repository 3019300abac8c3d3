"""The launch plan (supervisor/plan.py): what a launch decides and refuses before its first process, built from
the presets of configs/run/ and inspected without starting a process or binding a socket; the role table the
supervisor watches by (supervisor/procs.py ``ROLES``) and the checks of ``ctl scale`` / ``ctl swap``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from cascade_rl.protocol import auth
from cascade_rl.supervisor.config import CONFIG_DIR, compose
from cascade_rl.supervisor.config_errors import ConfigError
from cascade_rl.supervisor.plan import check_scale, check_swap, prepare, start_order
from cascade_rl.supervisor.procs import ROLES, SERVER_ROLES, Proc, next_ids, worker_command

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "run").glob("*.yaml"))


@pytest.fixture(autouse=True)
def no_keys_left_installed():
    """``prepare`` installs the run's CURVE keys in this process (the supervisor's own sockets use them): a plan
    with tcp endpoints would otherwise leave every later tcp socket of this test process a CURVE one."""
    yield
    auth.install(None)


@pytest.fixture
def plans():
    """plans(cfg, inline=False): ``prepare``'s plan; its socket folder and launcher are given back after the test."""
    made = []

    def make(cfg, inline=False):
        plan = prepare(cfg, inline)
        made.append(plan)
        return plan

    yield make
    for plan in made:
        plan.launcher.close()
        shutil.rmtree(plan.sock_dir, ignore_errors=True)


def launch_cfg(preset, tmp_path, tiny_model, data, *overrides):
    return compose(preset, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}", *data, *overrides])


def roles(procs: list[Proc]) -> list[str]:
    return [p.worker_id for p in procs]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_plans_its_processes_endpoints_and_config_without_starting_any(preset, plans, tmp_path,
                                                                                     tiny_model, tiny_data):
    data = [f"data.files=[{tiny_data['rl']['arithmetic']}]", f"data.eval_files=[{tiny_data['heldout']['arithmetic']}]"]
    plan = plans(launch_cfg(preset, tmp_path, tiny_model, data, "sampler.count=2", "verifier.count=2"))
    cfg, run_dir = plan.cfg, tmp_path / "run"
    assert plan.run_dir == run_dir and plan.config_path == run_dir / "config.yaml"
    assert roles(plan.procs) == ["orchestrator", "trainer-0", "sampler-0", "sampler-1"]
    assert roles(plan.after_judge) == ["verifier-0", "verifier-1"] and plan.judge is None
    assert all(p.handle is None for p in plan.procs + plan.after_judge)  # nothing started
    assert plan.procs[1].ranks == cfg.trainer.world_size and [p.slot for p in plan.procs[2:]] == [0, 1]
    # one machine, no host: ipc endpoints in the run's own 0700 folder
    assert {k: cfg.endpoints[k] for k in ("orchestrator", "weights", "heartbeat", "control")} == {
        name: f"ipc://{plan.sock_dir}/{name}" for name in ("orchestrator", "weights", "heartbeat", "control")}
    assert plan.sock_dir.stat().st_mode & 0o777 == 0o700
    # the keys: a 0600 file beside the run, config.yaml names its path only
    if auth.curve_available():
        keys = Path(cfg.auth_keys)
        assert keys == run_dir / auth.KEY_FILE and keys.stat().st_mode & 0o777 == 0o600
        assert json.loads(keys.read_text())["server_secret"] not in plan.config_yaml
    # config.yaml is the resolved config; the plan holds it, the supervisor writes it
    assert not plan.config_path.exists()
    written = yaml.safe_load(plan.config_yaml)
    assert written["run_id"] == cfg.run_id and written["endpoints"]["control"] == cfg.endpoints.control
    assert written["model"]["path"] == str(Path(tiny_model).resolve()) and written["inline"] is False
    assert written["verifier"]["domains"] == ["math"]  # settled by the data
    assert (run_dir / "data").is_dir() and (run_dir / "logs").is_dir()


def test_tcp_endpoints_on_host_and_inproc_inline(plans, tmp_path, tiny_model, math_data):
    tcp = plans(launch_cfg("tiny", tmp_path / "tcp", tiny_model, math_data, "host=127.0.0.1", "auth=false")).cfg
    ports = {tcp.endpoints[n].removeprefix("tcp://127.0.0.1:") for n in ("orchestrator", "weights", "heartbeat",
                                                                          "control")}
    assert len(ports) == 4 and all(p.isdigit() for p in ports) and tcp.auth_keys == ""

    plan = plans(launch_cfg("tiny", tmp_path / "inline", tiny_model, math_data), inline=True)
    assert plan.cfg.endpoints.control == f"inproc://{plan.cfg.run_id}/control"
    assert plan.cfg.auth_keys == "" and plan.cfg.inline is True  # one process: no tcp socket, no keys


def test_a_served_judge_starts_first_and_the_verifiers_once_it_answers(plans, tmp_path, tiny_model):
    judged = tmp_path / "judged.jsonl"
    judged.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "domain": "llm_judge", "answer": str(a + 1)})
                              + "\n" for a in range(40)))
    plan = plans(compose("tiny", [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}", f"data.files=[{judged}]",
                                  "orchestrator.eval_n=0", "verifier.judge.serve=torch",
                                  f"verifier.judge.path={tiny_model}", "verifier.judge.max_tokens=64"]))
    assert plan.judge is plan.procs[0] and plan.judge.cmd and plan.judge.role in SERVER_ROLES
    port = plan.cfg.verifier.judge.port
    assert port > 0 and str(port) in plan.judge.cmd  # the port config.yaml's base_url names
    assert yaml.safe_load(plan.config_yaml)["verifier"]["judge"]["base_url"] == f"http://127.0.0.1:{port}"
    assert roles(plan.after_judge) == ["verifier-0"]


def test_teachers_one_per_distinct_checkpoint_in_the_start_order(tiny_model, tmp_path):
    cfg = compose("tiny", [f"model.path={tiny_model}", "environment.count=2"], check=False)
    cfg.teacher.checkpoints = {"math": tiny_model, "code": tiny_model, "chat": str(tmp_path)}
    cfg.environment.serve = ["python"]
    first, after, served = start_order(cfg)
    assert roles(first) == ["orchestrator", "trainer-0", "sampler-0", "environment-0", "environment-1",
                            "teacher-0", "teacher-1"] and roles(after) == ["verifier-0"] and served is None
    teachers = {p.args[1]: p.args[3] for p in first if p.role == "teacher"}
    assert teachers == {str(Path(tiny_model).resolve()): "code,math", str(tmp_path.resolve()): "chat"}


# --------------------------------------------------------------------------- refusals: before anything is made

def test_inline_refuses_what_one_process_cannot_run(tmp_path, tiny_model, math_data):
    with pytest.raises(ConfigError, match="--inline runs one trainer rank"):
        prepare(launch_cfg("tiny", tmp_path, tiny_model, math_data, "trainer.world_size=2"), inline=True)
    assert not (tmp_path / "run" / "data").exists()  # refused before the data is read


def test_gpus_the_machine_lacks_are_refused_after_the_data_and_before_any_endpoint(tmp_path, tiny_model, math_data,
                                                                                    monkeypatch):
    from cascade_rl.supervisor import placement

    monkeypatch.setattr(placement, "visible_gpus", lambda: 0)
    cfg = launch_cfg("tiny", tmp_path, tiny_model, math_data, "gpus.samplers=[0]")
    with pytest.raises(ConfigError, match="GPU layout:\n  .*no CUDA device"):
        prepare(cfg)
    assert not cfg.run_id and not cfg.auth_keys and not (tmp_path / "run" / auth.KEY_FILE).exists()


def test_tcp_without_curve_is_refused(tmp_path, tiny_model, math_data, monkeypatch):
    monkeypatch.setattr(auth, "curve_available", lambda: False)
    with pytest.raises(ConfigError, match="host=127.0.0.1: this libzmq .* no CURVE security.*auth=false"):
        prepare(launch_cfg("tiny", tmp_path, tiny_model, math_data, "host=127.0.0.1"))


# --------------------------------------------------------------------------- the watch loop's data

def test_the_role_table_names_each_role_a_module_or_a_server():
    assert SERVER_ROLES == {"sglang", "judge"}
    assert {name for name, role in ROLES.items() if role.ends_run} == {"orchestrator", "trainer"}
    assert ROLES["orchestrator"].ends_run(0, Path("/r")) == "done"
    assert "logs/orchestrator.log" in ROLES["orchestrator"].ends_run(1, Path("/r"))
    assert ROLES["orchestrator"].ends_run(-9, Path("/r")) == ""  # killed: the data plane rewinds, the run goes on
    assert ROLES["trainer"].ends_run(1, Path("/r")) == ROLES["trainer"].ends_run(-9, Path("/r")) == ""
    for role in ("orchestrator", "trainer"):  # a full disk stops the run with what to do
        assert "no space left" in (why := ROLES[role].ends_run(28, Path("/"))) and "resume=true" in why
    cmd = worker_command(Proc("verifier", "verifier-3", args=["--impl", "math=math"]), Path("/r/config.yaml"))
    assert cmd == ["python", "-P", "-m", "cascade_rl.verifiers.worker", "--config", "/r/config.yaml",
                   "--worker-id", "verifier-3", "--impl", "math=math"]
    assert worker_command(Proc("sglang", "sglang-0", cmd=["srv"]), Path("/c")) == ["srv"]


def test_new_worker_ids_follow_every_id_the_run_has_had():
    assert next_ids("verifier", ["orchestrator", "verifier-0", "verifier-3", "sampler-7"], 2) == ["verifier-4",
                                                                                                  "verifier-5"]
    assert next_ids("sampler", ["sglang-0"], 1) == ["sampler-0"] and next_ids("sampler", ["sampler-0"], -1) == []


def test_ctl_requests_are_refused_with_what_is_served(tiny_model):
    cfg = compose("tiny", [f"model.path={tiny_model}", "verifier.domains=[math]"], check=False)
    check_scale("sampler", 2)
    check_swap(cfg, "verifier", "math", "math")
    for bad, wanted in ((lambda: check_scale("teacher", 2), "samplers=N or verifiers=N"),
                        (lambda: check_scale("sampler", 0), "got samplers=0"),
                        (lambda: check_swap(cfg, "sampler", "math", "math"), "swap supports verifiers"),
                        (lambda: check_swap(cfg, "verifier", "code", "math"), "no verifier serves domain 'code'"),
                        (lambda: check_swap(cfg, "verifier", "math", "nope"), "no verifier named 'nope'")):
        with pytest.raises(ValueError, match=wanted):
            bad()


def test_vllm_plans_its_kv_cache_for_the_stage_rows_not_the_model_context(tiny_model, tmp_path):
    """sampler.vllm.max_model_len=0: the stage's longest row (prompt cap + response), capped by the model's own."""
    from cascade_rl.supervisor.plan import vllm_context

    long_model = tmp_path / "long"
    long_model.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text()) | {"max_position_embeddings": 262144}
    (long_model / "config.json").write_text(json.dumps(config))
    rlhf = compose(None, ["stage=rlhf", f"model.path={long_model}", "sampler.engine=vllm"], check=False)
    assert vllm_context(rlhf) == 4096 + 16384
    rlhf.model.path = tiny_model  # a 512-token model: its own context
    assert vllm_context(rlhf) == 512

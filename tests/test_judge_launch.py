"""The judge model served by the supervisor (``verifier.judge.serve``, supervisor/judge.py): the server command of
each choice and the config's refusals (pure), ``serving_judge`` around a block, and a real ``cascade-rl launch tiny``
of GenRM and LLM-judge prompts during which the judge is SIGKILLed while it holds requests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf
from test_launch import CLI, cli, read_ledger

from cascade_rl.supervisor import judge
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.config_errors import ConfigError
from cascade_rl.supervisor.schema import JudgeConfig

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # hostile_verifiers, for the pool's spawned processes


def judge_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(JudgeConfig), kw)


@pytest.fixture(scope="module")
def judged_data(tmp_path_factory) -> Path:
    """LLM-judge rows (a question and its reference answer) and GenRM rows (a request, no reference)."""
    path = tmp_path_factory.mktemp("judged") / "judged.jsonl"
    with open(path, "w") as f:
        for a in range(1, 41):
            f.write(json.dumps({"prompt": f"What is {a} + {a + 3}?", "domain": "llm_judge", "answer": str(2 * a + 3)})
                    + "\n")
            f.write(json.dumps({"prompt": f"Describe the number {a}.", "domain": "genrm"}) + "\n")
    return path


# --------------------------------------------------------------------------- pure: commands and refusals

def test_each_serve_choice_builds_its_server_command(judge_model):
    torch_cmd = judge.server_command(judge_cfg(serve="torch", path=judge_model, model="rm", args=["--max-batch", 8]),
                                     8123)
    assert torch_cmd[:4] == [sys.executable, "-P", "-m", "cascade_rl.samplers.chat_server"]
    assert torch_cmd[4:] == ["--model", judge_model, "--host", "127.0.0.1", "--port", "8123", "--served-model-name",
                             "rm", "--max-batch", "8"]
    vllm_cmd = judge.server_command(judge_cfg(serve="vllm", path=judge_model, args=["--max-model-len", "4096"]), 9)
    assert vllm_cmd == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", judge_model,
                        "--host", "127.0.0.1", "--port", "9", "--served-model-name", "judge", "--max-model-len", "4096"]
    assert set(judge.SERVERS) == {"torch", "vllm"}

    cfg = judge_cfg(serve="torch", path=judge_model)
    judge.apply_defaults(cfg)
    port = judge.assign_port(cfg)
    assert cfg.model == "judge" and port > 0 and cfg.base_url == f"http://127.0.0.1:{port}"
    unserved = judge_cfg(serve="none")
    judge.apply_defaults(unserved)
    assert unserved.model == "" and not judge.serves(unserved)


def test_config_refusals_name_the_field(judge_model, tiny_model, tmp_path, monkeypatch):
    assert judge.problems(judge_cfg(serve="torch", path=judge_model)) == []
    # the default 4096 verdict tokens leave no room for a prompt in a 512-token judge: every request would be refused
    assert "verifier.judge.max_tokens=64" in judge.problems(judge_cfg(serve="torch", path=tiny_model))[0]
    assert "needs verifier.judge.path" in judge.problems(judge_cfg(serve="torch"))[0]
    assert "is not an HF model directory" in judge.problems(judge_cfg(serve="torch", path=str(tmp_path)))[0]
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "set verifier.judge.serve=vllm" in judge.problems(judge_cfg(serve="torch", path=str(llama)))[0]
    assert "serve=none" in judge.problems(judge_cfg(path=judge_model))[0]
    assert "retries=-1" in judge.problems(judge_cfg(retries=-1))[0]
    assert "startup_s" in judge.problems(judge_cfg(serve="torch", path=judge_model, startup_s=0))[0]
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without vllm: `import vllm` fails
    assert "vllm is not installed" in judge.problems(judge_cfg(serve="vllm", path=judge_model))[0]


def test_launch_config_refuses_a_judge_it_cannot_serve(tiny_model, judged_data, tmp_path):
    common = [f"model.path={tiny_model}", f"data.files=[{judged_data}]", f"run_dir={tmp_path / 'r'}"]
    with pytest.raises(ConfigError, match=r"verifier.judge.path=/nowhere is not an HF model directory"):
        compose("tiny", [*common, "verifier.judge.serve=torch", "verifier.judge.path=/nowhere"])
    with pytest.raises(ConfigError, match=r"verifier.judge.serve: .*expected one of \[none, torch, vllm\]"):
        compose("tiny", [*common, "verifier.judge.serve=tgi"])
    cfg = compose("tiny", [*common, "verifier.judge.serve=torch", f"verifier.judge.path={tiny_model}",
                          "verifier.judge.max_tokens=64"])
    assert cfg.verifier.judge.model == "judge"  # the served name, which the verifiers send
    r = cli("launch", "tiny", *common, "verifier.judge.serve=torch", "verifier.judge.path=/nowhere", timeout=120)
    assert r.returncode == 2 and "verifier.judge.path=/nowhere" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# --------------------------------------------------------------------------- serving_judge around a block

def test_serving_judge_for_a_block(judge_model, tmp_path):
    log = tmp_path / "logs" / "judge.log"
    with judge.serving_judge(judge_cfg(serve="torch", path=judge_model, args=["--threads", "1"]), log) as url:
        assert judge.healthy(url)
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "judge", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).json()
        assert reply["usage"]["completion_tokens"] >= 1
        pid = _listener_pid(url)
    assert not judge.healthy(url)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the server's whole process group is gone
    assert "SIGTERM: stopping" in log.read_text()
    with judge.serving_judge(judge_cfg(base_url="http://elsewhere:1"), log) as url:
        assert url == "http://elsewhere:1"  # serve=none: nothing started


def test_serving_judge_that_cannot_start_names_its_log(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen3"}))  # no weights, no tokenizer
    log = tmp_path / "judge.log"
    with pytest.raises(judge.JudgeStartError, match=r"exited with code 1 .*see .*judge.log") as e:
        with judge.serving_judge(judge_cfg(serve="torch", path=str(broken)), log):
            pass
    assert "cannot serve" in str(e.value)  # the log's last lines, the server's own one-line reason among them


def test_a_hung_or_dead_judge_makes_the_score_unavailable(judge_model, tmp_path):
    """The verifier worker's pool scoring llm_judge against a judge that is frozen (SIGSTOP: its deadline passes) and
    then dead (SIGKILL: the connection is refused): both ``unavailable``, so the orchestrator fails the group rather
    than train on a 0; a hung verifier of a domain without a judge stays a plain failure."""
    from cascade_rl.protocol.messages import ScoreRequest, WorkKey
    from cascade_rl.verifiers.worker import Pool

    cfg = judge_cfg(serve="torch", path=judge_model, args=["--threads", "1"])
    with judge.serving_judge(cfg, tmp_path / "judge.log") as url:
        settings = {"judge": {"base_url": url, "model": "judge", "retries": 0, "timeout_s": 60, "max_tokens": 8}}
        pool = Pool(1, {"math": "test_hang"}, ["hostile_verifiers"], settings, depth=2)
        try:
            pid = _listener_pid(url)
            os.kill(pid, signal.SIGSTOP)
            ask = {"question": "What is 3 + 4?"}  # answered "It is 7.", not "7": the reference itself needs no judge
            pool.submit(ScoreRequest(WorkKey.score("g", 0, 0), "llm_judge", "<think>\n</think>\n\nIt is 7.", "7", ask, 3.0))
            hung = _collect(pool, 1)[0]
            assert not hung.ok and hung.unavailable and hung.reason.startswith("timeout")
            os.killpg(pid, signal.SIGKILL)
            pool.submit(ScoreRequest(WorkKey.score("g", 1, 0), "llm_judge", "<think>\n</think>\n\nIt is 7.", "7", ask, 30.0))
            dead = _collect(pool, 1)[0]
            assert not dead.ok and dead.unavailable and "JudgeError: judge request" in dead.reason
            pool.submit(ScoreRequest(WorkKey.score("g", 2, 0), "math", "7", "7", {}, 1.0))
            plain = _collect(pool, 1)[0]
            assert not plain.ok and not plain.unavailable and plain.reason.startswith("timeout")
        finally:
            pool.close()


def _collect(pool, n: int, timeout_s: float = 60.0) -> list:
    out, t_end = [], time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < t_end, "no score came back"
        out += pool.collect(0.1)
    return out


def _listener_pid(url: str) -> int:
    """The pid of the process listening on the URL's port (from /proc, no tools needed)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"nothing listens on {url}")


# --------------------------------------------------------------------------- real launches

def _launch(run_dir: Path, env: dict, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", *overrides, "supervisor.progress=none"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _common(tiny_model, judged_data, judge_model) -> list[str]:
    # data.thinking=false: the policy's turn opens with a closed think block, so its random text is a final answer
    # that the judge is asked about (an unclosed <think> scores 0 without a judge call)
    return [f"model.path={tiny_model}", f"data.files=[{judged_data}]", "data.thinking=false",
            "verifier.judge.serve=torch", f"verifier.judge.path={judge_model}", "verifier.judge.max_tokens=8",
            "verifier.judge.args=[--threads,1]"]


def _table(run_dir: Path, env: dict) -> dict:
    r = cli("ctl", "--run-dir", str(run_dir), "status", "--json", env=env, timeout=30)
    return {w["id"]: w for w in json.loads(r.stdout)} if r.returncode == 0 else {}


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_launch_serves_the_judge_and_outlives_its_death(tiny_model, judged_data, judge_model, tmp_path):
    """One launch (two would double the minutes): the judge serves step 0 as a row of ctl status; then, frozen while
    it holds requests and SIGKILLed, its groups are filtered with the reason, the supervisor restarts it on the same
    port, the run completes, and the judge is gone with it."""
    run_dir, env = tmp_path / "run", dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    steps = 3
    # retries=0: a request to the dead judge fails at once, so its group fails with the reason
    proc = _launch(run_dir, env, *_common(tiny_model, judged_data, judge_model), f"run.steps={steps}",
                   "verifier.judge.retries=0", "supervisor.restart_backoff_s=0.2")
    t_end = time.monotonic() + 240
    while (table := _table(run_dir, env)).get("orchestrator", {}).get("version", 0) < 1:
        assert time.monotonic() < t_end and proc.poll() is None, "the run never finished its first step"
        time.sleep(0.2)
    row = table["judge"]
    assert row["role"] == "judge" and row["state"] == "serving" and not _gone(row["pid"])
    config = OmegaConf.load(run_dir / "config.yaml").verifier.judge  # what every verifier reads
    assert config.base_url == f"http://127.0.0.1:{config.port}" and config.model == "judge"

    os.kill(row["pid"], signal.SIGSTOP)  # frozen: the judge calls made now wait on it
    t_end = time.monotonic() + 90
    while not _table(run_dir, env).get("orchestrator", {}).get("counters", {}).get("workers", {}).get(
            "verifier-0", {}).get("items"):  # every domain is judged: what the verifier holds waits on the judge
        assert time.monotonic() < t_end, "the verifier never held a judged score"
        time.sleep(0.2)
    time.sleep(1.0)  # its scoring processes have sent their requests
    os.killpg(row["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    judge_row = next(w for w in summary["workers"] if w["id"] == "judge")
    assert summary["restarts"]["judge"] >= 1 and judge_row["pid"] != row["pid"]  # restarted, on the same port
    assert _gone(row["pid"]) and _gone(judge_row["pid"])  # stopped with the run: its process group is gone
    books = summary["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trainer_ids"]["match"]
    ledger = read_ledger(run_dir)  # every rollout exactly one fate; the trainer's ids the ledger's
    assert len(ledger) == books["dispatched"]
    assert sum(r["fate"] == "trained" for r in ledger.values()) == books["trained"] == steps * 8 * 4
    assert all(r["fate"] == "trained" for r in ledger.values() if r["step"] == 0)  # before the kill: all judged
    filtered = [r for r in ledger.values() if r["fate"] == "filtered"]
    assert filtered and all(r["reason"].startswith("verifier_unavailable: JudgeError: judge request")
                            for r in filtered)
    served = json.loads((run_dir / "logs" / "judge.log").read_text().split("stopped: ")[-1].splitlines()[0])
    assert served["requests"] > 0 and served["errors"] == 0  # the restarted judge answered the later steps
    log = (run_dir / "logs" / "judge.log").read_text()
    assert log.count(f"listening on {config.base_url};") == 2  # both lives of the judge, on one port

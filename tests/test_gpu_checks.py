"""bench/gpu_checks.sh cannot lose what it measured: rehearsed on the CPU (GPU_CHECKS_ALLOW_CPU=1), with a tests
part that its cap has to kill, the real script in a copy of bench/ (its results stay in tmp_path).

    .venv/bin/pytest -q tests/test_gpu_checks.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAS_PYTEST_TIMEOUT = importlib.util.find_spec("pytest_timeout") is not None

# The tests part's selection in the rehearsal: what each outcome looks like, and a test that only SIGKILL stops.
FAKE_TESTS = '''
import time

import pytest


def test_passes():
    pass


def test_skips():
    pytest.skip("a reason")


def test_stuck_until_its_own_timeout():  # pytest-timeout fails it and the next tests run
    time.sleep(60)


def test_passes_after():
    pass


def test_hangs_through_everything():  # swallows pytest-timeout's failure and the cap's SIGTERM
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            time.sleep(60)
        except BaseException:
            pass


def test_never_reached():
    pass
'''
HANG = "tests/test_rehearsal.py::test_hangs_through_everything"


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_checks_report", ROOT / "bench" / "gpu_checks_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rehearsal_repo(tmp_path: Path) -> Path:
    """bench/ and pyproject.toml copied (the script cd's to its checkout and writes bench/results there)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "bench", repo / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", repo)
    (repo / "tests").mkdir()
    fake = FAKE_TESTS if HAS_PYTEST_TIMEOUT else FAKE_TESTS.replace("time.sleep(60)\n\n\ndef test_passes_after",
                                                                    "pass\n\n\ndef test_passes_after")
    (repo / "tests" / "test_rehearsal.py").write_text(fake)
    return repo


@pytest.mark.slow
def test_a_part_killed_at_its_cap_keeps_its_finished_tests_and_the_later_parts_run(tmp_path):
    repo, out = rehearsal_repo(tmp_path), tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PY": sys.executable, "SITE": str(tmp_path / "site"), "OUT": str(out),
           "GPU_CHECKS_ALLOW_CPU": "1", "GPU_CHECKS_ONLY": "tests,logprob_kernel",
           "GPU_CHECKS_TESTS": "tests/test_rehearsal.py", "GPU_CHECKS_CAP_TESTS": "14",
           "GPU_CHECKS_TEST_TIMEOUT_S": "2", "GPU_CHECKS_GRACE_S": "2", "GPU_CHECKS_TICK_S": "1"}
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "bench/gpu_checks.sh"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # what $OUT holds while the script runs: always a whole, valid JSON once there is one
    snapshots = []
    while proc.poll() is None and time.monotonic() - t0 < 150:
        try:
            text = (out / "gpu_checks.json").read_text()
        except FileNotFoundError:
            text = None
        if text is not None:
            snapshots.append(json.loads(text))
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    log = proc.communicate()[0]
    assert proc.returncode == 0, log[-3000:]
    assert time.monotonic() - t0 < 120, log[-3000:]

    # while the tests part ran: the parts before it done, it running (with its finished tests), the rest pending
    during = [s for s in snapshots if s["parts"]["tests"]["status"] == "running"]
    assert during, f"no snapshot of $OUT/gpu_checks.json while tests ran ({len(snapshots)} in all)\n{log[-3000:]}"
    assert all(s["parts"]["install"]["status"] == "ok" and s["parts"]["machine"]["status"] == "ok" for s in during)
    assert all(s["parts"]["logprob_kernel"]["status"] == "pending" and not s["final"] for s in during)
    assert all({"install", "machine", "launch_tiny"} <= set(s["done"]) for s in during)
    live = [s["parts"]["tests"].get("figures", {}).get("per_test", {}) for s in during]
    assert any(t.get("tests/test_rehearsal.py::test_passes", [None])[0] == "passed" for t in live)

    final = json.loads((out / "gpu_checks.json").read_text())
    assert final == json.loads((repo / "bench" / "results" / "gpu_checks.json").read_text())
    assert final["final"] and not final["ok"] and final["not_ok"] == ["tests"]
    tests = final["parts"]["tests"]
    # the hung test swallowed the SIGTERM: SIGKILL after the grace, no JUnit XML, the JSON lines kept
    assert tests["status"] == "timed_out" and tests["exit"] == 137 and tests["cap_s"] == 14, tests
    fig = tests["figures"]
    assert fig["running_when_stopped"] == HANG
    assert (fig["passed"], fig["skipped"], fig["failed"]) == (2, 1, 1 if HAS_PYTEST_TIMEOUT else 0), fig
    assert fig["per_test"]["tests/test_rehearsal.py::test_passes_after"][0] == "passed"
    assert fig["skips"] == {"tests/test_rehearsal.py::test_skips": "Skipped: a reason"}
    if HAS_PYTEST_TIMEOUT:
        assert "Timeout" in fig["failures"]["tests/test_rehearsal.py::test_stuck_until_its_own_timeout"]
    assert not any("never_reached" in t or "hangs" in t for t in fig["per_test"])
    # later parts still ran; the others say why they did not
    assert final["parts"]["logprob_kernel"]["status"] == "ok"
    assert final["parts"]["logprob_kernel"]["figures"]["name"] == "logprob_kernel"
    assert "GPU_CHECKS_ONLY" in final["parts"]["launch_tiny"]["reason"]
    assert final["parts"]["install"]["status"] == "ok"

    # what comes back from the device tool: few files, the machine's answers, every log
    assert sorted(p.name for p in out.iterdir()) == ["gpu_checks.json", "gpu_checks_logs.tar.gz", "machine.json"]
    machine = json.loads((out / "machine.json").read_text())
    assert machine == final["machine"] and machine["cuda_available"] is False
    assert machine["cuda_ipc"]["allowed"] == "no cuda"
    assert machine["dev_shm"]["size_bytes"] > 0 and "torch" in machine and "triton" in machine
    with tarfile.open(out / "gpu_checks_logs.tar.gz") as tar:
        names = tar.getnames()
    assert "bench/results/gpu_checks/tests.jsonl" in names and "bench/results/logprob_kernel.json" in names


def test_pytest_plugin_turns_sigterm_into_an_interrupt_that_still_writes_the_xml(tmp_path):
    (tmp_path / "test_two.py").write_text("import time\n\ndef test_first():\n    pass\n\n"
                                          "def test_sleeps():\n    time.sleep(60)\n")
    jsonl, xml = tmp_path / "tests.jsonl", tmp_path / "tests.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench"), "GPU_CHECKS_TESTS_JSONL": str(jsonl)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "gpu_checks_pytest", "-p", "no:cacheprovider",
                             f"--junitxml={xml}", "test_two.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "test_sleeps" not in (jsonl.read_text() if jsonl.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=30)[0]
    assert proc.returncode == 2, log  # pytest's "interrupted"
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["event"], r["test"]) for r in lines] == [
        ("start", "test_two.py::test_first"), ("result", "test_two.py::test_first"),
        ("start", "test_two.py::test_sleeps"), ("interrupted", "test_two.py::test_sleeps")]
    assert lines[1]["outcome"] == "passed" and lines[3]["signal"] == "SIGTERM"
    cases = ET.parse(xml).getroot().iter("testcase")
    assert [c.get("name") for c in cases if c.get("name")] == ["test_first"]


def test_report_says_what_ran_what_runs_and_what_the_run_was_cut_in(tmp_path):
    report = load_report()
    logs = tmp_path / "results" / "gpu_checks"
    logs.mkdir(parents=True)
    now = int(time.time())
    for name, files in {"install": {"start": now - 9, "cap": 45, "rc": 0, "secs": 3},
                        "launch_tiny": {"start": now - 6, "cap": 150, "rc": 124, "secs": 150},
                        "tests": {"start": now - 5, "cap": 150}}.items():
        for ext, value in files.items():
            (logs / f"{name}.{ext}").write_text(f"{value}\n")
    (logs / "machine.skip").write_text("a reason\n")
    (logs / "tests.jsonl").write_text(
        '{"event": "start", "test": "t.py::a"}\n{"event": "result", "test": "t.py::a", "outcome": "passed", '
        '"seconds": 1.5}\n{"event": "start", "test": "t.py::b"}\n{"event": "res')  # cut by a SIGKILL
    (tmp_path / "results" / "gpu_launch_tiny_torch_cuda.json").write_text('{"value": 0.5, "pass": true}')

    now_ = report.build(logs, 480)
    parts = now_["parts"]
    assert [parts[n]["status"] for n in ("install", "machine", "launch_tiny", "tests", "moe_kernels")] == [
        "ok", "skipped", "timed_out", "running", "pending"]
    assert parts["launch_tiny"]["figures"] == {"value": 0.5, "pass": True}
    assert parts["tests"]["figures"]["per_test"] == {"t.py::a": ["passed", 1.5]}
    assert parts["tests"]["figures"]["running_when_stopped"] == "t.py::b"
    assert not now_["ok"] and not now_["final"]

    final = report.build(logs, 480, final=True)
    assert final["parts"]["tests"]["status"] == "interrupted" and final["parts"]["moe_kernels"]["status"] == "not_run"
    assert final["not_ok"] == ["launch_tiny", "tests"] and final["done"] == ["install", "machine", "launch_tiny"]

    # no JSON lines (an older run, or the plugin not loaded): pytest's XML
    (logs / "tests.jsonl").unlink()
    (logs / "tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a" time="2.0"/><testcase classname="t" name="b">'
        '<failure message="boom"/></testcase><testcase time="0"/></testsuite></testsuites>')
    fig = report.build(logs, 480)["parts"]["tests"]["figures"]
    assert (fig["tests"], fig["passed"], fig["failed"], fig["failures"]) == (2, 1, 1, {"t::b": "boom"})

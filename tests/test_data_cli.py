"""The command line facing users' data and config mistakes: `data check` lists every bad row, `launch` refuses
bad data before any process starts, `make-data` writes the built-in tasks, and config mistakes are one message
with exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cascade_rl.supervisor.config import compose

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
GOOD = {"prompt": "What is 1 + 1? Put the final answer in \\boxed{}.", "domain": "math", "answer": "2"}
BAD_LINES = {  # line -> (row, words of its reason)
    2: ('{"prompt": "x", "domain": "math"', "invalid JSON"),
    3: ('{"domain": "math"}', "missing field 'prompt'"),
    4: ('{"prompt": "x", "domain": "poetry"}', "domain 'poetry' has no registered verifier"),
    5: ('{"prompt": "", "domain": "math"}', "field 'prompt' is empty"),
    6: ('{"prompt": "x", "domain": "mcqa", "answer": "Z"}', "the mcqa verifier rejects this row"),
    7: ('{"prompt": {"a": 1}, "domain": "math"}', "must be a string or a list of {role, content} messages"),
    8: ('"just a string"', "must be a JSON object"),
    9: ('{"prompt": [{"role": "user"}], "domain": "math"}', "must be an object with string 'role' and 'content'"),
}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def bad_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps(GOOD)] + [BAD_LINES[n][0] for n in sorted(BAD_LINES)] + [json.dumps(GOOD)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_data_check_prints_every_bad_row_with_its_line_and_exits_1(bad_file, tiny_model):
    r = cli("data", "check", str(bad_file), "--model", tiny_model, "data.max_prompt_tokens=4")
    assert r.returncode == 1, r.stderr
    out = r.stdout.splitlines()
    for n, (_, words) in BAD_LINES.items():
        assert any(line.startswith(f"{bad_file}:{n}: ") and words in line for line in out), (n, words)
    # the two good rows are 4+ tokens in the chat template: overlong at 4, each with its line
    assert f"{bad_file}:1: overlong prompt" in r.stdout and f"{bad_file}:10: overlong prompt" in r.stdout
    assert "train prompt tokens: p50" in r.stdout and "10 bad rows" in r.stdout
    assert "Traceback" not in r.stderr


def test_data_check_of_good_files_and_remapped_fields(tmp_path, tiny_data):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "label": "4"}) + "\n")
    r = cli("data", "check", str(path), "data.fields.prompt=question", "data.fields.answer=label",
            "data.default_domain=math")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every row is valid" in r.stdout and "math" in r.stdout
    r = cli("data", "check", tiny_data["rl"]["arithmetic_mcqa"], f"data.eval_files=[{tiny_data['heldout']['arithmetic']}]")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every row is valid" in r.stdout and "│ mcqa " in r.stdout and "│ math " in r.stdout


def test_launch_refuses_bad_data_before_any_process_starts(bad_file, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    r = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", f"data.files=[{bad_file}]")
    assert r.returncode == 1
    for n, (_, words) in BAD_LINES.items():
        assert f"{bad_file}:{n}: " in r.stderr and words in r.stderr
    assert "8 bad rows" in r.stderr and "data.on_bad_row=skip" in r.stderr and "Traceback" not in r.stderr
    # no process started: no worker's log (the supervisor's own log, supervisor/console.py, is there from the start)
    assert not (run_dir / "supervisor.json").exists()
    assert [p.name for p in (run_dir / "logs").glob("*.log")] == ["supervisor.log"]


def test_skipped_bad_rows_are_counted_per_reason(bad_file, tiny_model, tmp_path, prepared):
    cfg = prepared(compose("tiny", [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}",
                                    f"data.files=[{bad_file}]", "data.on_bad_row=skip"]))
    recorded = json.loads((Path(cfg.run_dir) / "data" / "data.json").read_text())  # what summary.json carries
    assert recorded["bad_rows"] == {"invalid JSON": 1, "missing field": 1, "unknown domain": 1, "empty prompt": 1,
                                    "metadata rejected": 1, "ill-typed field": 1, "not an object": 1, "bad message": 1}
    assert recorded["rows"]["train"] == 2 and list(cfg.verifier.domains) == ["math"]


@pytest.mark.parametrize("args, message", [
    (["run.stepz=3"], "run.stepz: no such setting (did you mean run.steps?)"),
    (["+run.stepz=3"], "run.stepz: no such setting (did you mean run.steps?)"),
    (["run.steps=many"], "run.steps: Value 'many' of type 'str' could not be converted to Integer"),
    (["model.path=/no/such/model"], "model.path=/no/such/model is not a directory"),
    (["sampler.count=0"], "sampler.count and verifier.count must be >= 1"),
    (["data.files=prompts.jsonl"], "data.files: Invalid value assigned"),
    (["run=nope"], "no preset 'nope'"),
])
def test_a_config_mistake_is_one_message_and_exit_2(args, message, tiny_model, tmp_path):
    r = cli("launch", "tiny", f"model.path={tiny_model}", f"data.files=[{tmp_path / 'x.jsonl'}]", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3


def test_a_missing_data_file_and_a_cascade_mistake_are_exit_2(tiny_model, tmp_path):
    r = cli("launch", "tiny", f"model.path={tiny_model}", f"data.files=[{tmp_path / 'nope.jsonl'}]",
            f"run_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and f"data.files: {tmp_path / 'nope.jsonl'}: no such file" in r.stderr, r.stderr
    r = cli("cascade", "demo", "eval.nn=3")
    assert r.returncode == 2 and "eval.nn: no such setting (did you mean eval.n?)" in r.stderr, r.stderr
    r = cli("sft", f"model={tiny_model}", "stepz=3")
    assert r.returncode == 2 and "stepz: no such setting (did you mean steps?)" in r.stderr, r.stderr


def test_make_data_writes_the_builtin_tasks_as_files(tmp_path):
    r = cli("make-data", "multi_domain", "--out", str(tmp_path), "--heldout", "4", "--rl", "20", "--sft", "5")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(manifest["files"]["rl"]) == ["arithmetic", "arithmetic_json", "arithmetic_mcqa"]
    assert manifest["files"]["rl"]["arithmetic"] == "rl/arithmetic.jsonl"  # relative: the directory can move
    files = {split: {t: tmp_path / p for t, p in by_task.items()} for split, by_task in manifest["files"].items()}
    rows = [json.loads(x) for x in files["sft"]["arithmetic_mcqa"].read_text().splitlines()]
    assert rows and {"id", "prompt", "domain", "answer", "metadata", "response"} <= set(rows[0])
    assert rows[0]["domain"] == "mcqa" and rows[0]["metadata"] == {"options": ["A", "B", "C", "D"]}
    heldout = {json.loads(x)["prompt"].split(".")[0] for t in files["heldout"].values()
               for x in t.read_text().splitlines()}
    trained = {json.loads(x)["prompt"].split(".")[0] for t in files["rl"].values()
               for x in t.read_text().splitlines()}
    assert heldout and not heldout & trained  # no held-out question is an RL question, in any format

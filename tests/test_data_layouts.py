"""Peers' data layouts read as they are (issue 39): dotted ``data.fields`` paths, ``data.domain_map``, a row
transform of the user's (``data.map``), and files with nothing to train on refused. verl's GSM8K Parquet, an
OpenRLHF JSONL and a TRL dataset directory each read with one command line; the verl file trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from cascade_rl.data.prepare import prepare
from cascade_rl.data.promptset import PromptSet
from cascade_rl.data.rows import BadRow, Fields, lookup, parse_row
from cascade_rl.data.sources import DataError
from cascade_rl.supervisor.config import compose
from cascade_rl.supervisor.run_data import prepare_run_data, registered_domains
from cascade_rl.supervisor.schema import DataConfig

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
DOMAINS = registered_domains([])
VERL = ["data.fields.answer=reward_model.ground_truth", "data.fields.domain=data_source",
        "data.domain_map={openai/gsm8k: math}"]


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=240, **kw)


def rows_of(stdout: str, domain: str) -> int:
    """The rows ``data check``'s table gives ``domain`` (training split)."""
    found = re.search(rf"│ {re.escape(domain)}\s+│ (\d+)", stdout)
    return int(found[1]) if found else 0


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def verl_gsm8k(path: Path, n: int = 8) -> Path:
    """A Parquet file as verl's examples/data_preprocess/gsm8k.py writes it."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 70? Let's think step by step and output the "
                                                    f"final answer after \"####\"."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 70)},
             "extra_info": {"split": "train", "index": i, "answer": f"{i} + 70 = {i + 70} #### {i + 70}",
                            "question": f"What is {i} + 70?"}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# the README's data.map example: verl's GSM8K prompt asks for the answer after "####", the math verifier reads \boxed{}
BOXED = '''
def to_boxed(raw: dict) -> dict:
    turn = raw["prompt"][-1]
    turn["content"] = turn["content"].replace('output the final answer after "####"',
                                              "put the final answer in \\\\boxed{}")
    return raw
'''


# --- dotted paths and the domain map ------------------------------------------------------------------------


def test_a_dotted_path_reaches_into_objects_and_lists_and_an_exact_key_wins():
    raw = {"reward_model": {"ground_truth": "72"}, "conversations": [{"content": "hi"}, {"content": "yo"}],
           "a.b": "exact", "a": {"b": "nested"}, "m": {"x.y": {"z": 3}}}
    assert lookup(raw, "reward_model.ground_truth") == "72"
    assert lookup(raw, "conversations.1.content") == "yo"
    assert lookup(raw, "a.b") == "exact"  # a top-level key that holds a dot is found first
    assert lookup(raw, "m.x.y.z") == 3  # and a nested one
    row = parse_row({"q": {"text": "What is 2 + 2?"}, "gt": [{"v": 4}], "src": "s"},
                    Fields(prompt="q.text", answer="gt.0.v", id="src"), default_domain="math")
    assert (row.question, row.answer, row.id) == ("What is 2 + 2?", "4", "s")


@pytest.mark.parametrize("fields, missing", [
    (Fields(answer="reward_model.groundtruth"), "'reward_model.groundtruth' (data.fields.answer)"),
    (Fields(prompt="extra_info.question"), "'extra_info.question' (data.fields.prompt)"),
    (Fields(prompt="conversations.5.content"), "'conversations.5.content' (data.fields.prompt)"),
    (Fields(domain="extra_info.source"), "'extra_info.source' (data.fields.domain) (or set data.default_domain)"),
])
def test_a_path_that_leads_nowhere_is_a_missing_field_naming_it(fields, missing):
    raw = {"prompt": "x", "conversations": [{"content": "x"}], "reward_model": {"ground_truth": "1"},
           "extra_info": {"index": 0}}
    with pytest.raises(BadRow, match=r"missing field ") as e:
        parse_row(raw, fields, "" if fields.domain != "domain" else "math")
    assert e.value.detail == f"missing field {missing}" and e.value.kind == "missing field"


def test_the_domain_map_names_each_value_and_an_unmapped_one_is_a_bad_row(tmp_path):
    fields, gsm = Fields(domain="data_source"), {"openai/gsm8k": "math", "mmlu": "mcqa"}
    assert parse_row({"prompt": "x", "data_source": "openai/gsm8k", "answer": "1"}, fields,
                     domain_map=gsm).domain == "math"
    with pytest.raises(BadRow, match=r"'data_source' \(data.fields.domain\) is 'lighteval/MATH', which data.domain_map "
                                     r"does not map: add it .* or set data.default_domain") as e:
        parse_row({"prompt": "x", "data_source": "lighteval/MATH"}, fields, domain_map=gsm)
    assert e.value.kind == "unmapped domain"
    assert parse_row({"prompt": "x", "data_source": "lighteval/MATH"}, fields, "math", domain_map=gsm).domain == "math"
    # mapped domains go through the launch's checks: registered, and the domain's row check
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "data_source": "a", "answer": "1"},
                                           {"prompt": "x", "data_source": "b", "answer": "1"},
                                           {"prompt": "x", "data_source": "c", "answer": "Z"}])
    lines = []
    report = prepare(OmegaConf.structured(DataConfig(files=[str(f)], fields=fields,
                                                     domain_map={"a": "math", "b": "poetry", "c": "mcqa"})),
                     None, None, DOMAINS, on_bad=lines.append)
    assert report.domains["train"] == {"math": 1}
    assert [b.kind for b in lines] == ["unknown domain", "metadata rejected"]
    with pytest.raises(DataError, match=r"data.domain_map: each value of the domain field maps to a domain's name"):
        prepare(compose(None, [f"data.files=[{f}]", "data.domain_map={a: [x]}"], check=False).data)


# --- peers' layouts, one command line each -------------------------------------------------------------------


def test_verl_gsm8k_parquet_parses_with_three_overrides(tmp_path):
    path = verl_gsm8k(tmp_path / "train.parquet")
    cfg = compose(None, [f"data.files=[{path}]", *VERL], check=False)
    report = prepare(cfg.data, None, tmp_path / "out", DOMAINS)
    rows = PromptSet(tmp_path / "out" / "train.arrow").rows()
    assert report.bad == {} and report.domains["train"] == {"math": 8}
    assert rows[2].answer == "72" and rows[2].domain == "math" and rows[2].question.startswith("What is 2 + 70?")
    assert rows[2].metadata == {}  # no metadata field: extra_info is not handed to the verifier
    (tmp_path / "boxed.py").write_text(BOXED)
    cfg = compose(None, [f"data.files=[{path}]", *VERL, f"data.map={tmp_path / 'boxed.py'}:to_boxed"], check=False)
    prepare(cfg.data, None, tmp_path / "boxed", DOMAINS)
    row = PromptSet(tmp_path / "boxed" / "train.arrow").rows()[2]
    assert row.question == "What is 2 + 70? Let's think step by step and put the final answer in \\boxed{}."


def test_openrlhf_jsonl_and_a_trl_dataset_directory_each_check_with_one_command(tmp_path):
    from datasets import Dataset

    openrlhf = write_jsonl(tmp_path / "openrlhf.jsonl", [{"input": f"What is {i} + 1?", "label": str(i + 1)}
                                                        for i in range(4)])
    r = cli("data", "check", str(openrlhf), "data.fields.prompt=input", "data.fields.answer=label",
            "data.default_domain=math")
    assert r.returncode == 0 and "every row is valid" in r.stdout and "math" in r.stdout, r.stdout + r.stderr
    trl = tmp_path / "trl"  # TRL's GRPO layout: a conversational prompt column, extra columns for the rewards
    Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 2?"}] for i in range(4)],
                       "solution": [str(i + 2) for i in range(4)], "level": ["easy"] * 4}).save_to_disk(str(trl))
    r = cli("data", "check", str(trl), "data.fields.answer=solution", "data.default_domain=math")
    assert r.returncode == 0 and "every row is valid" in r.stdout and rows_of(r.stdout, "math") == 4, r.stdout + r.stderr


# --- data.map ----------------------------------------------------------------------------------------------


MAP = '''
def to_row(raw):
    if raw["q"].startswith("broken"):
        raise ValueError(f"no answer in {raw['q']!r}")
    if raw["q"] == "skip me":
        return None
    return {"prompt": raw["q"], "answer": raw["meta"]["a"], "domain": "math"}
'''


def test_data_map_transforms_rows_and_its_exceptions_are_bad_rows_with_their_lines(tmp_path):
    (tmp_path / "my_layout.py").write_text(MAP)
    f = write_jsonl(tmp_path / "raw.jsonl", [{"q": "What is 1 + 1?", "meta": {"a": "2"}}, {"q": "broken one"},
                                             {"q": "skip me"}, {"q": "What is 2 + 2?", "meta": {"a": "4"}},
                                             {"q": "broken two"}])
    r = cli("data", "check", str(f), f"data.map={tmp_path / 'my_layout.py'}:to_row")
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert f"{f}:2: data.map raised ValueError: no answer in 'broken one'" in out
    assert f"{f}:5: data.map raised ValueError: no answer in 'broken two'" in out
    assert "dropped by data.map: 1 rows" in r.stdout and "2 bad rows" in r.stdout and "Traceback" not in r.stderr
    assert rows_of(r.stdout, "math") == 2  # the other two rows are valid
    # a module on the path, by its dotted name, as verifier.plugins are
    r = cli("data", "check", str(f), "data.map=my_layout:to_row", "data.on_bad_row=skip",
            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "data.map raised ValueError" in r.stdout and rows_of(r.stdout, "math") == 2, r.stdout + r.stderr


@pytest.mark.parametrize("entry, message", [
    ("no_such_module_xyz:fn", "data.map: no_such_module_xyz: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("{layout}:nope", "data.map={layout}:nope: {layout} has no function 'nope'"),
    ("to_row", "data.map=to_row: not module:function or path/to/file.py:function"),
    ("/no/such/file.py:fn", "data.map: /no/such/file.py: no such file"),
])
def test_a_data_map_that_cannot_load_is_one_line_and_exit_2(entry, message, tmp_path):
    layout = tmp_path / "my_layout.py"
    layout.write_text(MAP)
    f = write_jsonl(tmp_path / "raw.jsonl", [{"q": "What is 1 + 1?", "meta": {"a": "2"}}])
    r = cli("data", "check", str(f), f"data.map={entry.format(layout=layout)}")
    assert r.returncode == 2 and r.stderr.strip() == f"cascade-rl: {message.format(layout=layout)}", r.stderr
    assert r.stdout == ""


# --- nothing to train on -------------------------------------------------------------------------------------


def test_an_empty_file_fails_data_check_naming_it(tmp_path):
    empty, parquet = tmp_path / "empty.jsonl", tmp_path / "empty.parquet"
    empty.write_text("\n")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "domain": pa.array([], pa.string())}), parquet)
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "What is 1 + 1?", "domain": "math", "answer": "2"}])
    r = cli("data", "check", str(empty), str(parquet), str(good))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{empty}: no rows" in r.stdout.splitlines() and f"{parquet}: no rows" in r.stdout.splitlines()
    r = cli("data", "check", str(empty))
    assert r.returncode == 1 and f"{empty}: no rows" in r.stdout and "every row is valid" not in r.stdout


def test_a_launch_on_an_empty_file_or_on_only_bad_rows_is_refused_naming_the_files(tmp_path, tiny_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run_dir = tmp_path / "run"
    r = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", f"data.files=[{empty}]")
    assert r.returncode == 2 and f"data.files: {empty}: no rows" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (run_dir / "supervisor.json").exists()  # no worker started: none has a log
    assert {p.name for p in (run_dir / "logs").glob("*.log")} <= {"supervisor.log"}
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "domain": "poetry"}, '{"prompt": '])
    cfg = compose("tiny", [f"run_dir={tmp_path / 'r2'}", f"model.path={tiny_model}", f"data.files=[{bad}]",
                           "data.on_bad_row=skip", "supervisor.progress=none"])
    with pytest.raises(DataError, match=rf"data.files: no row to train on in {bad} \(2 rows read: 1 bad \(unknown "
                                        rf"domain\), 1 bad \(invalid JSON\)\)"):
        prepare_run_data(cfg)


# --- and it trains -------------------------------------------------------------------------------------------


def test_a_verl_gsm8k_parquet_trains(tmp_path, tiny_model):
    path = verl_gsm8k(tmp_path / "train.parquet")
    (tmp_path / "boxed.py").write_text(BOXED)
    run_dir = tmp_path / "run"
    r = cli("launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", f"data.files=[{path}]", *VERL,
            f"data.map={tmp_path / 'boxed.py'}:to_boxed",
            "run.steps=1", "run.prompts_per_step=2", "run.group_size=2", "orchestrator.eval_n=0",
            "supervisor.progress=plain", env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["books"]["trained"] == 2 * 2 and summary["books"]["lost"] == 0
    assert summary["data"]["domains"]["train"] == {"math": 8} and summary["data"]["bad_rows"] == {}

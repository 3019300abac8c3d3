"""Users' data files (data/): every format, chat prompts, field remapping, held-out splits, weights between
files, the resumable draw order, and bad rows reported as FILE:LINE: reason. No processes."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from cascade_rl.data.order import BLOCK, DrawOrder
from cascade_rl.data.prepare import prepare
from cascade_rl.data.promptset import PromptSet, PromptStream
from cascade_rl.data.render import PromptRenderer
from cascade_rl.data.rows import BadRow, Fields, parse_row
from cascade_rl.data.sources import DataError, parse_spec
from cascade_rl.supervisor.run_data import registered_domains
from cascade_rl.supervisor.schema import DataConfig

DOMAINS = registered_domains([])
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 3?"}]
ROWS = [
    {"id": "a", "prompt": "What is 1 + 1? Put the final answer in \\boxed{}.", "domain": "math", "answer": "2"},
    {"id": "b", "prompt": CHAT, "domain": "math", "answer": "5"},
    {"id": "c", "prompt": "Pick the letter.", "domain": "mcqa", "answer": "B",
     "metadata": {"options": ["A", "B", "C", "D"]}},
    {"prompt": "Reply in JSON.", "domain": "structured_output", "answer": "",
     "metadata": {"schema": {"type": "object", "required": ["x"]}}},
]


def data_cfg(**kw) -> DataConfig:
    return OmegaConf.structured(DataConfig(**kw))


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def load(tmp_path: Path, files: list[str], tokenizer=None, **kw) -> tuple[list, dict]:
    out = tmp_path / "prepared"
    report = prepare(data_cfg(files=files, **kw), tokenizer, out, DOMAINS)
    return PromptSet(out / "train.arrow").rows(), report


def as_plain(rows) -> list[tuple]:
    return [(r.id, r.messages, r.domain, r.answer, r.metadata) for r in rows]


# --- formats -----------------------------------------------------------------------------------------


def test_every_format_gives_the_same_rows(tmp_path):
    reference, _ = load(tmp_path / "j", [str(write_jsonl(tmp_path / "d.jsonl", ROWS))])
    assert len(reference) == 4 and reference[1].messages == tuple(CHAT) and reference[1].question == "What is 2 + 3?"
    assert reference[3].id and reference[3].id != reference[2].id  # derived from the content when absent
    assert as_plain(load(tmp_path / "g", [str(write_jsonl(tmp_path / "d.jsonl.gz", ROWS, gz=True))])[0]) == as_plain(
        reference)
    # columnar files hold one type per column: every prompt a conversation (a list<struct<role, content>>)
    chat = [{**r, "prompt": r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]}
            for r in ROWS]
    parquet = tmp_path / "d.parquet"
    # as pandas writes it: metadata a struct of every key any row has, null-filled where a row lacks one
    pd.DataFrame(chat).to_parquet(parquet)
    assert pq.read_schema(parquet).field("metadata").type.num_fields == 2
    assert as_plain(load(tmp_path / "p", [str(parquet)])[0]) == as_plain(reference)  # the nulls are dropped
    from datasets import Dataset

    hf_dir = tmp_path / "hf"
    Dataset.from_list([{**r, "metadata": json.dumps(r.get("metadata", {}))} for r in chat]).save_to_disk(str(hf_dir))
    assert as_plain(load(tmp_path / "h", [str(hf_dir)])[0]) == as_plain(reference)  # metadata as JSON text


def test_a_directory_that_is_not_a_dataset_and_an_unknown_suffix_are_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    for path, words in ((tmp_path / "plain", "save_to_disk"), (tmp_path / "x.csv", "unknown format"),
                        (tmp_path / "missing.jsonl", "no such file")):
        if path.suffix:
            path.write_text("a,b\n") if path.name == "x.csv" else None
        with pytest.raises(DataError, match=words):
            load(tmp_path, [str(path)])
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"data.files: .*junk.parquet: not a readable Parquet file"):
        load(tmp_path, [str(tmp_path / "junk.parquet")])


def test_file_specs_and_their_rules(tmp_path):
    assert parse_spec("a/b.jsonl:3").weight == 3.0 and parse_spec("a/b.jsonl").weight is None
    assert parse_spec("C:/x.jsonl").path == Path("C:/x.jsonl")  # a colon that is not a weight stays in the path
    with pytest.raises(DataError, match="positive"):
        parse_spec("a.jsonl:0")
    f = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(DataError, match="every file a weight"):
        load(tmp_path, [f"{f}:2", f])
    with pytest.raises(DataError, match="not both"):
        load(tmp_path, [f], eval_files=[f], heldout_fraction=0.1)
    with pytest.raises(DataError, match="take no weights"):
        load(tmp_path, [f], eval_files=[f"{f}:2"])


# --- the schema: chat prompts, remapping, defaults -----------------------------------------------------


def test_chat_prompts_render_in_the_models_template(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    thinking, plain = PromptRenderer(tokenizer, thinking=True), PromptRenderer(tokenizer, thinking=False)
    text = thinking.text(tuple(CHAT))
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert text.endswith("<|im_start|>assistant\n<think>\n") and thinking.prefix == "<think>\n"
    assert plain.text(tuple(CHAT)).endswith("<think>\n\n</think>\n\n") and plain.prefix == "<think>\n\n</think>\n\n"
    assert thinking.ids(CHAT) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert thinking.lengths([CHAT, CHAT[1:]]) == [len(thinking.ids(CHAT)), len(thinking.ids(CHAT[1:]))]


def test_fields_are_remapped_and_a_default_domain_fills_the_gap(tmp_path):
    rows = [{"question": "What is 4 + 4?", "label": 8, "extra": {"source": "gsm"}, "uid": 17}]
    got, _ = load(tmp_path, [str(write_jsonl(tmp_path / "r.jsonl", rows))], default_domain="math",
                  fields=Fields(prompt="question", answer="label", metadata="extra", id="uid"))
    assert as_plain(got) == [("17", ({"role": "user", "content": "What is 4 + 4?"},), "math", "8", {"source": "gsm"})]
    with pytest.raises(BadRow, match=r"missing field 'question' \(data.fields.prompt\)"):
        parse_row({"prompt": "x"}, Fields(prompt="question"))


# --- held-out splits -----------------------------------------------------------------------------------


def test_heldout_fraction_is_question_disjoint_and_the_same_in_every_run(tmp_path):
    rows = [{"prompt": f"What is {i % 300} + 1?", "domain": "math", "answer": str(i % 300 + 1)} for i in range(900)]
    f = str(write_jsonl(tmp_path / "r.jsonl", rows))
    first = prepare(data_cfg(files=[f], heldout_fraction=0.2), None, tmp_path / "a", DOMAINS)
    prepare(data_cfg(files=[f], heldout_fraction=0.2), None, tmp_path / "b", DOMAINS)
    train = {r.question for r in PromptSet(tmp_path / "a" / "train.arrow").rows()}
    heldout = [r.question for r in PromptSet(tmp_path / "a" / "eval.arrow").rows()]
    assert not train & set(heldout)  # each question is on one side, all three copies of it
    assert Counter(heldout).most_common()[-1][1] == 3
    assert 0.12 < len(set(heldout)) / 300 < 0.28
    assert heldout == [r.question for r in PromptSet(tmp_path / "b" / "eval.arrow").rows()]
    assert first.to_json()["rows"] == {"train": 900 - len(heldout), "eval": len(heldout)}


def test_eval_files_are_never_trained_on_and_are_capped_per_domain(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", ROWS + [ROWS[0]])
    evals = write_jsonl(tmp_path / "e.jsonl", [ROWS[0], {**ROWS[1], "id": "b2"}, {**ROWS[2], "id": "c2"}])
    out = tmp_path / "p"
    report = prepare(data_cfg(files=[str(train)], eval_files=[str(evals)], eval_per_domain=1), None, out, DOMAINS)
    assert [r.id for r in PromptSet(out / "train.arrow").rows()] == [parse_row(ROWS[3]).id]  # a, b, c, a: in eval
    assert [r.id for r in PromptSet(out / "eval.arrow").rows()] == ["a", "c2"]  # math capped at 1 per domain
    assert report.dropped == {"prompt also in data.eval_files": 4, "over data.eval_per_domain": 1}


# --- the draw order: weights, epochs, exact resume -----------------------------------------------------


def test_weights_set_each_files_share_and_every_row_comes_once_per_epoch():
    order = DrawOrder([100, 10], [3.0, 1.0], seed=0)
    draws = [order.next() for _ in range(8000)]
    share = Counter(s for s, _ in draws)[0] / len(draws)
    assert 0.73 < share < 0.77
    small = [r for s, r in draws if s == 1]
    for epoch in range(len(small) // 10):  # each epoch of the small file: a permutation of its 10 rows
        assert sorted(small[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert small[:10] != small[10:20]  # a new order every epoch


def test_resume_continues_the_draws_exactly():
    for k in (0, 5, BLOCK - 1, BLOCK, 3 * BLOCK + 17):
        straight = DrawOrder([7, 300, 1], [1.0, 2.0, 0.5], seed=3)
        for _ in range(k):
            straight.next()
        resumed = DrawOrder([7, 300, 1], [1.0, 2.0, 0.5], seed=3)
        resumed.skip(k)
        assert [resumed.next() for _ in range(50)] == [straight.next() for _ in range(50)], k
        assert resumed.counts.tolist() == straight.counts.tolist()


def test_prompt_stream_restores_its_place_in_the_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "domain": "math", "answer": "1"} for i in range(30)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "domain": "math", "answer": "1"} for i in range(5)])
    prepare(data_cfg(files=[f"{a}:1", f"{b}:1"]), None, tmp_path / "p", DOMAINS)
    stream = PromptStream(tmp_path / "p", seed=1)
    first = [stream.next().question for _ in range(40)]
    assert {q[0] for q in first} == {"a", "b"} and 0.3 < sum(q[0] == "b" for q in first) / 40 < 0.7
    resumed = PromptStream(tmp_path / "p", seed=1)
    resumed.restore(25)
    assert [resumed.next().question for _ in range(15)] == first[25:] and resumed.drawn == 40
    unweighted = prepare(data_cfg(files=[str(a), str(b)]), None, tmp_path / "u", DOMAINS)
    assert not unweighted.weighted
    one = PromptStream(tmp_path / "u", 0)
    draws = Counter(one.next().question[0] for _ in range(350))
    assert draws["b"] == 50  # one source: ten epochs of all 35 rows, each row once per epoch


# --- bad rows --------------------------------------------------------------------------------------------

BAD = [
    ('{"prompt": "ok", "domain": "math", "answer": "1"}', None),
    ('{"prompt": "no closing brace", "domain": "math"', "invalid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"domain": "math", "answer": "4"}', "missing field 'prompt'"),
    ('{"prompt": 5, "domain": "math"}', "must be a string or a list of {role, content} messages, got int"),
    ('{"prompt": "   ", "domain": "math", "answer": "1"}', "field 'prompt' is empty"),
    ('{"prompt": "hi", "answer": "1"}', "missing field 'domain' (or set data.default_domain)"),
    ('{"prompt": "hi", "domain": "poetry"}', "domain 'poetry' has no registered verifier"),
    ('{"prompt": "Pick", "domain": "mcqa", "answer": "E", "metadata": {"options": ["A", "B"]}}',
     "the mcqa verifier rejects this row: the reference answer 'E' is not one of the options A, B"),
    ('{"prompt": [{"role": "bot", "content": "x"}], "domain": "math"}', "role 'bot' is not one of"),
    ('{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "domain": "math"}',
     "the last message is the assistant's"),
    ('{"prompt": "hi", "domain": "math", "answer": "1", "metadata": [1]}', "field 'metadata' must be an object"),
    ('{"prompt": "hi", "domain": "math", "answer": "1", "metadata": "{not json"}', "is a string but not JSON"),
    ('{"prompt": "hi", "domain": "instruction_following", "metadata": {"instruction_id_list": ["foo:bar"], '
     '"kwargs": [{}]}}', "unknown instruction id 'foo:bar'"),
    ('{"prompt": "hi", "domain": "structured_output", "metadata": {"schema": {"type": "nope"}}}',
     "metadata.schema is not a valid JSON Schema"),
    ('{"prompt": "hi", "domain": "math", "answer": true}', "field 'answer' must be a string, got a boolean"),
    ('{"prompt": "hi", "domain": 3}', "field 'domain' must be a string"),
    ("", None),  # a blank line is not a row
    ('{"prompt": "' + "many words " * 200 + '", "domain": "math", "answer": "1"}', "overlong prompt"),
]


def test_every_bad_row_is_reported_with_its_file_and_line(tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "bad.jsonl", [line for line, _ in BAD])
    lines = []
    report = prepare(data_cfg(files=[str(path)], max_prompt_tokens=256), AutoTokenizer.from_pretrained(tiny_model),
                     None, DOMAINS, on_bad=lambda b: lines.append(str(b)))
    expected = [(n, words) for n, (_, words) in enumerate(BAD, 1) if words]
    assert len(lines) == len(expected)
    for got, (n, words) in zip(lines, expected):
        assert got.startswith(f"{path}:{n}: ") and words in got, (got, words)
    kinds = set(report.bad)
    assert len(kinds) >= 8 and {"invalid JSON", "missing field", "ill-typed field", "unknown domain",
                                "metadata rejected", "empty prompt", "bad message", "not an object"} <= kinds
    assert report.dropped == {"overlong prompt": 1} and sum(report.domains["train"].values()) == 1


def test_the_sum_of_the_parts_is_every_row(tmp_path, tiny_model):
    """Every row read is kept, bad or dropped: nothing vanishes between the file and the prompt set."""
    path = write_jsonl(tmp_path / "bad.jsonl", [line for line, _ in BAD])
    report = prepare(data_cfg(files=[str(path)], max_prompt_tokens=256, heldout_fraction=0.3),
                     AutoTokenizer.from_pretrained(tiny_model), None, DOMAINS)
    rows_in_file = sum(1 for line, _ in BAD if line)
    kept = sum(report.domains["train"].values()) + sum(report.domains["eval"].values())
    assert kept + sum(report.bad.values()) + sum(report.dropped.values()) == rows_in_file == report.read


def test_lengths_are_measured_in_the_models_tokens(tmp_path, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _, report = load(tmp_path, [str(write_jsonl(tmp_path / "d.jsonl", ROWS))], tokenizer)
    render = PromptRenderer(tokenizer)
    lengths = sorted(len(render.ids(parse_row(r).messages)) for r in ROWS)
    assert report.percentiles("train")["max"] == lengths[-1]
    assert np.frombuffer(report.lengths["train"], np.int32).tolist() == [
        len(render.ids(parse_row(r).messages)) for r in ROWS]

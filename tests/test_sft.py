"""SFT's batching: a step's rows in chunks of like length give the gradient of the whole padded batch."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from cascade_rl.learner.sft import by_length, collate
from cascade_rl.modeling.logprobs import token_logprobs


def test_chunks_are_sorted_bounded_and_complete():
    rng = random.Random(0)
    rows = [([1] * n, [True] * n) for n in (rng.randint(3, 400) for _ in range(32))]
    chunks = by_length(rows, 1024)
    assert sorted(len(r[0]) for c in chunks for r in c) == sorted(len(r[0]) for r in rows)
    for c in chunks:
        assert max(len(r[0]) for r in c) * len(c) <= 1024 or len(c) == 1
    widths = [len(r[0]) for c in chunks for r in c]
    assert widths == sorted(widths)
    assert by_length([([1] * 5000, [True] * 5000)], 1024) == [[([1] * 5000, [True] * 5000)]]  # one row always fits


def test_chunked_gradient_equals_the_padded_batch(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(1)
    rows = []
    for n in (5, 9, 40, 7, 120, 11):
        ids = [rng.randrange(3, 200) for _ in range(n)]
        rows.append((ids, [False] * (n // 3) + [True] * (n - n // 3)))

    def grads(chunks):
        model.zero_grad()
        n_loss = sum(sum(m) for _, m in rows)
        for chunk in chunks:
            ids, att, mask = collate(chunk, 0)
            (-(token_logprobs(model(input_ids=ids, attention_mask=att).logits, ids) * mask).sum() / n_loss).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    whole, chunked = grads([rows]), grads(by_length(rows, 64))
    assert len(by_length(rows, 64)) > 2
    for k, g in whole.items():
        torch.testing.assert_close(chunked[k], g, atol=1e-6, rtol=1e-4)


def test_file_weights_are_each_files_share_of_the_draws(tmp_path):
    import json

    import pytest

    from cascade_rl.data.rows import Fields
    from cascade_rl.data.sources import DataError
    from cascade_rl.learner.sft import read_sft_rows, row_weights

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "r"}) + "\n" for i in range(4)))
    b.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r"}) + "\n" for i in range(1)))
    files = [f"{a}:3", f"{b}:1"]
    rows = read_sft_rows(files, Fields())
    assert len(rows) == 5
    weights = row_weights(files, rows)
    assert sum(w for r, w in zip(rows, weights) if r.where.startswith(str(a))) == pytest.approx(3.0)
    assert sum(w for r, w in zip(rows, weights) if r.where.startswith(str(b))) == pytest.approx(1.0)
    assert row_weights([str(a), str(b)], read_sft_rows([str(a), str(b)], Fields())) is None  # uniform over rows
    with pytest.raises(DataError, match="every file a weight"):
        row_weights([f"{a}:3", str(b)], rows)

"""Packed rows on the wire (protocol/rows.py): a TrainBatch carries each row's tokens one after another, and the
trainer pads them itself, each micro-batch to its own longest row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cascade_rl.learner.batch import Part
from cascade_rl.learner.trainer import Batch
from cascade_rl.protocol import decode, encode
from cascade_rl.protocol.rows import flatten, from_padded, offsets, pad


def test_pad_and_flatten_are_each_others_inverse():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 1, 5, 2], np.int32)
    flat = rng.integers(0, 100, size=(int(lengths.sum()), 2, 3)).astype(np.int16)  # routes' shape: [T, layers, k]
    padded = pad(flat, lengths, -1)
    assert padded.shape == (4, 5, 2, 3) and (padded[1, 1:] == -1).all() and (padded[2] != -1).all()
    np.testing.assert_array_equal(flatten(padded, lengths), flat)
    for i, (a, b) in enumerate(zip(offsets(lengths)[:-1], offsets(lengths)[1:])):
        np.testing.assert_array_equal(padded[i, : lengths[i]], flat[a:b])
    assert pad(flat, lengths, width=7).shape == (4, 7, 2, 3)
    with pytest.raises(ValueError, match="a row of 5 tokens does not fit a width of 4"):
        pad(flat, lengths, width=4)
    assert pad(np.zeros(0, np.float32), np.zeros(0, np.int32)).shape == (0, 0)


def test_a_row_that_ends_on_context_tokens_keeps_them():
    """An agent's row may end with a tool's output (no loss on it): its length travels with it, where the masks
    alone would cut it at the last response token."""
    ids = np.arange(1, 19, dtype=np.int32).reshape(2, 9)
    mask = np.zeros((2, 9), bool)
    mask[0, 3:6] = True  # row 0: prompt 3, response 3, then 2 tokens of a tool's output; row 1 ends at 7
    mask[1, 4:7] = True
    msg = decode(encode(from_padded(step=0, group_size=2, input_ids=ids, response_mask=mask,
                                    inf_logprobs=np.zeros((2, 9), np.float32), rewards=np.zeros(2, np.float32),
                                    versions=np.zeros(2, np.int32), lengths=[8, 7])))
    assert msg.lengths.tolist() == [8, 7] and msg.input_ids.tolist() == list(range(1, 9)) + list(range(10, 17))
    batch = Batch.from_message(msg)
    assert batch.lengths.tolist() == [8, 7] and batch.input_ids.shape == (2, 8)
    assert batch.input_ids[0].tolist() == list(range(1, 9)) and batch.input_ids[1, 7] == 0  # padded on arrival
    default = from_padded(step=0, group_size=2, input_ids=ids, response_mask=mask,
                          inf_logprobs=np.zeros((2, 9), np.float32), rewards=np.zeros(2, np.float32),
                          versions=np.zeros(2, np.int32))
    assert default.lengths.tolist() == [6, 7]  # without lengths: up to each row's last response token


def test_each_micro_batch_is_as_wide_as_its_own_longest_row():
    lengths = [4, 4, 30, 3, 2, 2]  # one long row in the first group of three
    n, width = len(lengths), max(lengths)
    ids = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), bool)
    routes = np.full((n, width, 2, 2), -1, np.int16)
    for i, size in enumerate(lengths):
        ids[i, :size] = np.arange(1, size + 1)
        mask[i, 1:size] = True
        routes[i, : size - 1] = i
    msg = from_padded(step=0, group_size=3, input_ids=ids, response_mask=mask, inf_logprobs=-mask.astype(np.float32),
                      rewards=np.zeros(n, np.float32), versions=np.zeros(n, np.int32), lengths=lengths,
                      teacher_logprobs=-2 * mask.astype(np.float32), routes=routes)
    msg = decode(encode(dataclasses.replace(msg, loss_masked=np.array([0, 0, 0, 1, 1, 1], bool))))
    batch, part = Batch.from_message(msg), Part.from_message(msg)
    assert batch.input_ids.shape == (6, 30) and part.input_ids.shape == (sum(lengths),)  # the part stays packed
    for sl in batch.groups(1):  # a micro-batch padded from the packed part is the padded batch's rows
        from_part, from_batch = part.rows(sl), batch.rows(sl)
        for name in ("input_ids", "lengths", "response_mask", "loss_mask", "inf_logprobs", "teacher_logprobs",
                     "routes", "rewards"):
            assert torch.equal(getattr(from_part, name), getattr(from_batch, name)), name
    assert not batch.loss_mask[3:].any() and torch.equal(batch.loss_mask[:3], batch.response_mask[:3])
    first, second = (part.rows(sl) for sl in part.groups(1))
    assert first.input_ids.shape == (3, 30) and second.input_ids.shape == (3, 3)
    for name in ("response_mask", "loss_mask", "inf_logprobs", "teacher_logprobs"):
        assert getattr(second, name).shape == (3, 3), name
    assert second.routes.shape == (3, 3, 2, 2) and bool((second.routes[0, :2] == 3).all())
    assert torch.equal(second.input_ids, torch.tensor([[1, 2, 3], [1, 2, 0], [1, 2, 0]]))


def test_packed_rows_ship_no_padding():
    """One long row among short ones (the paper's long-tailed lengths): the wire carries the tokens alone."""
    lengths = [4096] + [256] * 31
    n, width = len(lengths), max(lengths)
    mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
    msg = from_padded(step=0, group_size=8, input_ids=np.ones((n, width), np.int32), response_mask=mask,
                      inf_logprobs=np.zeros((n, width), np.float32), rewards=np.zeros(n, np.float32),
                      versions=np.zeros(n, np.int32), lengths=lengths,
                      routes=np.zeros((n, width, 23, 6), np.int16))  # Nemotron-3-Nano: 23 MoE layers, top-6
    wire = sum(len(f) for f in encode(msg))
    tokens = sum(lengths)
    assert tokens * (4 + 1 + 4 + 23 * 6 * 2) <= wire < tokens * (4 + 1 + 4 + 23 * 6 * 2) + 4096
    assert wire * 10 < n * width * (4 + 1 + 4 + 23 * 6 * 2)  # padded to the longest: 10.7x these bytes

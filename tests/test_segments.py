"""Rows of several segments (learner/segments.py): an agent that rewrote its history trains each segment as a sequence
of its own. A row holding segments A and B gives, token for token, the log-probs, entropies and gradients of A and B
as two rows (no attention across the start, positions afresh), padded and packed; a row without segments is untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.learner.segments import Split, forward_rows
from cascade_rl.modeling.policy import Policy


def rows(pieces: list[list[list[int]]], prompt: list[int]):
    """Right-padded rows of concatenated pieces; each piece's tokens after its first ``prompt[k]`` are targets."""
    width = max(sum(len(p) for p in row) for row in pieces)
    ids = torch.zeros(len(pieces), width, dtype=torch.long)
    mask = torch.zeros(len(pieces), width, dtype=torch.bool)
    starts = torch.full((len(pieces), 2), -1)
    for r, row in enumerate(pieces):
        at = 0
        for k, p in enumerate(row):
            ids[r, at: at + len(p)] = torch.tensor(p)
            mask[r, at + prompt[k]: at + len(p)] = True
            if k:
                starts[r, k - 1] = at
            at += len(p)
    lengths = torch.where(mask, torch.arange(width) + 1, 0).amax(dim=1)
    return ids, lengths, mask, starts


@pytest.mark.parametrize("pack", [True, False])
def test_a_segmented_row_is_its_segments_as_rows(tiny_model, pack):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (23, 31, 17))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    policy = Policy(model, pack=pack, share_prefix=False)

    def run(ids, lengths, mask, starts):
        model.zero_grad()
        lp, ent = forward_rows(policy, ids, lengths, mask, starts, with_entropy=True)
        (lp[mask].sum() + 0.1 * ent[mask].sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    joined = rows([[a, b], [c]], prompt=[5, 9])  # row 0: segment A then B; row 1: one segment
    apart = rows([[a], [b], [c]], prompt=[5])
    apart[2][1, :9] = False  # B as a row of its own: its first 9 tokens are its prompt
    apart[2][1, 9:len(b)] = True
    lp, ent, grads = run(*joined)
    lp2, ent2, grads2 = run(*apart[:3], None)
    torch.testing.assert_close(lp[0, :len(a)], lp2[0, :len(a)], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[0, len(a): len(a) + len(b)], lp2[1, :len(b)], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[1, :len(c)], lp2[2, :len(c)], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[0, len(a): len(a) + len(b)], ent2[1, :len(b)], atol=1e-5, rtol=0)
    assert grads.keys() == grads2.keys() and len(grads) > 5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads2[name], atol=1e-5, rtol=1e-4, msg=name)
    # without the split B would see A: its log-probs differ
    plain, _ = policy(joined[0], joined[1], joined[2])
    assert (plain[0, len(a) + 9: len(a) + len(b)] - lp[0, len(a) + 9: len(a) + len(b)]).abs().max() > 1e-3


def test_split_keeps_routes_in_place_and_marks_no_first_token():
    ids = torch.arange(1, 11)[None, :]
    routes = torch.arange(10)[None, :, None, None].expand(1, 10, 2, 1).to(torch.int16)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 0] = False
    split = Split.of(ids, torch.tensor([10]), mask, routes, torch.tensor([[4, -1]]))
    assert split.input_ids.tolist() == [[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10]]
    assert split.target_mask[:, 0].tolist() == [False, False]
    assert split.routes[1, :, 0, 0].tolist() == [4, 5, 6, 7, 8, 9] and split.routes[0, 4:, 0, 0].tolist() == [-1, -1]
    assert split.join(split.input_ids.float()).tolist() == [[float(x) for x in range(1, 11)]]

"""The mismatch corrections of learner/losses.py (``trainer.correction``), against hand-computed weights.

One batch for every case: two rows, the first with two loss tokens, the second with three; the log-ratios
log π_θ − log π_inf are logs of simple numbers, so every ratio below is exact arithmetic:

    row 0: ρ = 3, 0.25      (ρ_seq = 0.75, geometric mean √0.75 ≈ 0.866)
    row 1: ρ = 1.5, 1, 0.8  (ρ_seq = 1.2,  geometric mean 1.2^(1/3) ≈ 1.063)
"""

from __future__ import annotations

import math

import pytest
import torch

from cascade_rl.learner.losses import CORRECTIONS, correction_stats, grpo_loss

RATIOS = [[3.0, 0.25, 1.0], [1.5, 1.0, 0.8]]
MASK = torch.tensor([[True, True, False], [True, True, True]])


def batch():
    inf = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -1.5, -2.5]])
    lp = (inf + torch.log(torch.tensor(RATIOS))).requires_grad_()
    return lp, inf


def weights(name, **kw):
    lp, inf = batch()
    c = CORRECTIONS[name](lp, inf, MASK, **kw)
    return c, correction_stats(c, MASK)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_every_correction_is_zero_outside_the_mask_and_detached(name):
    lp, inf = batch()
    c = CORRECTIONS[name](lp, inf, MASK)
    assert not c.weights.requires_grad
    assert c.weights[0, 2] == 0 and not c.masked[0, 2] and not c.truncated[0, 2]


def test_none_weighs_every_loss_token_one():
    c, stats = weights("none")
    torch.testing.assert_close(c.weights, MASK.float())
    assert stats["masked_frac"] == 0 and stats["truncated_frac"] == 0


def test_tis_caps_the_token_ratio():
    c, stats = weights("tis")
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, 0.25, 0.0], [1.5, 1.0, 0.8]]))
    assert c.truncated.tolist() == [[True, False, False], [False, False, False]]
    assert stats["truncated_frac"].item() == pytest.approx(1 / 5) and stats["masked_frac"] == 0


def test_icepop_drops_tokens_outside_the_band():
    c, stats = weights("icepop")
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0, 0.0], [1.5, 1.0, 0.8]]))
    assert stats["masked_frac"].item() == pytest.approx(2 / 5) and stats["truncated_frac"] == 0
    c, stats = weights("icepop", band=(0.2, 4.0))  # a wider band keeps every token at its ratio
    torch.testing.assert_close(c.weights, torch.tensor([[3.0, 0.25, 0.0], [1.5, 1.0, 0.8]]))
    assert stats["masked_frac"] == 0


def test_seq_tis_weighs_each_row_by_its_capped_sequence_ratio():
    c, stats = weights("seq_tis")
    torch.testing.assert_close(c.weights, torch.tensor([[0.75, 0.75, 0.0], [1.2, 1.2, 1.2]]))
    assert stats["truncated_frac"] == 0
    c, stats = weights("seq_tis", band=(0.5, 1.0))  # row 1's 1.2 capped at 1: its three tokens truncated
    torch.testing.assert_close(c.weights, torch.tensor([[0.75, 0.75, 0.0], [1.0, 1.0, 1.0]]))
    assert stats["truncated_frac"].item() == pytest.approx(3 / 5)


def test_mis_drops_rows_whose_sequence_ratio_leaves_the_band():
    c, _ = weights("mis")
    torch.testing.assert_close(c.weights, torch.tensor([[0.75, 0.75, 0.0], [1.2, 1.2, 1.2]]))
    c, stats = weights("mis", band=(0.8, 2.0))  # row 0's 0.75 is below 0.8: dropped whole
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0, 0.0], [1.2, 1.2, 1.2]]))
    assert c.masked.tolist() == [[True, True, False], [False, False, False]]
    assert stats["masked_frac"].item() == pytest.approx(2 / 5)


def test_geo_mask_drops_rows_by_their_geometric_mean_ratio():
    c, stats = weights("geo_mask", geo_band=(0.9, 1.1))  # row 0: √0.75 ≈ 0.866 < 0.9; row 1: 1.063 inside
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert stats["masked_frac"].item() == pytest.approx(2 / 5)
    c, _ = weights("geo_mask", geo_band=(0.85, 1.05))  # now row 0 inside, row 1 above
    torch.testing.assert_close(c.weights, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert math.sqrt(0.75) > 0.85 and 1.2 ** (1 / 3) > 1.05


def test_sequence_ratio_of_a_long_row_does_not_overflow():
    lp = torch.zeros(1, 4000)
    inf = torch.full((1, 4000), -0.5)  # ρ_t = e^0.5 on 4000 tokens: ρ_seq = e^2000, inf in fp32
    mask = torch.ones(1, 4000, dtype=torch.bool)
    for name in ("seq_tis", "mis", "geo_mask"):
        w = CORRECTIONS[name](lp, inf, mask).weights
        assert torch.isfinite(w).all(), name
    assert (CORRECTIONS["seq_tis"](lp, inf, mask).weights == 2.0).all()
    assert (CORRECTIONS["mis"](lp, inf, mask).weights == 0.0).all()


@pytest.mark.parametrize("name, expected", [
    ("tis", [[2.0, 0.25, 0.0], [1.5, 1.0, 0.8]]),
    ("mis", [[0.75, 0.75, 0.0], [1.2, 1.2, 1.2]]),
])
def test_the_gradient_of_a_corrected_grpo_loss_is_the_weighted_formula(name, expected):
    """One group of the two rows, Â = (+1, −1): d L / d log π[i, t] = −w[i, t] · Â_i / (5 tokens · 1 group)."""
    lp, inf = batch()
    c = CORRECTIONS[name](lp, inf, MASK)
    adv = torch.tensor([1.0, -1.0])
    grpo_loss(lp, adv, MASK, group_size=2, weights=c.weights).backward()
    w = torch.tensor(expected)
    torch.testing.assert_close(lp.grad, -(w * adv[:, None]) / 5)


def test_an_unknown_correction_is_refused_with_the_choices(tmp_path):
    from cascade_rl.supervisor.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"trainer.correction.*bogus.*icepop"):
        compose("tiny", ["trainer.correction=bogus", f"run_dir={tmp_path}"], check=True)

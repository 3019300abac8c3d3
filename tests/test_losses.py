"""Hand-computed checks of the GRPO loss pieces in learner/losses.py."""

import math

import pytest
import torch

from cascade_rl.learner.losses import (
    group_advantages,
    group_token_mean,
    grpo_loss,
    kl_k3,
    mismatch_stats,
    mopd_loss,
    mopd_stats,
    truncated_importance_weights,
)
from cascade_rl.modeling.logprobs import token_logprobs

SQRT3 = math.sqrt(3.0)


# --- group_advantages -------------------------------------------------------------------


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    # Group 0: mean 0.5, deviations ±0.5, sample var = 4·0.25/3 = 1/3, std = 1/√3,
    #          Â = ±0.5·√3 = ±√3/2 ≈ ±0.8660254.
    # Group 1: all equal -> exactly 0.
    # Group 2: mean 0.25, deviations (−0.25, −0.25, −0.25, 0.75),
    #          sample var = (3·0.0625 + 0.5625)/3 = 0.25, std = 0.5, Â = (−0.5, −0.5, −0.5, 1.5).
    expected = torch.tensor(
        [
            [SQRT3 / 2, -SQRT3 / 2, -SQRT3 / 2, SQRT3 / 2],
            [0.0, 0.0, 0.0, 0.0],
            [-0.5, -0.5, -0.5, 1.5],
        ]
    )
    torch.testing.assert_close(group_advantages(rewards, eps=0.0), expected)
    # The default eps=1e-6 moves these by about 1e-6 relative.
    torch.testing.assert_close(group_advantages(rewards), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(group_advantages(rewards)[1], torch.zeros(4))


def test_group_advantages_eps_in_denominator():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    # Group 0: 0.5 / (1/√3 + 0.5) = √3/(2 + √3) = 2√3 − 3 ≈ 0.4641016.
    # Group 1: std 0.5, so divide the deviations by 0.5 + 0.5 = 1.
    a = 2 * SQRT3 - 3
    expected = torch.tensor([[a, -a, -a, a], [-0.25, -0.25, -0.25, 0.75]])
    torch.testing.assert_close(group_advantages(rewards, eps=0.5), expected)


def test_group_advantages_uniform_group_is_exactly_zero_even_without_eps():
    # 0.1 is not exact in binary, so the mean may differ from the rewards by a rounding
    # error; with eps=0 that would be 0/0 or ε/0 without the explicit zeroing.
    rewards = torch.full((3, 5), 0.1)
    out = group_advantages(rewards, eps=0.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_group_advantages_group_of_one_is_zero():
    out = group_advantages(torch.tensor([[1.0], [0.0], [0.3]]))
    assert torch.equal(out, torch.zeros(3, 1))


# --- grpo_loss -------------------------------------------------------------------------


def _two_groups():
    # Two groups of 2 rows, T = 3, unequal lengths. The masked-out entries hold junk
    # (including -inf) that must not leak into the loss.
    logprobs = torch.tensor(
        [
            [-1.0, -2.0, -3.0],  # group 0, Â = +1,   |y| = 3, Σ logp = −6
            [-0.5, -9.0, float("-inf")],  # group 0, Â = −1,   |y| = 1, Σ logp = −0.5
            [-1.0, -1.0, -7.0],  # group 1, Â = +0.5, |y| = 2, Σ logp = −2
            [-4.0, -2.0, -7.0],  # group 1, Â = −0.5, |y| = 3, Σ logp = −13
        ]
    )
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return logprobs, advantages, mask


def test_grpo_loss_hand_computed():
    logprobs, advantages, mask = _two_groups()
    # Group 0: −(1·(−6) + (−1)·(−0.5)) / (3 + 1) = −(−5.5)/4 = 1.375
    # Group 1: −(0.5·(−2) + (−0.5)·(−13)) / (2 + 3) = −(5.5)/5 = −1.1
    # Mean over groups: (1.375 − 1.1) / 2 = 0.1375
    loss = grpo_loss(logprobs, advantages, mask, group_size=2)
    assert loss.item() == pytest.approx(0.1375)
    # A float mask gives the same value.
    assert grpo_loss(logprobs, advantages, mask.float(), group_size=2).item() == pytest.approx(0.1375)


def test_grpo_loss_gradient_matches_formula():
    torch.manual_seed(0)
    num_groups, group_size, length = 3, 4, 7
    n = num_groups * group_size
    logprobs = (-torch.rand(n, length) * 5).requires_grad_()
    advantages = torch.randn(n)
    lengths = torch.randint(1, length + 1, (n,))
    mask = torch.arange(length)[None, :] < lengths[:, None]

    grpo_loss(logprobs, advantages, mask, group_size).backward()

    group_tokens = mask.reshape(num_groups, -1).sum(-1).repeat_interleave(group_size).float()
    expected = -advantages[:, None] * mask.float() / (group_tokens[:, None] * num_groups)
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_loss_empty_group_contributes_zero():
    logprobs, advantages, mask = _two_groups()
    mask[2:] = False  # group 1 has no tokens
    loss = grpo_loss(logprobs, advantages, mask, group_size=2)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(1.375 / 2)  # group 0 as before, group 1 adds 0

    empty = torch.zeros_like(mask)
    lp = logprobs.clone().requires_grad_()
    loss = grpo_loss(lp, advantages, empty, group_size=2)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp))


def test_grpo_loss_rejects_ragged_groups():
    logprobs, advantages, mask = _two_groups()
    with pytest.raises(ValueError):
        grpo_loss(logprobs, advantages, mask, group_size=3)


# --- token_logprobs --------------------------------------------------------------------


def _naive_token_logprobs(logits, input_ids, temperature):
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = torch.zeros(input_ids.shape)
    out[:, 1:] = full[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [None, 1, 2, 3, 100])
def test_token_logprobs_matches_naive(temperature, chunk_rows):
    torch.manual_seed(1)
    n, length, vocab = 5, 6, 11
    logits = torch.randn(n, length, vocab) * 3
    input_ids = torch.randint(0, vocab, (n, length))
    out = token_logprobs(logits, input_ids, temperature=temperature, chunk_rows=chunk_rows)
    assert out.shape == (n, length) and out.dtype == torch.float32
    assert torch.equal(out[:, 0], torch.zeros(n))
    torch.testing.assert_close(out, _naive_token_logprobs(logits, input_ids, temperature))


@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_token_logprobs_gradient_matches_naive(chunk_rows):
    torch.manual_seed(2)
    n, length, vocab = 5, 4, 9
    logits = torch.randn(n, length, vocab)
    input_ids = torch.randint(0, vocab, (n, length))
    weights = torch.randn(n, length)

    a = logits.clone().requires_grad_()
    (token_logprobs(a, input_ids, temperature=0.7, chunk_rows=chunk_rows) * weights).sum().backward()
    b = logits.clone().requires_grad_()
    (_naive_token_logprobs(b, input_ids, 0.7) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_token_logprobs_low_precision_logits_give_float32():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 7).bfloat16()
    input_ids = torch.randint(0, 7, (2, 5))
    out = token_logprobs(logits, input_ids, chunk_rows=1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _naive_token_logprobs(logits, input_ids, 1.0))


# --- mismatch_stats --------------------------------------------------------------------


def test_mismatch_stats_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    inf = torch.tensor([[-1.0, -1.5, -3.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)  # the large last difference is masked out
    # d = inf − trainer = (0, 0.5, −0.5)
    # mean |d| = 1/3, max |d| = 0.5
    # exp(d) − d − 1: 0, e^0.5 − 1.5 = 0.1487212707, e^−0.5 − 0.5 = 0.1065306597; mean = 0.0850839768
    # ratios exp(−d) = 1, 0.61, 1.65: all inside [0.5, 2]
    stats = mismatch_stats(trainer, inf, mask)
    assert set(stats) == {"abs_diff_mean", "abs_diff_max", "kl_k3", "outside_band"}
    assert all(type(v) is float for v in stats.values())
    assert stats["abs_diff_mean"] == pytest.approx(1 / 3)
    assert stats["abs_diff_max"] == pytest.approx(0.5)
    assert stats["kl_k3"] == pytest.approx(0.0850839768, rel=1e-6)
    assert stats["outside_band"] == 0.0


def test_mismatch_outside_band_counts_both_sides():
    trainer = torch.zeros(1, 5)
    # d = inf − trainer; ratio = exp(−d): e^0.8 = 2.23 (above), e^−0.8 = 0.45 (below), 1.0, e^0.69 = 1.99, e^−0.69 = 0.50
    inf = torch.tensor([[-0.8, 0.8, 0.0, -0.69, 0.69]])
    stats = mismatch_stats(trainer, inf, torch.ones(1, 5, dtype=torch.bool))
    assert stats["outside_band"] == pytest.approx(2 / 5)


def test_mismatch_stats_empty_mask_is_zero():
    x = torch.randn(2, 3)
    stats = mismatch_stats(x, x + 1, torch.zeros(2, 3, dtype=torch.bool))
    assert stats == {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "kl_k3": 0.0, "outside_band": 0.0}


# --- group_token_mean, importance weights, GRPO with weights --------------------------------


def test_group_token_mean_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("inf"), 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    # group 0: (1+2+3+4)/4 = 2.5; group 1: (1+1)/2 = 1; mean = 1.75 (the masked inf never leaks)
    assert group_token_mean(values, mask, 2).item() == pytest.approx(1.75)


def test_truncated_importance_weights_hand_computed():
    lp = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    inf = torch.tensor([[0.0, 0.5, -0.5, 1.0, -1.0]])  # r = exp(lp − inf) = 1, e^−.5=.607, e^.5=1.65, e^−1=.368, e=2.72
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)  # the last is masked: w = 0, not counted as truncated
    w, truncated = truncated_importance_weights(lp, inf, mask)
    assert w.tolist()[0] == pytest.approx([1.0, math.exp(-0.5), math.exp(0.5), 0.0, 0.0])
    assert truncated.tolist() == [[False, False, False, True, False]]
    # the band is inclusive: r exactly 0.5 and 2.0 are kept
    w, truncated = truncated_importance_weights(torch.log(torch.tensor([[0.5, 2.0]])), torch.zeros(1, 2),
                                                torch.ones(1, 2, dtype=torch.bool))
    assert w.tolist()[0] == pytest.approx([0.5, 2.0]) and not truncated.any()


def test_truncated_weights_carry_no_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w, _ = truncated_importance_weights(lp, torch.tensor([[-1.2, -2.1]]), torch.ones(1, 2))
    assert not w.requires_grad


def test_grpo_loss_with_weights_hand_computed():
    logprobs, advantages, mask = _two_groups()
    weights = torch.tensor([[2.0, 1.0, 0.0], [1.0, 5.0, 5.0], [0.5, 0.5, 9.0], [1.0, 1.0, 1.0]])
    # group 0: −(1·(2·−1 + 1·−2 + 0·−3) + (−1)·(1·−0.5)) / 4 = −(−4 + 0.5)/4 = 0.875
    # group 1: −(0.5·(0.5·−1 + 0.5·−1) + (−0.5)·(−13)) / 5 = −(−0.5 + 6.5)/5 = −1.2
    loss = grpo_loss(logprobs, advantages, mask, 2, weights=weights)
    assert loss.item() == pytest.approx((0.875 - 1.2) / 2)
    assert grpo_loss(logprobs, advantages, mask, 2, weights=torch.ones(4, 3)).item() == pytest.approx(0.1375)


def test_grpo_loss_with_weights_gradient_matches_formula():
    torch.manual_seed(1)
    g, groups, length = 4, 3, 6
    lp = (-torch.rand(g * groups, length) * 3).requires_grad_()
    adv, w = torch.randn(g * groups), torch.rand(g * groups, length) * 2
    mask = torch.rand(g * groups, length) > 0.3
    grpo_loss(lp, adv, mask, g, weights=w).backward()
    tokens = mask.view(groups, -1).sum(-1).repeat_interleave(g).float()
    expected = -w * adv[:, None] * mask / (tokens[:, None] * groups)
    torch.testing.assert_close(lp.grad, expected)


# --- MOPD --------------------------------------------------------------------------------------


def _mopd_case():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
    teacher = torch.tensor([[-0.5, -2.5, -9.0], [-1.0, -1.0, -2.0]])
    inf = torch.tensor([[-1.0, -2.0, -0.5], [-3.0 + math.log(3.0), -1.0, -2.0]])  # row 1 token 0: r = 1/3
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return lp, teacher, inf, mask


def test_mopd_loss_hand_computed():
    lp, teacher, inf, mask = _mopd_case()
    # row 0: a = (0.5, −0.5), w = (1, 1): Σ w·a·lp = 0.5·−1 + (−0.5)·−2 = 0.5; /|V|=2 → 0.25
    # row 1: token 0 truncated (r = 1/3); a = (·, 0, 0): Σ = 0; → 0
    # L = −(0.25 + 0)/2 = −0.125
    assert mopd_loss(lp, teacher, inf, mask).item() == pytest.approx(-0.125)
    # with the band widened to keep r = 1/3: row 1 adds (1/3)·2·(−3)/3 = −2/3 → L = −(0.25 − 2/3)/2
    assert mopd_loss(lp, teacher, inf, mask, eps_low=0.3).item() == pytest.approx(-(0.25 - 2 / 3) / 2)


def test_mopd_loss_gradient_is_weighted_stopped_advantage():
    torch.manual_seed(2)
    n, length = 5, 8
    lp = (-torch.rand(n, length) * 3).requires_grad_()
    teacher = -torch.rand(n, length) * 3
    inf = lp.detach() + torch.randn(n, length) * 0.5
    mask = torch.rand(n, length) > 0.25
    mask[3] = False  # an empty row: no gradient, still counted in the mean
    mopd_loss(lp, teacher, inf, mask).backward()
    w, _ = truncated_importance_weights(lp, inf, mask)
    a = teacher - lp.detach()
    expected = -w * a * mask / (mask.sum(-1, keepdim=True).clamp(min=1) * n)
    torch.testing.assert_close(lp.grad, expected)
    assert lp.grad[3].abs().sum() == 0


def test_mopd_loss_is_zero_when_student_equals_teacher():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = mopd_loss(lp, lp.detach().clone(), lp.detach().clone(), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0


def test_mopd_stats_hand_computed():
    lp, teacher, inf, mask = _mopd_case()
    stats = mopd_stats(lp, teacher, inf, mask)
    # −a over valid tokens: −0.5, 0.5, −2, 0, 0 → mean −0.4; one of five truncated
    assert stats["reverse_kl"] == pytest.approx(-0.4)
    assert stats["truncated_frac"] == pytest.approx(0.2)
    assert mopd_stats(lp, teacher, inf, torch.zeros_like(mask)) == {"reverse_kl": 0.0, "truncated_frac": 0.0}


# --- KL penalty (k3) -------------------------------------------------------------------------


def test_kl_k3_value_and_gradient():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -1.0])
    # d = ref − lp = (0, 0.5, −0.5): e^d − d − 1 = 0, 0.1487212707, 0.1065306597
    k3 = kl_k3(lp, ref)
    assert k3.tolist() == pytest.approx([0.0, 0.1487212707, 0.1065306597], rel=1e-6)
    k3.sum().backward()
    # d/d lp (e^d − d − 1) = −e^d + 1 = 1 − π_ref/π_θ
    assert lp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(0.5), 1 - math.exp(-0.5)], rel=1e-6)

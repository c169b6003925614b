"""The objectives against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vlmreg.sdk.objective import LossInputs
from vlmreg.train.losses import group_advantages, grpo_loss, gspo_loss, k3, kl_penalty, tis_weights


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    a = group_advantages(rewards, groups, eps=0.0)
    assert a[:2].tolist() == [1.0, -1.0]  # mean .5, std .5
    assert a[2:4].isnan().all() or (a[2:4] == 0).all()  # all equal: no signal (0 / 0 with eps 0)
    assert group_advantages(rewards, groups)[2:4].tolist() == [0.0, 0.0]  # the default eps keeps it finite
    assert group_advantages(rewards, groups, normalize_std=False).tolist() == [0.5, -0.5, 0.0, 0.0, 1.5, -1.5]


def test_tis_weights_are_truncated_and_detached():
    logp_old = torch.tensor([0.0, -1.0, -0.5], requires_grad=True)
    w = tis_weights(logp_old, torch.tensor([-1.0, 0.0, -0.5]), cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, math.exp(-1.0), 1.0]))
    assert not w.requires_grad


@pytest.mark.parametrize(
    "ratio, advantage, expected, clipped",
    [
        (1.0, 1.0, -1.0, False),
        (1.5, 1.0, -1.28, True),  # above 1 + clip_high: the gain is capped
        (1.5, -1.0, 1.5, False),  # a bad action made likelier is never capped
        (0.5, 1.0, -0.5, False),  # a good action made unlikelier is never capped
        (0.5, -1.0, 0.8, True),  # below 1 - clip_low with a negative advantage: capped
    ],
)
def test_grpo_token_terms(ratio, advantage, expected, clipped):
    logp_old = torch.tensor([-1.0])
    logp = logp_old + math.log(ratio)
    terms, was_clipped = grpo_loss(
        logp, logp_old, torch.tensor([advantage]), torch.ones(1), clip_low=0.2, clip_high=0.28
    )
    assert terms.item() == pytest.approx(expected, rel=1e-6)
    assert bool(was_clipped.item()) is clipped


def test_grpo_gradient_is_weighted_reinforce_on_policy():
    logp = torch.tensor([-0.3, -2.0], requires_grad=True)
    terms, _ = grpo_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.5]), 0.2, 0.28)
    terms.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-0.5 * 2.0, -1.5 * -1.0])  # -w * A


def test_gspo_uses_one_ratio_per_sequence():
    logp_old = torch.tensor([-1.0, -1.0, -2.0])
    logp = (logp_old + torch.tensor([math.log(1.1), math.log(1.21), 0.0])).requires_grad_()
    sequence = torch.tensor([0, 0, 1])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    terms, clipped = gspo_loss(logp, logp_old, advantages, torch.ones(3), sequence, clip_low=0.5, clip_high=0.5)
    s0 = math.sqrt(1.1 * 1.21)  # geometric mean of the token ratios
    # -s_i * A_i on every token of the sample (aggregation divides)
    assert terms[:2].tolist() == pytest.approx([-s0, -s0])
    assert terms[2].item() == pytest.approx(1.0)
    assert not clipped.any()
    (terms[:2].sum() / 2 + terms[2]).backward()  # each sample's token mean: the paper's - s_i A_i
    assert logp.grad.tolist() == pytest.approx([-s0 / 2, -s0 / 2, 1.0])  # s_i * A_i * grad(mean_t logp)


def test_gspo_clips_the_sequence_ratio():
    logp_old = torch.zeros(2)
    logp = torch.full((2,), math.log(1.01))
    terms, clipped = gspo_loss(logp, logp_old, torch.ones(2), torch.ones(2), torch.tensor([0, 0]), 3e-4, 4e-4)
    assert terms.tolist() == pytest.approx([-1.0004, -1.0004])
    assert clipped.all()


def test_k3_estimates_kl_and_is_never_negative():
    assert k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])).item() == pytest.approx(
        0.5 + math.log(2) - 1
    )
    assert k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    x = torch.randn(1000)
    assert (k3(x, x + torch.randn(1000)) >= 0).all()
    # Its mean over samples from p approaches KL(p || q): two categorical distributions.
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = k3(p.log()[draws], q.log()[draws]).mean().item()
    assert estimate == pytest.approx(float((p * (p / q).log()).sum()), abs=3e-3)


def test_importance_weights_at_each_level_and_mode_by_hand():
    # two samples: tokens 0, 1 (log ratios 0.5, 0.3) and token 2 (log ratio -0.2); cap C = 2 (log C = 0.6931)
    old = torch.tensor([-1.0, -2.0, -0.7], dtype=torch.float64)
    rollout = torch.tensor([-1.5, -2.3, -0.5], dtype=torch.float64)
    sequence = torch.tensor([0, 0, 1])
    token = tis_weights(old, rollout, 2.0, sequence=sequence, level="token", mode="truncate")
    assert token.tolist() == pytest.approx([math.exp(0.5), math.exp(0.3), math.exp(-0.2)])
    product = tis_weights(old, rollout, 2.0, sequence=sequence, level="sequence", mode="truncate")
    assert product.tolist() == pytest.approx([2.0, 2.0, math.exp(-0.2)])  # e^0.8 = 2.2255 truncated to 2
    geometric = tis_weights(old, rollout, 2.0, sequence=sequence, level="geometric", mode="truncate")
    assert geometric.tolist() == pytest.approx([math.exp(0.4), math.exp(0.4), math.exp(-0.2)])
    masked = tis_weights(old, rollout, 2.0, sequence=sequence, level="sequence", mode="mask")
    assert masked.tolist() == pytest.approx([0.0, 0.0, math.exp(-0.2)])  # sample 0 is over the cap: no loss at all
    token_masked = tis_weights(old, rollout, 1.5, sequence=sequence, level="token", mode="mask")
    assert token_masked.tolist() == pytest.approx([0.0, math.exp(0.3), math.exp(-0.2)])  # e^0.5 = 1.6487 > 1.5
    assert not token.requires_grad


def test_a_huge_sequence_ratio_is_masked_not_nan():
    old, rollout = torch.full((400,), 0.0), torch.full((400,), -1.0)  # log ratio 400: e^400 overflows float32
    weights = tis_weights(old, rollout, 2.0, sequence=torch.zeros(400, dtype=torch.long), level="sequence", mode="mask")
    assert torch.isfinite(weights).all() and weights.sum() == 0


def test_group_advantages_default_eps_and_its_sign_against_the_formula():
    """A = (r - mean) / (std + eps) written out, with the default eps = 1e-6, on a group whose std is of eps's
    size (so the eps term decides the value) and one whose std is 0.5."""
    rewards = torch.tensor([0.0, 2e-6, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    got = group_advantages(rewards, groups)
    expected = []
    for pair in (rewards[:2], rewards[2:]):
        mean, std = pair.mean(), pair.std(unbiased=False)
        expected += ((pair - mean) / (std + 1e-6)).tolist()
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))
    assert got[:2].tolist() == pytest.approx([-0.5, 0.5], rel=1e-5)


def test_integer_rewards_give_float32_advantages():
    a = group_advantages(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]), normalize_std=False)
    assert a.dtype == torch.float32 and a.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_tis_errors_name_the_level():
    with pytest.raises(ValueError, match="tis level 'sequence' needs each token's sequence"):
        tis_weights(torch.zeros(2), torch.zeros(2), 2.0, level="sequence")
    with pytest.raises(ValueError, match="unknown tis level 'sentence'"):
        tis_weights(torch.zeros(2), torch.zeros(2), 2.0, level="sentence", sequence=torch.tensor([0, 0]))


def test_the_kl_term_of_an_objective_without_an_aggregation_is_the_token_mean_even_of_one_token():
    one = torch.tensor([0.3])
    x = LossInputs(
        logp=one,
        logp_old=one,
        logp_rollout=one,
        advantages=one,
        weights=torch.ones(1),
        sequence=torch.tensor([0]),
        clip_low=0.2,
        clip_high=0.2,
        total_tokens=1,
        num_samples=1,
        max_tokens=4,
    )
    assert kl_penalty(torch.tensor([0.25]), x).item() == 0.25


def test_tis_mask_keeps_a_ratio_equal_to_the_cap_and_names_an_unknown_mode():
    """Masked importance sampling: w = rho if rho <= C, else 0; rho == C is kept (the formula's <=)."""
    logp_old = torch.tensor([math.log(2.0), math.log(2.0) + 0.1, 0.0])
    w = tis_weights(logp_old, torch.zeros(3), cap=2.0, mode="mask")
    assert w.tolist() == pytest.approx([2.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="unknown tis mode 'clip'"):
        tis_weights(logp_old, torch.zeros(3), cap=2.0, mode="clip")


def test_tis_weights_come_in_the_dtype_of_the_logprobs():
    w = tis_weights(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), cap=2.0)
    assert w.dtype == torch.float64

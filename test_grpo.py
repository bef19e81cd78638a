"""Tests: every worked example of the GRPO math in grpo.py: the surrogate, clipping, dual clip, k3,
the first step, advantages, aggregation, GSPO, process supervision, completion_mask and degenerate
inputs of the loss; then the functions beyond eq. 3 (CISPO, SAPO, the entropy and off-policy masks,
the sampler weights), alone and composed with grpo_loss as trainer.py composes them; then DPPO's
mask and policy term, GDPO's and RLOO's advantages, and the KL estimators (k2 and k3 in the loss,
k1 in the reward), each with its worked numbers in its docstring.

Self-contained: it needs torch, pytest and grpo.py alone, so the pair can be copied into another
project and run there (python -m pytest -q test_grpo.py). The rest of the suite is in tests/ (python
-m pytest -q runs both). Tolerances: values computed in fp32 from a handful of exp/log ops agree
with the exact decimals to about 1e-6 relative, so worked examples use abs=1e-6 (the quoted decimals
themselves have 6 places).
"""

import functools
import math

import pytest
import torch

from grpo import (
    bernoulli_kl,
    cispo_objective,
    completion_mask,
    dppo_mask,
    dppo_objective,
    gdpo_advantages,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    kl_penalty_rewards,
    loss_denominator,
    off_policy_mask,
    process_advantages,
    rloo_advantages,
    sampler_mismatch,
    sampler_weights,
    sapo_objective,
)

TOL = 1e-6  # see the docstring


def one_token_objective(ratio, advantage, **kwargs):
    """J for one completion of one token with the given ratio and advantage; returns (J,
    dJ/dlogπ_θ)."""
    logps = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss = grpo_loss(
        logps,
        old,
        None,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1),
        beta=0.0,
        **kwargs,
    )
    loss.backward()
    return -loss.item(), -logps.grad.item()


LENGTHS = [1, 4, 3, 3]


def aggregation_batch():
    mask = torch.tensor([[1 if t < n else 0 for t in range(4)] for n in LENGTHS])
    return torch.zeros(4, 4, requires_grad=True), torch.tensor([1.0, -1.0, 1.0, -1.0]), mask


EOS, PAD = 2, 0


# ---------------------------------------------------------------- the surrogate, no clipping in
# play
@pytest.mark.parametrize(
    "ratio,advantage,expected",
    [(1.2, 0.7, 0.84), (1.2, -0.7, -0.84), (0.8, 0.7, 0.56), (0.8, -0.7, -0.56)],
)
def test_unclipped_objective_is_ratio_times_advantage_e_g_1_2_times_0_7_is_0_84(
    ratio, advantage, expected
):
    # a clip range that never binds
    objective, grad = one_token_objective(ratio, advantage, epsilon=10.0)
    assert objective == pytest.approx(expected, abs=TOL)
    assert grad == pytest.approx(expected, abs=TOL)  # d(r·A)/dlog π = r·A


# ---------------------------------------------------------------- clipping at ε = 0.2
def test_clip_ratio_1_3_advantage_0_7_gives_0_84_and_no_gradient():
    assert one_token_objective(1.3, 0.7) == pytest.approx((0.84, 0.0), abs=TOL)


def test_clip_ratio_1_1_advantage_0_7_gives_0_77_and_gradient_flows():
    assert one_token_objective(1.1, 0.7) == pytest.approx((0.77, 0.77), abs=TOL)


def test_clip_ratio_0_7_advantage_minus_1_gives_minus_0_8_and_no_gradient():
    assert one_token_objective(0.7, -1.0) == pytest.approx((-0.8, 0.0), abs=TOL)


def test_clip_ratio_1_5_advantage_minus_1_is_not_clipped_min_is_pessimistic():
    assert one_token_objective(1.5, -1.0) == pytest.approx((-1.5, -1.5), abs=TOL)


# ---------------------------------------------------------------- dual clip δ (two-sided clipping)
@pytest.mark.parametrize(
    "ratio, advantage, delta, expected",
    [
        (
            10.0,
            -1.0,
            None,
            (-10.0, -10.0),
        ),  # without δ: unbounded below, and the gradient grows with r
        (10.0, -1.0, 4.0, (-4.0, 0.0)),  # δ caps it at δ·Â = -4, no gradient
        (3.0, -1.0, 4.0, (-3.0, -3.0)),  # below δ: unchanged, r·Â
        (10.0, 1.0, 4.0, (1.2, 0.0)),  # Â > 0: clip(r)·Â = 1.2 as without δ
        (0.5, -1.0, 4.0, (-0.8, 0.0)),  # r < 1 - ε, Â < 0: the ordinary clip, (1 - ε)·Â
    ],
)
def test_dual_clip_delta_bounds_the_objective_where_the_advantage_is_negative(
    ratio, advantage, delta, expected
):
    assert one_token_objective(ratio, advantage, delta=delta) == pytest.approx(expected, abs=TOL)


def test_dual_clip_counts_tokens_capped_by_delta_as_clipped():
    logps = torch.log(torch.tensor([[10.0, 3.0, 10.0]]))
    stats = {}
    # ε = 100: only δ can clip
    grpo_loss(
        logps,
        torch.zeros(1, 3),
        None,
        torch.tensor([-1.0]),
        torch.ones(1, 3),
        beta=0.0,
        delta=4.0,
        epsilon=100.0,
        stats=stats,
    )
    assert stats["clipped"] == 2 and stats["tokens"] == 3


def test_clip_higher_epsilon_high_0_28_lets_1_25_through_and_caps_1_5_at_1_28():
    assert one_token_objective(1.25, 1.0, epsilon_high=0.28)[0] == pytest.approx(1.25, abs=TOL)
    assert one_token_objective(1.5, 1.0, epsilon_high=0.28)[0] == pytest.approx(1.28, abs=TOL)
    assert one_token_objective(1.5, 1.0)[0] == pytest.approx(1.2, abs=TOL)  # without it: 1 + ε


# ---------------------------------------------------------------- statistics: clipped tokens
def test_stats_count_clipped_tokens():
    logps = torch.log(torch.tensor([[1.3, 1.1, 0.7, 1.5]]))
    stats = {}
    grpo_loss(
        logps, torch.zeros(1, 4), None, torch.tensor([1.0]), torch.ones(1, 4), beta=0.0, stats=stats
    )
    assert stats["tokens"] == 4 and stats["clipped"] == 2  # 1.3 and 1.5 exceed 1 + ε with A > 0
    assert stats["ratio"] == pytest.approx(1.3 + 1.1 + 0.7 + 1.5, abs=1e-5)


def test_stats_count_clipped_tokens_with_negative_advantage():
    # A = -1: r = 0.7 is below 1 - ε, so the clipped term is the active one; r = 1.5 is not clipped
    # (min picks r·A).
    stats = {}
    grpo_loss(
        torch.log(torch.tensor([[0.7, 1.5, 0.9]])),
        torch.zeros(1, 3),
        None,
        torch.tensor([-1.0]),
        torch.ones(1, 3),
        beta=0.0,
        stats=stats,
    )
    assert stats["clipped"] == 1 and stats["tokens"] == 3


# ---------------------------------------------------------------- k3, the KL estimator of eq. 4
@pytest.mark.parametrize(
    "x,expected",
    [
        (0.5, 0.148721),
        (-0.5, 0.106531),
        (math.log(2), 0.306853),
        (-math.log(2), 0.193147),
        (0.0, 0.0),
    ],
)
def test_k3_at_log_ref_over_pi(x, expected):
    # A = 0 and β = 1 leave only the KL term: loss = k3(x) with x = log π_ref - log π_θ.
    loss = grpo_loss(
        torch.zeros(1, 1, dtype=torch.float64),
        None,
        torch.tensor([[x]], dtype=torch.float64),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 1),
        beta=1.0,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_k3_is_never_negative():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)[:, None]
    stats = {}
    grpo_loss(
        torch.zeros_like(x),
        None,
        x,
        torch.zeros(len(x), dtype=torch.float64),
        torch.ones_like(x),
        beta=1.0,
        loss_type="dapo",
        stats=stats,
    )
    k3 = torch.exp(x) - x - 1
    assert (k3 >= 0).all() and stats["kl"] == pytest.approx(k3.sum().item(), rel=1e-9)


# ---------------------------------------------------------------- step 1: the policy equals the
# reference
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5])
def test_step_1_policy_equals_reference_so_loss_is_minus_advantage_2_and_kl_is_0(beta):
    # Before the first update π_θ = π_ref: the same log-probs, one with a gradient and one without
    # (tests/test_sampling.py checks the same on a real model's token_logprobs).
    torch.manual_seed(0)
    logps = (-torch.rand(4, 5) * 3).requires_grad_()
    ref = logps.detach().clone()
    stats = {}
    loss = grpo_loss(
        logps,
        None,
        ref if beta else None,
        torch.full((4,), 2.0),
        torch.ones(4, 5),
        beta=beta,
        stats=stats,
    )
    assert loss.item() == pytest.approx(-2.0, abs=TOL) and stats["kl"] == 0.0


# ---------------------------------------------------------------- μ = 1: the loss is about 0, the
# gradient is not
def test_mu_1_loss_is_beta_times_kl_and_gradient_matches_eq_20_21():
    torch.manual_seed(0)
    group, length, beta = 4, 6, 0.04
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    adv = group_advantages(rewards, group)  # standardized: Σ_i Â_i = 0
    mask = torch.ones(group, length)
    mask[1, 2:] = 0  # |o| = [6, 2, 6, 4]
    mask[3, 4:] = 0
    logps = (-torch.rand(group, length) * 3).requires_grad_()
    ref = -torch.rand(group, length) * 3
    loss = grpo_loss(logps, None, ref, adv, mask, beta=beta)
    x = ref - logps.detach()
    lengths = mask.sum(1, keepdim=True)
    mean_kl = (((torch.exp(x) - x - 1) * mask).sum(1) / lengths.squeeze(1)).mean()
    # the policy term is exactly 0
    assert loss.item() == pytest.approx(beta * mean_kl.item(), abs=1e-7)
    loss.backward()
    closed_form = -(adv[:, None] + beta * (torch.exp(x) - 1)) / (group * lengths) * mask
    assert logps.grad.abs().max() > 0.01  # a zero loss, a real gradient
    torch.testing.assert_close(logps.grad, closed_form, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the bias-corrected KL
# (DeepSeek-V3.2, eq. 7; TRL's use_bias_correction_kl): the KL term is r · k3, r not detached
def kl_only(ratios, rhos, corrected, on_policy=False, ratio_level="token"):
    """[-J, then d(-J)/dlog π_θ of each token] for one completion whose tokens have ratios
    π_θ/π_old and ρ = π_ref/π_θ, with Â = 0 and β = 1: the KL term alone, averaged over the
    tokens ("grpo")."""
    logps = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_()
    old = None if on_policy else torch.zeros_like(logps)
    ref = logps.detach() + torch.log(torch.tensor([rhos], dtype=torch.float64))
    loss = grpo_loss(
        logps, old, ref, torch.zeros(1, dtype=torch.float64), torch.ones_like(logps), beta=1.0,
        ratio_level=ratio_level, kl_bias_correction=corrected,
    )  # fmt: skip
    loss.backward()
    return [loss.item(), *logps.grad[0].tolist()]


def test_kl_bias_correction_r_1_5_rho_0_5_is_r_k3_0_289721_with_gradient_r_ln2_1_039721():
    # k3(ρ = 0.5) = 0.5 + ln 2 - 1 = 0.193147, its gradient 1 - ρ = 0.5. Times r = 1.5: 0.289721,
    # and d(r k3)/dlog π_θ = r (k3 + 1 - ρ) = r log(π_θ/π_ref) = 1.5 ln 2 = 1.039721.
    assert kl_only([1.5], [0.5], False) == pytest.approx([0.193147, 0.5], abs=TOL)
    assert kl_only([1.5], [0.5], True) == pytest.approx([0.289721, 1.039721], abs=TOL)


def test_kl_bias_correction_on_policy_keeps_the_loss_and_moves_the_gradient_0_5_to_ln2():
    # μ = 1: r = π_θ / sg(π_θ) is exactly 1, so the loss is k3 = 0.193147 either way; r's
    # gradient is not 0, so the KL's gradient is log(π_θ/π_ref) = ln 2 = 0.693147, not 0.5.
    assert kl_only([1.0], [0.5], False, True) == pytest.approx([0.193147, 0.5], abs=TOL)
    assert kl_only([1.0], [0.5], True, True) == pytest.approx([0.193147, 0.693147], abs=TOL)


def test_kl_bias_correction_at_sequence_level_spreads_r_over_the_tokens():
    # ρ = (0.5, 2), on-policy, mean over |o| = 2: k3 = (0.193147, 0.306853), loss 0.25 either way.
    # Token ratios: d/dlog π_t = log(π_θ/π_ref)_t / 2 = ±0.346574. GSPO's one ratio
    # r = exp(mean_t log r_t): ((1 - ρ_t) + Σ k3 / 2) / 2 = (0.75, -0.75) / 2. Uncorrected:
    # (1 - ρ_t) / 2 = (0.5, -1) / 2.
    assert kl_only([1.0, 1.0], [0.5, 2.0], False, True) == pytest.approx(
        [0.25, 0.25, -0.5], abs=TOL
    )
    assert kl_only([1.0, 1.0], [0.5, 2.0], True, True) == pytest.approx(
        [0.25, 0.346574, -0.346574], abs=TOL
    )
    assert kl_only([1.0, 1.0], [0.5, 2.0], True, True, "sequence") == pytest.approx(
        [0.25, 0.375, -0.375], abs=TOL
    )


def test_kl_bias_correction_off_or_at_beta_0_leaves_loss_and_gradient_bit_identical():
    torch.manual_seed(0)
    logps0, old, ref = -torch.rand(4, 5) * 3, -torch.rand(4, 5) * 3, -torch.rand(4, 5) * 3
    adv, mask = torch.tensor([1.0, -0.5, 0.3, -0.8]), (torch.rand(4, 5) > 0.2).long()

    def run(beta, **kwargs):
        logps = logps0.clone().requires_grad_()
        loss = grpo_loss(logps, old, ref, adv, mask, beta=beta, loss_type="dapo", **kwargs)
        loss.backward()
        return loss.detach(), logps.grad

    for got, want in zip(run(0.04, kl_bias_correction=False), run(0.04)):
        assert torch.equal(got, want)
    for got, want in zip(run(0.0, kl_bias_correction=True), run(0.0)):
        assert torch.equal(got, want)
    assert not torch.equal(run(0.04, kl_bias_correction=True)[1], run(0.04)[1])


# ---------------------------------------------------------------- advantages
def test_advantages_1_0_1_0_are_plus_minus_0_865875():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    assert adv.tolist() == pytest.approx([0.865875, -0.865875, 0.865875, -0.865875], abs=TOL)


def test_advantages_1_1_1_0_are_half_and_minus_one_and_half_as_eps_goes_to_0():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), 4, eps=0.0)
    assert adv.tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=TOL)


def test_advantages_of_equal_rewards_are_exactly_0():
    assert group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4).tolist() == [0.0] * 4
    # 0.1 + 0.1 + 0.1 is not 0.3 in floating point; the group still gets exact zeros
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5]), 3, scale="batch")
    # 0.5 is the mean of group 2
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and adv[3:].abs().min() == 0.0


def test_advantages_scale_none_is_reward_minus_group_mean():
    adv = group_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0, 4.0, 2.0]), 3, scale="none")
    assert adv.tolist() == pytest.approx([5 / 3, -1 / 3, -4 / 3, -2.0, 2.0, 0.0], abs=TOL)


def test_advantages_scale_batch_divides_by_whole_batch_std():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    adv = group_advantages(rewards, 2, scale="batch", eps=0.0)
    std = rewards.std().item()  # sqrt(11/6 · ...) Bessel over all 4
    assert adv.tolist() == pytest.approx([0.5 / std, -0.5 / std, 1 / std, -1 / std], abs=TOL)


def test_advantages_reject_a_batch_not_divisible_by_group_size():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(5), 4)


# ---------------------------------------------------------------- aggregation: grpo / dapo /
# dr_grpo
@pytest.mark.parametrize(
    "loss_type,expected,normalizer",
    [("grpo", 0.0, 4), ("dapo", 3 / 11, 11), ("dr_grpo", 3 / 16, 16)],
)
def test_aggregation_lengths_1_4_3_3_and_micro_batches_sum_to_full_batch(
    loss_type, expected, normalizer
):
    logps, adv, mask = aggregation_batch()
    full = grpo_loss(logps, None, None, adv, mask, beta=0.0, loss_type=loss_type, max_tokens=4)
    assert full.item() == pytest.approx(expected, abs=TOL)
    full.backward()
    full_grad, logps.grad = logps.grad.clone(), None
    parts = [
        grpo_loss(
            logps[rows],
            None,
            None,
            adv[rows],
            mask[rows],
            beta=0.0,
            loss_type=loss_type,
            max_tokens=4,
            normalizer=normalizer,
        )
        for rows in ([0, 1], [2, 3])
    ]
    total = parts[0] + parts[1]
    total.backward()
    assert total.item() == pytest.approx(expected, abs=TOL)
    torch.testing.assert_close(logps.grad, full_grad, rtol=0, atol=1e-7)


def test_loss_denominator_lengths_1_4_3_3_is_4_sequences_11_tokens_or_16_for_dr_grpo():
    _, _, mask = aggregation_batch()
    assert [loss_denominator(mask, t, max_tokens=4) for t in ("grpo", "dapo", "dr_grpo")] == [
        4,
        11,
        16,
    ]
    with pytest.raises(ValueError, match="max_tokens"):
        loss_denominator(mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        loss_denominator(mask, "mean")


def test_aggregation_naive_mean_of_micro_batch_losses_is_wrong_0_3_not_3_11():
    logps, adv, mask = aggregation_batch()
    parts = [
        grpo_loss(logps[rows], None, None, adv[rows], mask[rows], beta=0.0, loss_type="dapo")
        for rows in ([0, 1], [2, 3])
    ]
    # (3/5 + 0/6) / 2, not 3/11
    assert ((parts[0] + parts[1]) / 2).item() == pytest.approx(0.3, abs=TOL)


def test_dr_grpo_needs_max_tokens():
    logps, adv, mask = aggregation_batch()
    with pytest.raises(ValueError, match="max_tokens"):
        grpo_loss(logps, None, None, adv, mask, beta=0.0, loss_type="dr_grpo")


def test_beta_without_reference_is_an_error():
    logps, adv, mask = aggregation_batch()
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, None, None, adv, mask, beta=0.04)


# ---------------------------------------------------------------- GSPO: the sequence ratio and its
# gradient
def test_gspo_token_log_ratios_0_1_minus_0_2_0_4_give_sequence_ratio_e_0_1():
    log_ratio = torch.tensor([[0.1, -0.2, 0.4, 9.0]])  # the 4th token is masked out
    loss = grpo_loss(
        log_ratio,
        torch.zeros(1, 4),
        None,
        torch.tensor([1.0]),
        torch.tensor([[1, 1, 1, 0]]),
        beta=0.0,
        epsilon=10.0,
        ratio_level="sequence",
    )
    assert -loss.item() == pytest.approx(1.105171, abs=TOL)


def test_gspo_gradient_flows_through_the_sequence_ratio_to_every_token():
    # J = mean_t s·A = s for A = 1, s = exp(mean of the 3 unmasked log-ratios): dJ/dlogπ_t = s/3, 0
    # where masked.
    logps = torch.tensor([[0.1, -0.2, 0.4, 9.0]], requires_grad=True)
    loss = grpo_loss(
        logps,
        torch.zeros(1, 4),
        None,
        torch.tensor([1.0]),
        torch.tensor([[1, 1, 1, 0]]),
        beta=0.0,
        epsilon=10.0,
        ratio_level="sequence",
    )
    loss.backward()
    s = math.exp(0.1)
    assert (-logps.grad).tolist()[0] == pytest.approx([s / 3, s / 3, s / 3, 0.0], abs=TOL)


# ---------------------------------------------------------------- process supervision (§4.1.3)
def test_process_advantages_sum_normalized_rewards_of_steps_ending_at_or_after_each_token():
    # Group of 2: completion 0 has steps ending at tokens 1 and 3 with rewards 1 and 0; completion 1
    # has two steps rewarded 0.5. Pooled [1, 0, 0.5, 0.5]: mean 0.5, Bessel std sqrt(1/6), so
    # ±sqrt(1.5) and 0.
    adv = process_advantages([[1.0, 0.0], [0.5, 0.5]], [[1, 3], [0, 4]], 2, 5, eps=0.0)
    s = math.sqrt(1.5)
    assert adv[0].tolist() == pytest.approx([s - s, s - s, -s, -s, 0.0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([0.0] * 5, abs=TOL)
    # grpo_loss takes the [N, T] advantages as they are: at ratio 1, J = mean over sequences of
    # mean_t Â_t.
    loss = grpo_loss(torch.zeros(2, 5), None, None, adv, torch.ones(2, 5), beta=0.0)
    assert -loss.item() == pytest.approx((-2 * s / 5) / 2, abs=TOL)


# ---------------------------------------------------------------- completion_mask
def test_completion_mask_eos_in_the_middle_keeps_the_eos_token():
    assert completion_mask(torch.tensor([[5, 6, EOS, 7, 8]]), EOS).tolist() == [[1, 1, 1, 0, 0]]


def test_completion_mask_eos_first_keeps_only_the_eos():
    assert completion_mask(torch.tensor([[EOS, 6, EOS, 7]]), EOS).tolist() == [[1, 0, 0, 0]]


def test_completion_mask_without_eos_is_all_ones():
    assert completion_mask(torch.tensor([[5, 6, 7]]), EOS).tolist() == [[1, 1, 1]]


def test_completion_mask_two_eos_ids_stop_at_whichever_comes_first():
    ids = torch.tensor([[5, 9, 6, EOS], [5, EOS, 9, 6]])
    assert completion_mask(ids, [EOS, 9]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


def test_completion_mask_when_pad_equals_eos_the_eos_still_counts():
    # generate() pads finished rows with pad == EOS; the first one is the real EOS and must be
    # trained on.
    ids = torch.tensor([[5, 6, EOS, EOS, EOS], [5, 6, 7, 8, 9]])
    assert completion_mask(ids, EOS).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


# ---------------------------------------------------------------- degenerate inputs
def test_all_masked_batch_gives_loss_0_zero_gradients_and_no_nan():
    # garbage where masked
    logps = torch.tensor([[0.0, -1e9], [float("-inf"), 3.0]], requires_grad=True)
    ref = torch.tensor([[float("inf"), 0.0], [0.0, float("nan")]])
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        logps.grad = None
        loss = grpo_loss(
            logps,
            logps.detach() + 5,
            ref,
            torch.tensor([1.0, -1.0]),
            torch.zeros(2, 2),
            loss_type=loss_type,
            max_tokens=2,
        )
        loss.backward()
        assert loss.item() == 0.0 and logps.grad.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_a_row_with_no_tokens_contributes_0_not_nan():
    logps = torch.zeros(2, 3, requires_grad=True)
    loss = grpo_loss(
        logps, None, None, torch.tensor([1.0, 5.0]), torch.tensor([[1, 1, 0], [0, 0, 0]]), beta=0.0
    )
    assert loss.item() == pytest.approx(-0.5, abs=TOL)  # (1 + 0) / 2 sequences


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_far_off_policy_or_far_from_the_reference_keeps_loss_and_gradient_finite(dtype):
    # log r = 100 with Â = -1 and no dual clip: exp(100) overflows fp32, so the loss was inf and the
    # update skipped. Bounded at MAX_LOG_RATIO = 20: the loss is (e^20 + 1) / 2, finite, and that
    # token passes no gradient through its ratio. The same for k3 at log(π_ref / π_θ) = 100. The
    # other token's gradient is untouched.
    logps = torch.tensor([[0.0, -1.0]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]], dtype=dtype)
    mask = torch.ones(1, 2)
    loss = grpo_loss(logps, old, None, torch.tensor([-1.0], dtype=dtype), mask, beta=0.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    # token 0: ratio e^20 (bounded), objective e^20 * -1; token 1: ratio 1, objective -1; mean over
    # 2 tokens, negated
    expected = (math.exp(20.0) + 1) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert float(logps.grad[0, 0]) == 0.0  # beyond the bound: no gradient through the ratio
    assert float(logps.grad[0, 1]) == pytest.approx(
        0.5, rel=1e-2
    )  # d(-(r Â)/2)/dlogp = -Â r / 2 = 0.5
    logps = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0]])
    loss = grpo_loss(logps, None, ref, torch.tensor([0.0]), mask, beta=0.04)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    # k3 at the bound: e^20 - 20 - 1 for token 0, 0 for token 1; loss = β k3 / 2
    assert loss.item() == pytest.approx(0.04 * (math.exp(20.0) - 21) / 2, rel=1e-6)


# ---------------------------------------------------------------- CISPO (MiniMax-M1): J = sg(r̂) Â
# log π_θ, r̂ = min(r, 1 + ε_high); its gradient is r̂ Â for every token, clipped or not
@pytest.mark.parametrize(
    "ratio, advantage, epsilon_high, expected",
    [
        (1.5, 1.0, None, (0.486558, 1.2)),  # capped at 1 + ε = 1.2: 1.2 ln 1.5, gradient still 1.2
        (1.1, 0.7, None, (0.073389, 0.77)),  # under the cap: 1.1 · 0.7 · ln 1.1
        (0.5, -1.0, None, (0.346574, -0.5)),  # no lower bound (the paper's ε_low unused)
        (1.5, -1.0, None, (-0.486558, -1.2)),  # the cap holds for Â < 0 too
        (6.0, 1.0, 4.0, (8.958797, 5.0)),  # ε_high 4 (TRL's epsilon_high 5.0): 5 ln 6
        (1.5, 1.0, 4.0, (0.608198, 1.5)),
    ],
)
def test_cispo_clips_the_weight_and_keeps_the_gradient(ratio, advantage, epsilon_high, expected):
    # composed as the trainer composes it: grpo_loss's surrogate, ε_high bound (default ε = 0.2)
    cispo = functools.partial(cispo_objective, epsilon_high=epsilon_high or 0.2)
    assert one_token_objective(ratio, advantage, surrogate=cispo) == pytest.approx(
        expected, abs=TOL
    )


def test_cispo_objective_alone_caps_the_weight_and_counts_the_capped_tokens():
    # r = (1.5, 1.1, 0.5), Â = 1, ε_high = 0.2: J_t = (1.2 ln 1.5, 1.1 ln 1.1, 0.5 ln 0.5), the
    # gradient sg(r̂) Â = (1.2, 1.1, 0.5); the first token alone is capped
    ratio = torch.tensor([[1.5, 1.1, 0.5]], dtype=torch.float64)
    logps = torch.log(ratio).requires_grad_()
    term, capped = cispo_objective(ratio, torch.ones(1, 1, dtype=torch.float64), logps)
    assert term[0].tolist() == pytest.approx([0.486558, 0.104841, -0.346574], abs=TOL)
    assert capped.tolist() == [[True, False, False]]
    term.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([1.2, 1.1, 0.5], abs=TOL)


# ---------------------------------------------------------------- SAPO: J = σ(τ (r - 1)) 4/τ Â,
# dJ/dlog π = 4 r σ (1 - σ) Â; τ+ = 1 where Â > 0, τ- = 1.05 where Â <= 0
@pytest.mark.parametrize(
    "ratio, advantage, expected",
    [
        (1.0, 1.0, (2.0, 1.0)),  # on-policy: the gradient is Â, as eq. 3's
        (1.0, -1.0, (-1.904762, -1.0)),  # -4 σ(0) / 1.05, gradient -1
        (1.5, 1.0, (2.489837, 1.410022)),
        (3.0, 1.0, (3.523188, 1.259923)),  # far past any clip: damped, not cut to 0
        (0.5, -1.0, (-1.415938, -0.46707)),
        (1.5, -1.0, (-2.393585, -1.40121)),
    ],
)
def test_sapo_soft_gate_values_and_gradients(ratio, advantage, expected):
    got = one_token_objective(ratio, advantage, surrogate=sapo_objective)
    assert got == pytest.approx(expected, abs=TOL)


def test_sapo_objective_alone_picks_tau_by_the_sign_of_the_advantage_and_clips_nothing():
    # r = 1.5: 4 σ(0.5) = 2.489837 with Â = 1 (τ+ = 1); with Â = -1 (τ- = 1.05) -4 σ(0.525) / 1.05
    # = -2.393585; τ+ = 2 instead: 4 σ(1) / 2 = 1.462117
    ratio = torch.full((2, 1), 1.5, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    term, clipped = sapo_objective(ratio, adv)
    assert term[:, 0].tolist() == pytest.approx([2.489837, -2.393585], abs=TOL)
    assert not clipped.any() and clipped.shape == (2, 1)
    term, _ = sapo_objective(ratio, adv, tau_pos=2.0)
    assert term[0, 0].item() == pytest.approx(1.462117, abs=TOL)


def two_completions(ratios, advantages, lengths, **kwargs):
    """J and dJ/dlog π_θ [N, T] for completions whose tokens have the given ratios (π_old = 1)."""
    T = max(lengths)
    r = torch.tensor([row + [1.0] * (T - len(row)) for row in ratios], dtype=torch.float64)
    logps = torch.log(r).requires_grad_()
    mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths])
    kwargs = {"beta": 0.0, **kwargs}
    loss = grpo_loss(
        logps,
        torch.zeros_like(r),
        kwargs.pop("ref", None),
        torch.tensor(advantages, dtype=torch.float64),
        mask,
        **kwargs,
    )
    loss.backward()
    return -loss.item(), -logps.grad


def test_cispo_batch_with_capped_and_free_tokens_under_dapo_aggregation():
    # Tokens (1.5, 1.1, 0.5) with Â = 1, then (0.5, 1.0) with Â = -1; cap 1.2; DAPO divides by 5.
    value, grad = two_completions(
        [[1.5, 1.1, 0.5], [0.5, 1.0]],
        [1.0, -1.0],
        [3, 2],
        surrogate=cispo_objective,
        loss_type="dapo",
    )
    per_token = [1.2 * math.log(1.5), 1.1 * math.log(1.1), 0.5 * math.log(0.5)]
    per_token += [-0.5 * math.log(0.5), -1.0 * math.log(1.0)]
    assert value == pytest.approx(sum(per_token) / 5, abs=TOL)
    assert value == pytest.approx(0.118280, abs=TOL)  # (0.486558 + 0.104841 + 0) / 5
    expected = torch.tensor([[1.2, 1.1, 0.5], [-0.5, -1.0, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(grad, expected, atol=TOL)


def test_sapo_batch_under_grpo_aggregation_with_kl():
    # (1.5, 1.0) with Â = 1 and (0.5) with Â = -1; β = 0.1 with π_ref = π_old: the KL term is
    # k3 at x = -log r, untouched by the gate.
    ref = torch.zeros(2, 2, dtype=torch.float64)
    value, grad = two_completions(
        [[1.5, 1.0], [0.5]], [1.0, -1.0], [2, 1], surrogate=sapo_objective, beta=0.1, ref=ref
    )

    def k3(r):
        return 1 / r + math.log(r) - 1

    first = (2.489837 - 0.1 * k3(1.5) + 2.0 - 0.1 * k3(1.0)) / 2
    second = -1.415938 - 0.1 * k3(0.5)
    assert value == pytest.approx((first + second) / 2, abs=TOL)
    # dk3/dlog π = 1 - 1/r; each completion's tokens over its length, then over N = 2
    expected = torch.tensor(
        [
            [(1.410022 - 0.1 * (1 - 1 / 1.5)) / 2, (1.0 - 0.0) / 2],
            [-0.46707 - 0.1 * (1 - 1 / 0.5), 0.0],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(grad, expected / 2, atol=TOL)


def test_delta_is_the_clips_and_refused_with_another_surrogate():
    with pytest.raises(ValueError, match="delta"):
        one_token_objective(1.0, 1.0, surrogate=cispo_objective, delta=2.0)


# ---------------------------------------------------------------- the top-ρ tokens by entropy
def test_high_entropy_mask_quantile_on_ties_keeps_every_tied_token():
    entropy = torch.tensor([[0.1, 0.5, 0.5, 0.5, 0.9]])
    mask = torch.ones(1, 5)
    # ρ = 0.4: the 0.6 quantile of (0.1, 0.5, 0.5, 0.5, 0.9) is 0.5 (position 2.4 between two
    # 0.5s): the three tied tokens stay with 0.9, 4 of 5 (ties keep more than the share ρ)
    assert high_entropy_mask(entropy, mask, 0.4).tolist() == [[False, True, True, True, True]]
    # ρ = 0.2: the 0.8 quantile is 0.5 + 0.2 · (0.9 - 0.5) = 0.58: 0.9 alone
    assert high_entropy_mask(entropy, mask, 0.2).tolist() == [[False, False, False, False, True]]
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[False, False, False, False, True]]
    assert high_entropy_mask(entropy, mask, 1.0).all()


def test_high_entropy_mask_ignores_masked_tokens_forced_tool_tokens_included():
    # a masked (e.g. tool-forced) token of entropy 9 neither moves the threshold nor is kept
    entropy = torch.tensor([[0.1, 9.0, 0.3, 0.2, 0.4]])
    mask = torch.tensor([[1, 0, 1, 1, 1]])
    # the 0.5 quantile of (0.1, 0.3, 0.2, 0.4) is 0.25: 0.3 and 0.4 stay
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, False, True, False, True]]
    assert not high_entropy_mask(entropy, torch.zeros(1, 5), 0.5).any()


def test_top_entropy_drops_the_policy_term_of_low_entropy_tokens_not_their_kl():
    # Ratios (1.1, 1.1) with Â = 1, entropies (0.2, 0.9), ρ = 0.5: the first token loses its
    # policy term r Â = 1.1 but keeps its KL; π_ref = π_old, β = 0.1. The mask is grpo_loss's
    # weights, as the trainer composes it.
    ref = torch.zeros(1, 2, dtype=torch.float64)
    entropy = torch.tensor([[0.2, 0.9]], dtype=torch.float64)
    high = high_entropy_mask(entropy, torch.ones(1, 2), 0.5)  # the 0.5 quantile: 0.55
    stats = {}
    value, grad = two_completions(
        [[1.1, 1.1]], [1.0], [2], beta=0.1, ref=ref, weights=high, stats=stats
    )
    k3 = 1 / 1.1 + math.log(1.1) - 1
    assert value == pytest.approx((0.0 - 0.1 * k3 + 1.1 - 0.1 * k3) / 2, abs=TOL)
    dk3 = 0.1 * (1 - 1 / 1.1)
    expected = torch.tensor([[-dk3 / 2, (1.1 - dk3) / 2]], dtype=torch.float64)
    assert torch.allclose(grad, expected, atol=TOL)
    assert high.tolist() == [[False, True]] and stats["tokens"] == 2
    with pytest.raises(ValueError, match="rho"):
        high_entropy_mask(entropy, torch.ones(1, 2), 1.5)


# ---------------------------------------------------------------- the off-policy sequence mask
def test_off_policy_mask_drops_a_negative_advantage_far_off_policy_keeps_a_positive_one():
    # Both completions: log π_behavior - log π_θ = (0.4, 0.8), mean 0.6.
    logps = torch.zeros(2, 2)
    behavior = torch.tensor([[0.4, 0.8], [0.4, 0.8]])
    mask = torch.ones(2, 2)
    advantages = torch.tensor([1.0, -1.0])
    assert off_policy_mask(advantages, logps, behavior, mask, 0.5).tolist() == [[1.0], [0.0]]
    assert off_policy_mask(advantages, logps, behavior, mask, 0.6).tolist() == [[1.0], [1.0]]
    # the mean is over the completion's tokens only: a masked (forced) token's 5.0 does not count
    holed = torch.tensor([[0.4, 0.8, 5.0], [0.4, 0.8, 5.0]])
    hole = torch.tensor([[1, 1, 0], [1, 1, 0]])
    keep = off_policy_mask(advantages, torch.zeros(2, 3), holed, hole, 0.6)
    assert keep.tolist() == [[1.0], [1.0]]


def test_off_policy_mask_in_the_loss_uses_pi_old_unless_the_behavior_log_probs_are_given():
    # Ratios 0.5 (log π_θ - log π_old = -0.693 per token: KL estimate 0.693) with Â = -1, and the
    # same with Â = +1. δ = 0.5: the negative one is dropped, J = (0.5 + 0) / 2 with ε = 10.
    logps = torch.log(torch.full((2, 1), 0.5, dtype=torch.float64))
    old, mask = torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, 1)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    keep = off_policy_mask(advantages, logps, old, mask, 0.5)  # π_behavior = π_old
    assert keep.tolist() == [[1.0], [0.0]]
    value, grad = two_completions([[0.5], [0.5]], [1.0, -1.0], [1, 1], epsilon=10.0, weights=keep)
    assert value == pytest.approx(0.25, abs=TOL)
    assert grad[1, 0].item() == 0.0 and grad[0, 0].item() == pytest.approx(0.25, abs=TOL)
    # behavior log-probs equal to π_θ's: no gap, nothing dropped
    keep = off_policy_mask(advantages, logps, logps, mask, 0.5)
    value, _ = two_completions([[0.5], [0.5]], [1.0, -1.0], [1, 1], epsilon=10.0, weights=keep)
    assert keep.tolist() == [[1.0], [1.0]] and value == pytest.approx((0.5 - 0.5) / 2, abs=TOL)


# ---------------------------------------------------------------- the sampler correction
@pytest.mark.parametrize(
    "mode, low, high, expected, outside",
    [
        ("token_truncate", 0.0, 3.0, [0.5, 1.0, 3.0], [False, False, True]),
        ("token_mask", 0.0, 3.0, [0.5, 1.0, 0.0], [False, False, True]),
        ("token_truncate", 0.6, 3.0, [0.6, 1.0, 3.0], [True, False, True]),
        ("token_mask", 0.6, 3.0, [0.0, 1.0, 0.0], [True, False, True]),
    ],
)
def test_sampler_weights_per_token_at_ratios_0_5_1_5(mode, low, high, expected, outside):
    old = torch.log(torch.tensor([[0.5, 1.0, 5.0]], dtype=torch.float64))
    w, hit = sampler_weights(
        old, torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3), mode, low, high
    )
    assert w[0].tolist() == pytest.approx(expected, abs=1e-12) and hit[0].tolist() == outside


@pytest.mark.parametrize(
    "mode, low, high, expected, outside",
    [
        # one-token completions: each its own sequence ratio
        ("sequence_truncate", 0.6, 3.0, [0.6, 1.0, 3.0], [True, False, True]),
        ("sequence_mask", 0.6, 3.0, [0.0, 1.0, 0.0], [True, False, True]),
        ("sequence_mask", 0.0, 3.0, [0.5, 1.0, 0.0], [False, False, True]),
    ],
)
def test_sampler_weights_per_sequence_at_ratios_0_5_1_5(mode, low, high, expected, outside):
    old = torch.log(torch.tensor([[0.5], [1.0], [5.0]], dtype=torch.float64))
    w, hit = sampler_weights(
        old, torch.zeros(3, 1, dtype=torch.float64), torch.ones(3, 1), mode, low, high
    )
    assert w.shape == (3, 1)
    assert w[:, 0].tolist() == pytest.approx(expected, abs=1e-12)
    assert hit[:, 0].tolist() == outside


def test_sampler_weights_sequence_ratio_is_the_product_over_sampled_tokens_only():
    # tokens 0.5, 1, 5 in one completion: Π = 2.5; a fourth, masked (forced) token's 100 is not in
    old = torch.log(torch.tensor([[0.5, 1.0, 5.0, 100.0]], dtype=torch.float64))
    sampler, mask = torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[1, 1, 1, 0]])
    w, _ = sampler_weights(old, sampler, mask, "sequence_truncate", 0.0, 3.0)
    assert w.item() == pytest.approx(2.5, abs=1e-12)
    w, hit = sampler_weights(old, sampler, mask, "sequence_truncate", 0.0, 2.0)
    assert w.item() == pytest.approx(2.0, abs=1e-12) and hit.item()
    w, hit = sampler_weights(old, sampler, mask, "sequence_mask", 0.0, 2.0)
    assert w.item() == 0.0 and hit.item()
    with pytest.raises(ValueError, match="mode"):
        sampler_weights(old, sampler, mask, "token", 0.0, 2.0)


def test_weights_scale_the_policy_term_of_each_token_not_its_kl():
    # Ratios (1.1, 1.1), Â = 1, weights (0.5, 2): J = (0.5·1.1 + 2·1.1)/2 - β k3; π_ref = π_old
    ref = torch.zeros(1, 2, dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    value, grad = two_completions([[1.1, 1.1]], [1.0], [2], beta=0.1, ref=ref, weights=weights)
    k3 = 1 / 1.1 + math.log(1.1) - 1
    assert value == pytest.approx((0.55 - 0.1 * k3 + 2.2 - 0.1 * k3) / 2, abs=TOL)
    dk3 = 0.1 * (1 - 1 / 1.1)
    expected = torch.tensor([[(0.55 - dk3) / 2, (2.2 - dk3) / 2]], dtype=torch.float64)
    assert torch.allclose(grad, expected, atol=TOL)


def test_sampler_mismatch_k3_and_largest_ratio():
    trainer = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    sampler = torch.log(torch.tensor([[0.5, 0.5, 0.3]]))  # ratios 1, 0.5, 3
    kl, largest = sampler_mismatch(trainer, sampler, torch.tensor([[1, 1, 0]]))
    # the unmasked ratios 1 and 0.5: k3 = 0 and 0.5 + ln 2 - 1 = 0.193147; mean 0.096574
    assert kl == pytest.approx(0.096574, abs=TOL) and largest == pytest.approx(2.0, abs=1e-6)
    assert sampler_mismatch(trainer, trainer, torch.ones(1, 3)) == (0.0, 1.0)
    assert sampler_mismatch(trainer, sampler, torch.zeros(1, 3)) is None


# ---------------------------------------------------------------- composed: masks x weights
def test_off_policy_mask_entropy_mask_and_sampler_weights_multiply_the_policy_term():
    # As the trainer composes them: grpo_loss's weights = off-policy mask x entropy mask x sampler
    # weights. Completion 0: ratios (1.1, 1.1), Â = 1, entropies (0.2, 0.9), sampler weights
    # (2, 0.5); completion 1: ratios (0.5, 0.5), Â = -1, entropies (0.8, 0.7), weights (1, 1).
    # Off-policy (π_behavior = π_old, δ = 0.5): completion 1's mean gap ln 2 > 0.5, Â < 0: dropped.
    # Entropy, ρ = 0.5: the median of (0.2, 0.9, 0.8, 0.7) is 0.75: 0.9 and 0.8 stay. Product:
    # ((0, 0.5), (0, 0)); J = ((0 + 0.5 · 1.1) / 2 + 0) / 2 = 0.1375, ε = 10, β = 0.
    ratios = torch.tensor([[1.1, 1.1], [0.5, 0.5]], dtype=torch.float64)
    logps, old, mask = torch.log(ratios), torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    entropy = torch.tensor([[0.2, 0.9], [0.8, 0.7]], dtype=torch.float64)
    sampler = -torch.log(torch.tensor([[2.0, 0.5], [1.0, 1.0]], dtype=torch.float64))
    keep = off_policy_mask(advantages, logps, old, mask, 0.5)
    high = high_entropy_mask(entropy, mask, 0.5)
    w, _ = sampler_weights(old, sampler, mask, "token_truncate", 0.0, 3.0)
    weights = keep * high * w
    assert weights.flatten().tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0], abs=1e-12)
    value, grad = two_completions(
        ratios.tolist(), advantages.tolist(), [2, 2], epsilon=10.0, weights=weights
    )
    assert value == pytest.approx(0.1375, abs=TOL)
    expected = torch.tensor([[0.0, 0.5 * 1.1 / 4], [0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected, atol=TOL)


# ---------------------------------------------------------------- DPPO: a trust region on the
# sampled token's probability p against the behaviour policy's b, in place of the ratio clip
def probabilities(values):
    return torch.log(torch.tensor(values, dtype=torch.float64))


@pytest.mark.parametrize(
    "divergence, delta, p, advantage, kept",
    [
        ("tv", 0.2, 0.8, 1.0, 0.0),  # p - b = 0.3 > 0.2, pushed further up: dropped
        ("tv", 0.2, 0.8, -1.0, 1.0),  # the update lowers p, back towards b: kept
        ("tv", 0.2, 0.2, -1.0, 0.0),  # b - p = 0.3 > 0.2, pushed further down: dropped
        ("tv", 0.2, 0.2, 1.0, 1.0),
        ("tv", 0.2, 0.6, 1.0, 1.0),  # |p - b| = 0.1: inside either way
        ("tv", 0.2, 0.6, -1.0, 1.0),
        ("kl", 0.05, 0.8, 1.0, 0.0),  # D = 0.223144 > 0.05 and p > b
        ("kl", 0.05, 0.8, -1.0, 1.0),
        ("kl", 0.05, 0.2, -1.0, 0.0),  # D = 0.223144 > 0.05 and p < b
        ("kl", 0.05, 0.2, 1.0, 1.0),
        ("kl", 0.05, 0.6, 1.0, 1.0),  # D = 0.020411 < 0.05
        ("kl", 0.05, 0.4, -1.0, 1.0),  # D = 0.020411 too (b = 0.5 is the midpoint)
    ],
)
def test_dppo_mask_each_branch_at_b_0_5(divergence, delta, p, advantage, kept):
    """b = 0.5. Binary TV is |p - b|: 0.3 at p = 0.8 and 0.2, 0.1 at 0.6 and 0.4. Binary KL is
    D = b ln(b/p) + (1-b) ln((1-b)/(1-p)): at p = 0.8, 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 ln
    1.5625 = 0.223144, the same at p = 0.2 (the two terms swap); at p = 0.6, 0.5 ln(0.25/0.24) =
    0.020411, the same at 0.4. δ_low = δ_high = δ. A token is dropped only where Â pushes it further
    out of the region. Â = 0 is never dropped (its policy term is 0 anyway)."""
    logps, behavior = probabilities([[p]]), probabilities([[0.5]])
    adv = torch.tensor([advantage], dtype=torch.float64)
    got = dppo_mask(adv, logps, behavior, torch.ones(1, 1), delta, delta, divergence)
    assert got.tolist() == [[kept]] and got.dtype == torch.float64 and not got.requires_grad
    assert dppo_mask(adv * 0, logps, behavior, torch.ones(1, 1), delta, delta, divergence).item()


def test_bernoulli_kl_at_b_0_5_p_0_8_is_0_223144_and_its_edges():
    """0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 ln 1.5625 = 0.223144; b = 0.01, p = 0.1: 0.01 ln 0.1
    + 0.99 ln(0.99/0.9) = -0.023026 + 0.094357 = 0.071331; b = 0.99, p = 0.8: 0.99 ln(0.99/0.8) +
    0.01 ln(0.01/0.2) = 0.210962 - 0.029957 = 0.181005. b = p = 1: both terms 0 (no 0 · inf); b =
    1, p = 0.5: ln 2; b = 0, p = 0.5: ln 2; b = 0.5, p = 1: inf (the other outcome lost)."""
    b = probabilities([0.5, 0.01, 0.99, 1.0, 1.0, 0.0, 0.5])
    p = probabilities([0.8, 0.1, 0.8, 1.0, 0.5, 0.5, 1.0])
    got = bernoulli_kl(b, p).tolist()
    assert got[:6] == pytest.approx(
        [0.223144, 0.071331, 0.181005, 0.0, 0.693147, 0.693147], abs=TOL
    )
    assert got[6] == math.inf


def test_dppo_mask_judges_probabilities_where_the_ratio_clip_judges_their_ratio():
    """A rare token b = 0.01 -> p = 0.03 under Â > 0: the ratio 3 is far past eq. 3's clip (no
    gradient), the TV 0.02 is inside δ = 0.15: kept. A likely token b = 0.99 -> p = 0.8 under Â < 0:
    the ratio 0.808 is inside [0.8, 1.2] (eq. 3 keeps its gradient), the TV 0.19 > 0.15: dropped.
    Binary KL at δ = 0.05 on b = 0.01 -> p = 0.1 (TV 0.09, kept at 0.15): D = 0.071331 > 0.05,
    dropped."""
    logps, behavior = probabilities([[0.03, 0.8]]), probabilities([[0.01, 0.99]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    assert dppo_mask(adv, logps, behavior, torch.ones(1, 2), 0.15, 0.15).tolist() == [[1.0, 0.0]]
    logps, behavior = probabilities([[0.1]]), probabilities([[0.01]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    assert dppo_mask(adv, logps, behavior, torch.ones(1, 1), 0.15, 0.15).item() == 1.0
    assert dppo_mask(adv, logps, behavior, torch.ones(1, 1), 0.05, 0.05, "kl").item() == 0.0


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_at_mu_1_without_sampler_log_probs_drops_nothing(divergence):
    """At μ = 1 with π_old = π_θ as the behaviour policy, b = p on every token: |p - b| = 0 and D =
    0, never above any δ, whatever Â. Masked tokens are 0 in the mask (out of the loss anyway)."""
    torch.manual_seed(0)
    logps = -torch.rand(4, 6) * 5
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    adv = torch.tensor([2.0, -2.0, 1.0, -1.0])
    keep = dppo_mask(adv, logps, logps.detach(), mask, 0.0, 0.0, divergence)
    assert torch.equal(keep, mask)


def test_dppo_objective_is_r_times_advantage_unclipped():
    """J = r Â, dJ/dlog π = r Â: r = 1.5, Â = 1 gives (1.5, 1.5), where eq. 3 clips to 1.2 with no
    gradient; r = 0.5, Â = -1 gives (-0.5, -0.5), where eq. 3 gives (1 - ε) Â = -0.8, no gradient;
    inside the clip, r = 1.1, Â = 0.7, it is eq. 3's own (0.77, 0.77). No clip is ever reported."""
    assert one_token_objective(1.5, 1.0, surrogate=dppo_objective) == pytest.approx(
        (1.5, 1.5), abs=TOL
    )
    assert one_token_objective(0.5, -1.0, surrogate=dppo_objective) == pytest.approx(
        (-0.5, -0.5), abs=TOL
    )
    assert one_token_objective(1.1, 0.7, surrogate=dppo_objective) == pytest.approx(
        one_token_objective(1.1, 0.7), abs=TOL
    )
    assert one_token_objective(1.1, 0.7) == pytest.approx((0.77, 0.77), abs=TOL)
    _, clipped = dppo_objective(torch.full((2, 3), 9.0), torch.ones(2, 1))
    assert not clipped.any() and clipped.shape == (2, 3)


def dppo_batch(surrogate):
    """Two completions of three tokens, p = (0.8, 0.6, 0.25) each, π_old = b = 0.5 on every token
    (μ > 1, π_old the behaviour policy), Â = (+1, -1), binary TV with δ = 0.2, DAPO's aggregation
    (over 6 tokens), β = 0. Returns (the mask, loss, d loss/dlog π_θ)."""
    logps = probabilities([[0.8, 0.6, 0.25]] * 2).requires_grad_()
    old = probabilities([[0.5] * 3] * 2)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    keep = dppo_mask(adv, logps, old, mask, 0.2, 0.2)
    loss = grpo_loss(
        logps, old, None, adv, mask, beta=0.0, loss_type="dapo", surrogate=surrogate, weights=keep
    )
    loss.backward()
    return keep, loss.item(), logps.grad


def test_dppo_in_grpo_loss_keeps_r_times_advantage_on_the_kept_tokens_only():
    """r = p / 0.5 = (1.6, 1.2, 0.5). Â = +1: p - b = 0.3 > 0.2 drops token 0; Â = -1: b - p =
    0.25 > 0.2 drops token 2. Kept terms: (0, 1.2, 0.5) and (-1.6, -1.2, 0): J = (1.7 - 2.8) / 6 =
    -0.183333, loss 0.183333; d loss/dlog π = -r Â / 6 on the kept tokens: (0, -0.2, -0.083333) and
    (0.266667, 0.2, 0)."""
    keep, loss, grad = dppo_batch(dppo_objective)
    assert keep.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert loss == pytest.approx(0.183333, abs=TOL)
    expected = [[0.0, -0.2, -0.083333], [0.266667, 0.2, 0.0]]
    assert grad.tolist()[0] == pytest.approx(expected[0], abs=TOL)
    assert grad.tolist()[1] == pytest.approx(expected[1], abs=TOL)


def test_dppo_verl_form_is_the_same_mask_with_cispo_capped_at_20_same_gradient_below_20():
    """verl writes keep · sg(min(r, 20)) · Â · log π_θ: cispo_objective with ε_high = 19. Below
    r = 20 its gradient is r Â, DPPO's; its value is sg(r) Â log p instead. Row 0: 1.2 ln 0.6 +
    0.5 ln 0.25 = -0.612991 - 0.693147; row 1: -1.6 ln 0.8 - 1.2 ln 0.6 = 0.357030 + 0.612991;
    J = -0.336117 / 6, loss 0.056020. At r = 30 the cap gives 20 Â where DPPO gives 30 Â."""
    keep, loss, grad = dppo_batch(functools.partial(cispo_objective, epsilon_high=19.0))
    assert torch.allclose(grad, dppo_batch(dppo_objective)[2], atol=1e-12)
    assert loss == pytest.approx(0.056020, abs=TOL)
    verl = functools.partial(cispo_objective, epsilon_high=19.0)
    assert one_token_objective(30.0, 1.0, surrogate=verl)[1] == pytest.approx(20.0, abs=TOL)
    assert one_token_objective(30.0, 1.0, surrogate=dppo_objective)[1] == pytest.approx(
        30.0, abs=TOL
    )


def test_dppo_mask_refuses_an_unknown_divergence():
    with pytest.raises(ValueError, match="divergence"):
        dppo_mask(
            torch.ones(1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.2, 0.2, "js"
        )


# ---------------------------------------------------------------- GDPO: each reward normalized in
# its group, then summed with its weights, then normalized over the batch
def test_gdpo_correctness_and_format_give_0_and_1_224745_where_sum_first_drowns_the_format():
    """One group of 4, correctness (1, 1, 0, 0), format (0, 0.1, 0, 0.1), weights 1, eps = 0.
    Correctness: mean 0.5, Bessel std sqrt(4 · 0.25 / 3) = 0.577350, z = ±0.5 / 0.577350 =
    ±0.866025. Format: ±0.05 / 0.057735 = ±0.866025. Sum (0, 1.732051, -1.732051, 0): batch mean 0,
    std sqrt(6 / 3) = 1.414214, Â = (0, 1.224745, -1.224745, 0). Sum first, eq. 3's Â: the total
    (1, 1.1, 0, 0.1) has mean 0.55, centered (0.45, 0.55, -0.55, -0.45), std sqrt(1.01 / 3) =
    0.580230: (0.775555, 0.947900, -0.947900, -0.775555). The format's effect (completion 1 against
    0, both correct) is 0.172345 there, correctness's (1 against 3, both formatted) 1.723455, ten
    times more; in GDPO both are 1.224745."""
    per_fn = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 0.0], [0.0, 0.1]])
    got = gdpo_advantages(per_fn, [1.0, 1.0], 4, eps=0.0)
    assert got.tolist() == pytest.approx([0.0, 1.224745, -1.224745, 0.0], abs=TOL)
    assert got.dtype == torch.float32
    summed = group_advantages(per_fn.sum(1), 4, eps=0.0)
    assert summed.tolist() == pytest.approx([0.775555, 0.947900, -0.947900, -0.775555], abs=TOL)
    assert (got[1] - got[0]).item() == pytest.approx((got[1] - got[3]).item(), abs=TOL)


def test_gdpo_with_one_reward_is_group_advantages_then_batch_normalization():
    """Groups (1, 0, 1, 0) and (1, 1, 1, 0), eps = 1e-4. group_advantages: ±0.5 / (0.577350 + 1e-4)
    = ±0.865875, and (0.25, 0.25, 0.25, -0.75) / (0.5 + 1e-4) = (0.499900 × 3, -1.499700). Batch:
    mean 0 (each group sums to 0), Bessel std sqrt((4 · 0.749740 + 3 · 0.249900 + 2.249100) / 7) =
    0.925647; Â = z / (0.925647 + 1e-4): ±0.935326, 0.539996, -1.619988. Tolerance: gdpo keeps the
    z-scores in float64, the reference rounds them to float32 first (6e-8 relative): abs 1e-6."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    z = group_advantages(rewards, 4).double()
    reference = (z - z.mean()) / (z.std() + 1e-4)
    got = gdpo_advantages(rewards[:, None], [1.0], 4)
    assert got.tolist() == pytest.approx(reference.tolist(), abs=TOL)
    expected = [0.935326, -0.935326] * 2 + [0.539996] * 3 + [-1.619988]
    assert got.tolist() == pytest.approx(expected, abs=TOL)


def test_gdpo_gives_equal_groups_0_and_refuses_weights_that_do_not_match_the_columns():
    """Groups of 2. The first is equal on both functions: z = 0 on each, exactly. The second is
    equal on its second function (z = 0) and (1, 0) on its first (z = ±0.707107), so s = (0, 0,
    0.707107, -0.707107); its batch mean is 0 and the zeros stay exact."""
    per_fn = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 5.0], [0.0, 5.0]])
    got = gdpo_advantages(per_fn, [1.0, 3.0], 2)
    assert got[:2].tolist() == [0.0, 0.0] and got[2] > 0 > got[3]
    with pytest.raises(ValueError, match="one column per weight"):
        gdpo_advantages(per_fn, [1.0], 2)
    with pytest.raises(ValueError, match="one column per weight"):
        gdpo_advantages(per_fn[:, 0], [1.0], 2)
    with pytest.raises(ValueError, match="one column per weight"):
        gdpo_advantages(per_fn[:, :0], [], 2)


# ---------------------------------------------------------------- RLOO: r_i less the mean of the
# other G - 1 rewards of its group
def test_rloo_1_0_0_0_gives_1_and_minus_one_third_and_equal_rewards_0():
    """(1, 0, 0, 0): 1 - (0 + 0 + 0) / 3 = 1, and 0 - (1 + 0 + 0) / 3 = -1/3 each; (3, 1, 2, 2): 3 -
    5/3 = 4/3, 1 - 7/3 = -4/3, 2 - 2 = 0 twice; (0.1, 0.1, 0.1, 0.1): exactly 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0, 0.1, 0.1, 0.1, 0.1])
    got = rloo_advantages(rewards, 4)
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0.0, 0.0]
    assert got[:8].tolist() == pytest.approx(expected, abs=TOL)
    assert got[8:].tolist() == [0.0] * 4 and got.dtype == torch.float32


@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_rloo_is_the_group_mean_centered_reward_times_g_over_g_minus_1(group_size):
    """r_i - Σ_{j≠i} r_j / (G-1) = (G r_i - Σ_j r_j) / (G-1) = G/(G-1) (r_i - mean). Checked
    against the leave-one-out mean written out in float64, and against group_advantages(scale =
    "none") × G/(G-1). Tolerance: each side rounds once to float32 (6e-8 relative) from the same
    float64 values; rel 1e-6."""
    torch.manual_seed(group_size)
    rewards = torch.rand(4 * group_size) * 10 - 5
    r = rewards.double().view(-1, group_size)
    others = (r.sum(1, keepdim=True) - r) / (group_size - 1)  # the mean of the other G - 1
    got = rloo_advantages(rewards, group_size)
    assert torch.allclose(got.double(), (r - others).flatten(), rtol=1e-6, atol=1e-6)
    centered = group_advantages(rewards, group_size, scale="none")
    assert torch.allclose(got, centered * group_size / (group_size - 1), rtol=1e-6)


def test_rloo_refuses_a_group_of_one():
    with pytest.raises(ValueError, match="a group of one has no other reward to leave out"):
        rloo_advantages(torch.tensor([1.0, 0.0]), 1)


def test_gdpo_and_rloo_of_rewards_at_float32s_limit_are_finite():
    """Rewards (3e38, -3e38, 3e38, -3e38) on two functions, weights (2, 0.5), groups of 2, as
    tests/test_rewards.py feeds group_advantages. GDPO: in each group z = ±3e38 / (3e38 √2) =
    ±0.707107 per function; s = ±2.5 · 0.707107 = ±1.767767; batch std sqrt(4 · 3.125 / 3) =
    2.041241; Â = ±1.767767 / 2.041341 = ±0.865983. RLOO: 3e38 - (-3e38) = 6e38, beyond float32's
    3.402823e38: it saturates there, its sign kept; so does group_advantages(scale="none") of the
    float64 weighted total (±7.5e38, centered in groups of 2)."""
    big = float(torch.tensor(3.0e38))  # exactly a float32
    rewards = torch.tensor([big, -big, big, -big])
    got = gdpo_advantages(torch.stack([rewards, rewards], 1), [2.0, 0.5], 2)
    assert got.isfinite().all() and got.tolist() == pytest.approx(
        [0.865983, -0.865983] * 2, abs=TOL
    )
    largest = torch.finfo(torch.float32).max
    assert rloo_advantages(rewards, 2).tolist() == [largest, -largest] * 2
    assert rloo_advantages(rewards, 4).isfinite().all()
    total = rewards.double() * 2.5
    assert group_advantages(total, 2, scale="none").tolist() == [largest, -largest] * 2


# ---------------------------------------------------------------- the KL estimators (Schulman's
# "Approximating KL Divergence") of x = log(π_θ/π_ref): k1 = x in the reward, k2 = x²/2 or k3 =
# e^{-x} + x - 1 (eq. 4) in the loss
@pytest.mark.parametrize(
    "estimator, ratio, value, gradient",
    [
        ("k3", 0.5, 0.306853, -1.0),  # 2 - ln 2 - 1; d/dlog π_θ = 1 - π_ref/π_θ = 1 - 2
        ("k3", 1.0, 0.0, 0.0),
        ("k3", 2.0, 0.193147, 0.5),  # 0.5 + ln 2 - 1; 1 - 0.5
        ("k2", 0.5, 0.240227, -0.693147),  # (ln 2)² / 2; d/dlog π_θ = x = -ln 2
        ("k2", 1.0, 0.0, 0.0),
        ("k2", 2.0, 0.240227, 0.693147),
    ],
)
def test_kl_estimator_in_the_loss_value_and_gradient_at_ratio_0_5_1_2(
    estimator, ratio, value, gradient
):
    """Â = 0 and β = 1 leave the KL term alone: loss = k(x) and d loss/dlog π_θ = k'(x), x =
    log(π_θ/π_ref) = log ratio (π_ref = 1, π_θ = ratio)."""
    logps = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss = grpo_loss(
        logps, None, torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 1), beta=1.0, kl_estimator=estimator,
    )  # fmt: skip
    loss.backward()
    assert (loss.item(), logps.grad.item()) == pytest.approx((value, gradient), abs=TOL)


@pytest.mark.parametrize("ratio, value", [(0.5, 1.069315), (1.0, 1.0), (2.0, 0.930685)])
def test_k1_in_the_reward_at_ratio_0_5_1_2_is_r_minus_beta_x_and_as_a_loss_its_gradient_is_1(
    ratio, value
):
    """Reward 1, β = 0.1: 1 - 0.1 · (-ln 2) = 1.069315, 1, 1 - 0.1 ln 2 = 0.930685. A reward
    carries no gradient; k1 = x as a loss would have d/dlog π_θ = 1 at every x (0 in expectation:
    the next test)."""
    logps = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(1, 1, dtype=torch.float64)
    got = kl_penalty_rewards(torch.ones(1), logps, ref, torch.ones(1, 1), 0.1)
    assert got.item() == pytest.approx(value, abs=TOL) and not got.requires_grad
    (logps - ref).sum().backward()  # k1 as a loss
    assert logps.grad.item() == 1.0


def test_kl_estimators_expected_gradients_on_a_two_token_policy():
    """π_θ = softmax(θ) = (0.2, 0.8), π_ref = (0.5, 0.5): x = (ln 0.4, ln 1.6) = (-0.916291,
    0.470004), KL(π_θ || π_ref) = 0.2 x_0 + 0.8 x_1 = 0.192745; its gradient in θ is π_y (x_y - KL):
    (0.2 · -1.109036, 0.8 · 0.277259) = (-0.221807, 0.221807). Expected over y ~ π_θ of each
    estimator's gradient as a loss, Σ_y π_y ∇k(y), with ∇log π_y = e_y - π:
      k1 in the loss: Σ_y π_y (e_y - π) = 0: no KL at all;
      k2 in the loss: Σ_y π_y x_y (e_y - π) = ∇KL(π_θ || π_ref) = (-0.221807, 0.221807);
      k3 in the loss: Σ_y π_y (1 - π_ref/π_y)(e_y - π) = π - π_ref = (-0.3, 0.3), the gradient of
        the forward KL(π_ref || π_θ);
      k1 in the reward (β = 1, no baseline, μ = 1): the policy term's Â ∇log π with Â = -x_y,
        loss gradient Σ_y π_y x_y (e_y - π) = ∇KL, as k2's.
    Tolerance: float64 throughout, abs 1e-6 for the 6 quoted decimals."""
    theta = torch.log(torch.tensor([0.2, 0.8], dtype=torch.float64)).requires_grad_()
    pi = torch.softmax(theta, 0).detach()
    ref = torch.log(torch.tensor([[0.5]], dtype=torch.float64))
    one, zero = torch.ones(1, 1), torch.zeros(1, dtype=torch.float64)

    def expected_gradient(loss_of):
        total = torch.zeros(2, dtype=torch.float64)
        for y in (0, 1):  # each token as one completion of one token, weighted by π_y
            logps = torch.log_softmax(theta, 0)[y].view(1, 1)
            total += pi[y] * torch.autograd.grad(loss_of(logps), theta)[0]
        return total.tolist()

    def in_loss(estimator):
        return lambda logps: grpo_loss(logps, None, ref, zero, one, kl_estimator=estimator, beta=1)

    def in_reward(logps):
        adv = kl_penalty_rewards(torch.zeros(1), logps, ref, one, 1.0)  # -x_y
        return grpo_loss(logps, None, None, adv, one, beta=0.0)

    assert expected_gradient(lambda logps: (logps - ref).sum()) == pytest.approx([0, 0], abs=TOL)
    reverse_kl = [-0.221807, 0.221807]
    assert expected_gradient(in_loss("k2")) == pytest.approx(reverse_kl, abs=TOL)
    assert expected_gradient(in_loss("k3")) == pytest.approx([-0.3, 0.3], abs=TOL)
    assert expected_gradient(in_reward) == pytest.approx(reverse_kl, abs=TOL)


def test_kl_penalty_rewards_sum_the_log_ratio_over_the_loss_tokens_only():
    """Completion 0: tokens with π_θ/π_ref = (2, 0.5, 4), the last masked (after EOS): Σ x = ln 2 -
    ln 2 = 0, reward 1 unchanged. Completion 1: (2, 2, 2), all in: 3 ln 2 = 2.079442; reward 0,
    β = 0.5: -1.039721. float64, as rewards.score's total."""
    logps = torch.log(torch.tensor([[2.0, 0.5, 4.0], [2.0, 2.0, 2.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = kl_penalty_rewards(torch.tensor([1.0, 0.0]), logps, torch.zeros(2, 3), mask, 0.5)
    assert got.tolist() == pytest.approx([1.0, -1.039721], abs=TOL) and got.dtype == torch.float64


def test_kl_estimator_k2_keeps_the_kl_stat_k3_and_k1_or_unknown_is_refused():
    """The logged KL is Σ k3 whichever estimator the loss uses: at π_θ/π_ref = 2, 0.193147."""
    logps = torch.full((1, 1), math.log(2.0), dtype=torch.float64)
    ref, stats = torch.zeros(1, 1, dtype=torch.float64), {}
    adv = torch.zeros(1, dtype=torch.float64)
    grpo_loss(logps, None, ref, adv, torch.ones(1, 1), beta=1.0, kl_estimator="k2", stats=stats)
    assert stats["kl"] == pytest.approx(0.193147, abs=TOL)
    for estimator in ("k1", "k4"):
        with pytest.raises(ValueError, match="k1 goes in the reward: kl_penalty_rewards"):
            grpo_loss(logps, None, ref, adv, torch.ones(1, 1), kl_estimator=estimator)

"""GRPO math: hand-computed advantages, aggregation, clipped policy loss, KL, entropy, accumulation."""

from math import log, sqrt

import pytest
import torch

from vlgrpo.grpo import aggregate, entropy_from_logp, grpo_advantages, kl_penalty, policy_loss

CLIP = dict(clip_low=0.2, clip_high=0.3, clip_dual=3.0)


# --- advantages ---------------------------------------------------------------------------------


def test_advantages_per_consecutive_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    adv = grpo_advantages(scores, n=4)
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: mean 0.75, unbiased std sqrt(4 * 0.25^2 / 3) = 0.25 / sqrt(0.75)
    std2 = 0.25 / sqrt(0.75)
    expected = [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3
    expected += [-0.25 / (std2 + 1e-6)] * 2 + [0.25 / (std2 + 1e-6)] * 2
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert grpo_advantages(torch.tensor([1.0, 0.0]), n=2).tolist() == pytest.approx([sqrt(0.5), -sqrt(0.5)], rel=1e-5)


def test_group_of_equal_scores_gets_exactly_zero():
    # 0.1 (a math-reward format-only score) x 8 in float32: the plain formula leaves ~7e-3 here.
    scores = torch.tensor([0.1] * 8 + [1.0] * 8 + [1.0] + [0.0] * 7)
    adv = grpo_advantages(scores, n=8)
    assert torch.equal(adv[:16], torch.zeros(16))
    assert adv[16] > 0 and (adv[17:] < 0).all()


def test_advantages_reject_bad_input():
    with pytest.raises(AssertionError, match="n > 1"):
        grpo_advantages(torch.tensor([1.0, 0.0]), n=1)
    with pytest.raises(ValueError, match=r"\(prompts \* n,\) with n=4, got \(6,\)"):
        grpo_advantages(torch.zeros(6), n=4)


# --- aggregation --------------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_aggregate_token_and_seq_means():
    assert aggregate(VALUES, MASK, "token").item() == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert aggregate(VALUES, MASK, "seq").item() == pytest.approx(2.75)  # (1.5 + 4) / 2
    assert aggregate(VALUES, MASK, "token", denominator=7).item() == pytest.approx(1.0)
    assert aggregate(VALUES, MASK, "seq", denominator=4).item() == pytest.approx(5.5 / 4)
    empty = torch.zeros_like(MASK)
    assert aggregate(VALUES, empty, "token").item() == 0.0 and aggregate(VALUES, empty, "seq").item() == 0.0


def test_aggregate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match=r"both be \(B, T\)"):
        aggregate(VALUES, MASK[:, :2])
    with pytest.raises(ValueError, match="denominator must be positive"):
        aggregate(VALUES, MASK, denominator=0)


# --- policy loss --------------------------------------------------------------------------------
# Row 0 has A = +1, row 1 has A = -1; ratios per token (clip range [0.8, 1.3], dual clip 3):
#   row 0: 1.1 -> -1.1 (inside); 1.5 -> -1.3 (clipped high); 0.5 -> -0.5 (unclipped wins: max)
#   row 1: 0.5 -> 0.8 (clipped low, counted in clipfrac_higher); 1.2 -> 1.2; 4.0 -> min(4, 3) = 3 (dual)
RATIOS = torch.tensor([[1.1, 1.5, 0.5], [0.5, 1.2, 4.0]])
ADV = torch.tensor([1.0, -1.0])
PER_TOKEN = [[-1.1, -1.3, -0.5], [0.8, 1.2, 3.0]]


def _logps(ratios=RATIOS):
    old_logp = torch.full_like(ratios, -1.0)
    logp = (old_logp + ratios.log()).requires_grad_()
    return logp, old_logp


def test_policy_loss_clipping_on_both_sides_and_dual_clip():
    logp, old_logp = _logps()
    loss, metrics = policy_loss(logp, old_logp, ADV, torch.ones(2, 3), **CLIP)
    assert loss.item() == pytest.approx(sum(map(sum, PER_TOKEN)) / 6)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item()) and not metrics["pg_loss"].requires_grad
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx(2 / 6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert metrics["ppo_kl"].item() == pytest.approx(-RATIOS.log().sum().item() / 6)
    loss.backward()
    # d(-A * ratio)/d logp = -A * ratio where the unclipped term is used, 0 where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, 0.0, -0.5], [0.0, 1.2, 0.0]]) / 6)


def test_policy_loss_mask_and_seq_mode():
    logp, old_logp = _logps()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # row 0's last token is padding
    loss, metrics = policy_loss(logp, old_logp, ADV, mask, **CLIP, mode="token")
    assert loss.item() == pytest.approx((-1.1 - 1.3 + 0.8 + 1.2 + 3.0) / 5)
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    loss, metrics = policy_loss(logp, old_logp, ADV, mask, **CLIP, mode="seq")
    assert loss.item() == pytest.approx(((-1.1 - 1.3) / 2 + (0.8 + 1.2 + 3.0) / 3) / 2)
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_policy_loss_per_token_advantages_match_per_row():
    logp, old_logp = _logps()
    per_row, _ = policy_loss(logp, old_logp, ADV, torch.ones(2, 3), **CLIP)
    per_token, _ = policy_loss(logp, old_logp, ADV[:, None].expand(2, 3), torch.ones(2, 3), **CLIP)
    assert per_row.item() == per_token.item()


def test_policy_loss_is_computed_in_float32_for_bf16_inputs():
    logp, old_logp = _logps()
    loss, metrics = policy_loss(logp.bfloat16(), old_logp.bfloat16(), ADV.bfloat16(), torch.ones(2, 3), **CLIP)
    assert loss.dtype == torch.float32 and metrics["pg_clipfrac_higher"].dtype == torch.float32
    loss.backward()
    assert logp.grad is not None


def test_policy_loss_extreme_log_ratio_stays_finite():
    logp, old_logp = _logps(torch.tensor([[1.0, 1.0], [1.0, 1.0]]))
    with torch.no_grad():
        logp += torch.tensor([[100.0, -100.0], [100.0, -100.0]])  # exp(100) is inf in float32
    loss, _ = policy_loss(logp, old_logp, torch.tensor([1e3, -1e3]), torch.ones(2, 2), **CLIP)
    loss.backward()
    # A>0: ratio e^20 clipped to 1.3, ratio e^-20 ~ 0; A<0: ratio e^20 dual-clipped to 3, e^-20 clipped to 0.8
    assert loss.item() == pytest.approx(1e3 * (-1.3 - 0.0 + 3.0 + 0.8) / 4, rel=1e-6)
    assert torch.isfinite(logp.grad).all()


def test_policy_loss_rejects_bad_input():
    logp, old_logp = _logps()
    with pytest.raises(ValueError, match="clip_dual must be >= 1"):
        policy_loss(logp, old_logp, ADV, torch.ones(2, 3), clip_low=0.2, clip_high=0.3, clip_dual=0.5)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, old_logp, torch.ones(3), torch.ones(2, 3), **CLIP)


# --- KL and entropy -----------------------------------------------------------------------------


def test_kl_penalty_kinds_by_hand():
    logp, ref_logp = torch.tensor([[log(0.5)]]), torch.tensor([[log(0.25)]])
    # x = ref - logp = -log 2: exp(x) - x - 1 = 0.5 + log 2 - 1
    assert kl_penalty(logp, ref_logp, "low_var_kl").item() == pytest.approx(log(2) - 0.5)
    assert kl_penalty(logp, ref_logp, "kl").item() == pytest.approx(log(2))
    assert kl_penalty(ref_logp, logp, "abs").item() == pytest.approx(log(2))
    assert kl_penalty(logp, ref_logp, "mse").item() == pytest.approx(0.5 * log(2) ** 2)
    with pytest.raises(ValueError, match="unknown KL kind 'full'"):
        kl_penalty(logp, ref_logp, "full")


def test_low_var_kl_clamps_and_returns_float32():
    logp = torch.zeros(1, 4, dtype=torch.bfloat16)
    ref_logp = torch.tensor([[30.0, -30.0, 0.0, -3.0]], dtype=torch.bfloat16)
    kl = kl_penalty(logp, ref_logp, "low_var_kl")
    assert kl.dtype == torch.float32
    # x clamped to +-20: e^20 - 21 -> 10; e^-20 + 19 -> 10; 0 -> 0; e^-3 + 2
    assert kl.tolist()[0] == pytest.approx([10.0, 10.0, 0.0, 2.0 + torch.tensor(-3.0).exp().item()], rel=1e-6)


def test_entropy_is_token_mean_of_negative_logp_without_grad():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -9.0]], requires_grad=True)
    entropy = entropy_from_logp(logp, torch.tensor([[1, 1], [1, 0]]))
    assert entropy.item() == pytest.approx(2.0) and not entropy.requires_grad
    assert entropy_from_logp(logp, torch.tensor([[1, 1], [1, 0]]), mode="seq").item() == pytest.approx(2.25)


# --- gradient accumulation over micro-batches ---------------------------------------------------


def _minibatch(seed=0, rows=4, length=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([2, 7, 4, 5])[:rows]  # responses of different lengths, right-padded
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    old_logp = -torch.rand(rows, length, generator=gen) * 3
    logp = (old_logp + torch.randn(rows, length, generator=gen) * 0.3).requires_grad_()
    ref_logp = old_logp + torch.randn(rows, length, generator=gen) * 0.2
    adv = torch.randn(rows, generator=gen)
    return logp, old_logp, ref_logp, adv, mask


def _actor_loss(logp, old_logp, ref_logp, adv, mask, mode, denominator):
    """The trainer's loss: pg_loss + kl_coef * kl_loss, both aggregated with the mini-batch denominator."""
    pg, metrics = policy_loss(logp, old_logp, adv, mask, **CLIP, mode=mode, denominator=denominator)
    kl = aggregate(kl_penalty(logp, ref_logp, "low_var_kl"), mask, mode, denominator)
    return pg + 0.04 * kl, metrics


@pytest.mark.parametrize("mode", ["token", "seq"])
@pytest.mark.parametrize("split", [[1, 1, 1, 1], [1, 3], [4]])
def test_micro_batches_with_minibatch_denominator_equal_the_full_batch(mode, split):
    logp, old_logp, ref_logp, adv, mask = _minibatch()
    full_loss, full_metrics = _actor_loss(logp, old_logp, ref_logp, adv, mask, mode, None)
    full_loss.backward()
    full_grad = logp.grad.clone()
    logp.grad = None

    denominator = mask.sum().item() if mode == "token" else mask.shape[0]
    total, metric_sums, start = 0.0, dict.fromkeys(full_metrics, 0.0), 0
    for size in split:
        rows = slice(start, start + size)
        width = int(mask[rows].sum(dim=1).max())  # a micro-batch is padded only to its own longest response
        part = [t[rows, :width] for t in (logp, old_logp, ref_logp)]
        loss, metrics = _actor_loss(*part, adv[rows], mask[rows, :width], mode, denominator)
        loss.backward()
        total += loss.item()
        metric_sums = {k: metric_sums[k] + metrics[k].item() for k in metric_sums}
        start += size
    assert total == pytest.approx(full_loss.item(), rel=1e-6, abs=1e-7)
    assert metric_sums == pytest.approx({k: v.item() for k, v in full_metrics.items()}, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(logp.grad, full_grad, rtol=1e-6, atol=1e-7)


def test_averaging_micro_batch_means_differs_from_the_token_mean():
    # Why the explicit denominator: a mean of per-micro-batch token means weights short responses up.
    logp, old_logp, ref_logp, adv, mask = _minibatch()
    full, _ = _actor_loss(logp, old_logp, ref_logp, adv, mask, "token", None)
    rows = [[t[i : i + 1] for t in (logp, old_logp, ref_logp, adv, mask)] for i in range(4)]
    row_means = [_actor_loss(*row, "token", None)[0] for row in rows]
    mean_of_means = sum(row_means) / 4
    assert abs(mean_of_means.item() - full.item()) > 1e-3

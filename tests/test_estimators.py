"""EasyR1's loss types, advantage estimators, KL in the reward and its controller, and the online
filter, on hand-made tensors; expected values worked out here by hand (math, not the functions)."""

import math

import pytest
import torch

from vlgrpo import estimators, grpo

CLIP = dict(clip_low=0.2, clip_high=0.3, clip_dual=3.0)


def loss_and_grad(loss_type, logp, old_logp, advantages, mask, **kw):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = grpo.policy_loss(logp, old_logp, advantages, mask, **CLIP, loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_gspo_uses_the_sequence_ratio_and_clips_it():
    # row 0: token log-ratios ln 2 and 0 -> sequence ratio exp(ln2 / 2) = sqrt 2 on both tokens, A = 1:
    #   clipped to 1.3, loss -1.3 per token; row 1: log-ratio ln 0.5 on its one token, A = -1:
    #   unclipped 0.5 < clipped 0.8, max 0.8, dual bound 3 not reached. Token mean (-1.3 - 1.3 + 0.8) / 3.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    logp = old + torch.tensor([[math.log(2.0), 0.0], [math.log(0.5), 5.0]])
    loss, grad, metrics = loss_and_grad("gspo", logp, old, torch.tensor([1.0, -1.0]), mask)
    assert loss == pytest.approx(-0.6, abs=1e-6)
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx(1.0)  # every valid token took the clipped term
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)  # -(ln2 + 0 + ln0.5) / 3
    assert torch.count_nonzero(grad) == 0  # all clipped


def test_gspo_token_has_the_sequence_value_and_each_tokens_gradient():
    # log-ratios 0.1 and -0.1: sequence ratio exp(0) = 1 on both tokens, unclipped; per-token
    # advantages (1, 3): loss token mean of -A_t * 1 = -2 for both.
    # gspo: every token's ratio depends on both log-probs through the mean: d loss / d logp_t =
    #   sum_t' -A_t' / 2 tokens * ratio / L = -(1 + 3) / 2 / 2 = -1 for each token.
    # gspo_token: token t's ratio has logp_t's own gradient: -A_t / 2 tokens = -0.5, -1.5.
    # (With one advantage for the whole row the two coincide, as the GSPO paper says.)
    mask = torch.ones(1, 2)
    old = torch.tensor([[-1.0, -1.0]])
    logp = old + torch.tensor([[0.1, -0.1]])
    for loss_type, expected in (("gspo", [[-1.0, -1.0]]), ("gspo_token", [[-0.5, -1.5]])):
        loss, grad, _ = loss_and_grad(loss_type, logp, old, torch.tensor([[1.0, 3.0]]), mask)
        assert loss == pytest.approx(-2.0, abs=1e-6)
        assert torch.allclose(grad, torch.tensor(expected), atol=1e-6), loss_type


def test_cispo_weights_minus_a_logp_by_the_detached_clipped_ratio():
    # token 0: ratio 2 -> weight clip(2, 0.8, 1.3) = 1.3; token 1: ratio 1 -> weight 1. A = 1.
    # loss per token -A * logp * w: 1.3 and 2; mean 1.65. Gradient -A * w / 2 tokens: -0.65, -0.5.
    mask = torch.ones(1, 2)
    logp = torch.tensor([[-1.0, -2.0]])
    old = logp - torch.tensor([[math.log(2.0), 0.0]])
    loss, grad, metrics = loss_and_grad("cispo", logp, old, torch.tensor([1.0]), mask)
    assert loss == pytest.approx(1.65, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.65, -0.5]]), atol=1e-6)
    assert set(metrics) == {"pg_loss", "ppo_kl"}  # EasyR1 logs no clip fractions for cispo


def test_sapo_soft_gate_with_its_two_temperatures():
    # loss per token -A * 4 / tau * sigmoid(tau * (r - 1)); d/dlogp = -A * 4 * sigmoid' (tau (r - 1)) * r.
    # row 0: A = 1, r = 1, tau+ = 1: loss -4 * 0.5 = -2, gradient -4 * 0.25 * 1 = -1 (vanilla PG at r = 1).
    # row 1: A = -2, r = e^0.5, tau- = 1.05.
    mask = torch.ones(2, 1)
    old = torch.tensor([[-1.0], [-1.0]])
    logp = old + torch.tensor([[0.0], [0.5]])
    tau, r = 1.05, math.exp(0.5)
    sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
    row1_loss = 2.0 * 4.0 / tau * sig
    row1_grad = 2.0 * 4.0 * sig * (1.0 - sig) * r
    loss, grad, metrics = loss_and_grad("sapo", logp, old, torch.tensor([1.0, -2.0]), mask, tau_positive=1.0, tau_negative=tau)
    assert loss == pytest.approx((-2.0 + row1_loss) / 2, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1.0 / 2], [row1_grad / 2]]), rtol=1e-5)
    assert set(metrics) == {"pg_loss", "ppo_kl"}


def test_default_loss_type_is_unchanged_and_unknown_is_refused():
    torch.manual_seed(0)
    logp, old = torch.randn(3, 4), torch.randn(3, 4)
    adv, mask = torch.randn(3), torch.ones(3, 4)
    a = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.3, 3.0)
    b = grpo.policy_loss(logp, old, adv[:, None].expand(3, 4), mask, 0.2, 0.3, 3.0, loss_type="default")
    assert torch.equal(a[0], b[0])  # per-token advantages broadcast as per-row ones
    with pytest.raises(ValueError, match="loss_type"):
        grpo.policy_loss(logp, old, adv, mask, 0.2, 0.3, 3.0, loss_type="ppo")


def test_grpo_rloo_passk_on_token_level_rewards():
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    token = estimators.token_level_scores(scores, mask)
    assert torch.equal(token[:, 1], scores) and torch.count_nonzero(token[:, [0, 2]]) == 0  # score on the last token
    # grpo, n = 2: group (1, 0): mean 0.5, unbiased std sqrt(0.5): +-0.5 / (0.70711 + 1e-6); group (0.5, 0.5): 0.
    adv, ret = estimators.compute_advantages("grpo", token, mask, 2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, 0.0, 0.0]), atol=1e-6)
    assert torch.equal(adv, ret) and torch.count_nonzero(adv[:, 2]) == 0  # 0 on padding
    # rloo, n = 4 (one group): s - (sum - s) / 3 with sum 2: 1 - 1/3, 0 - 2/3, 0.5 - 0.5, 0.5 - 0.5.
    adv, _ = estimators.compute_advantages("rloo", token, mask, 4)
    assert torch.allclose(adv[:, 0], torch.tensor([2 / 3, -2 / 3, 0.0, 0.0]), atol=1e-6)
    # grpo_passk on (0.2, 1.0, 0.5, 0.0): only the best (index 1) gets (1.0 - 0.5) / (std + 1e-6);
    # mean 0.425, squared deviations sum 0.5675, unbiased std sqrt(0.5675 / 3).
    scores = torch.tensor([0.2, 1.0, 0.5, 0.0])
    adv, _ = estimators.compute_advantages("grpo_passk", estimators.token_level_scores(scores, mask), mask, 4)
    best = 0.5 / (math.sqrt(0.5675 / 3) + 1e-6)
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, best, 0.0, 0.0]), atol=1e-5)
    tie = estimators.grpo_passk_advantages(torch.tensor([1.0, 1.0, 0.0]), 3)
    assert torch.equal(tie, torch.zeros(3))  # two equal bests: no signal
    with pytest.raises(ValueError, match="rollout.n > 1"):
        estimators.rloo_advantages(torch.tensor([1.0]), 1)


def test_reinforce_plus_plus_discounts_then_whitens_over_the_batch():
    # gamma 0.5; row 0 (3 tokens) reward 1 on its last token: returns 0.25, 0.5, 1;
    # row 1 (2 tokens) reward 0.5 on its last: 0.25, 0.5, and 0 on padding.
    # valid returns (0.25, 0.5, 1, 0.25, 0.5): mean 0.5, unbiased var 0.375 / 4 = 0.09375.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = estimators.token_level_scores(torch.tensor([1.0, 0.5]), mask)
    adv, ret = estimators.compute_advantages("reinforce_plus_plus", token, mask, 2, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [0.25, 0.5, 0.0]]))
    sd = math.sqrt(0.09375 + 1e-8)
    expected = torch.tensor([[-0.25, 0.0, 0.5], [-0.25, 0.0, 0.0]]) / sd
    assert torch.allclose(adv, expected, atol=1e-5)


def test_remax_subtracts_the_greedy_baseline():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token = estimators.token_level_scores(torch.tensor([1.0, 0.0]), mask)
    adv, ret = estimators.compute_advantages("remax", token, mask, 2, baselines=torch.tensor([0.25, 0.25]))
    assert torch.allclose(adv, torch.tensor([[0.75, 0.75], [-0.25, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # reward to go
    with pytest.raises(ValueError, match="baselines"):
        estimators.compute_advantages("remax", token, mask, 2)
    with pytest.raises(ValueError, match="gae"):
        estimators.compute_advantages("gae", token, mask, 2)


def test_kl_in_the_reward():
    # kl penalty "kl": old - ref = 0.2, 0.4 on row 0, 0.1 on row 1 (its second token is padding).
    # coef 0.5: rewards row 0 (0 - 0.1, 1 - 0.2); row 1 (0 - 0.05, 0). current KL: mean of the rows'
    # token means, (0.3 + 0.1) / 2 = 0.2.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    old = ref + torch.tensor([[0.2, 0.4], [0.1, 9.0]])
    token = estimators.token_level_scores(torch.tensor([1.0, 0.0]), mask)
    rewards, current = estimators.kl_in_reward(token, old, ref, mask, 0.5, "kl")
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.8], [-0.05, 0.0]]), atol=1e-6)
    assert current == pytest.approx(0.2, abs=1e-6)
    assert rewards.sum(-1).tolist() == pytest.approx([1.0 - 0.5 * 0.6, 0.0 - 0.5 * 0.1], abs=1e-6)


def test_adaptive_kl_controller_follows_easyr1():
    # EasyR1: coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon; target 0.1, horizon 100,
    # 8 responses a step. KL 0.2 -> error +0.2 (clipped from 1): x 1.016; 0.05 -> -0.2 (from -0.5): x 0.984;
    # 0.1 -> 0: x 1; 0.15 -> +0.2 (from 0.5): x 1.016; 0.11 -> +0.1: x 1.008.
    coef, seen = 0.1, []
    for kl in (0.2, 0.05, 0.1, 0.15, 0.11):
        coef = estimators.adaptive_kl_coef(coef, kl, 8, 0.1, 100.0)
        seen.append(coef)
    expected = [0.1 * 1.016, 0.1 * 1.016 * 0.984, 0.1 * 1.016 * 0.984, 0.1 * 1.016 * 0.984 * 1.016,
                0.1 * 1.016 * 0.984 * 1.016 * 1.008]
    assert seen == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="kl_horizon"):
        estimators.adaptive_kl_coef(0.1, 0.2, 8, 0.1, 0.0)


def test_online_filter_keeps_groups_strictly_inside():
    # n = 2 groups with means 0, 0.5, 1, 0.01, 0.99: only 0.5 is strictly inside (0.01, 0.99).
    values = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.02, 0.0, 0.98, 1.0])
    assert estimators.kept_groups(values, 2, 0.01, 0.99).tolist() == [False, True, False, False, False]

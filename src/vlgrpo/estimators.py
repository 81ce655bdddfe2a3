"""Advantage estimators, KL in the reward with its controllers, and DAPO's group filter, as pure
functions with EasyR1's meanings (verl/trainer/core_algos.py, ray_trainer.py).

Shapes: B rows (responses; prompts x n, each prompt's n samples consecutive), T response tokens;
`mask` (B, T) is 1 on response tokens. A response's outcome score sits on its last token
(token_level_scores), as EasyR1's reward manager puts it; KL in the reward subtracts a per-token
penalty; every estimator reads these token-level rewards and returns (advantages, returns), both
(B, T) and 0 on padding. The losses that use the advantages are in vlgrpo.grpo.
"""

from __future__ import annotations

import torch

from vlgrpo.grpo import KLKind, grpo_advantages, kl_penalty

ESTIMATORS = ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "remax")


def _groups(scores: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """(B,) -> (B / n, n), checking the shape and that a group has at least two samples."""
    if n < 2:
        raise ValueError(f"{name} needs rollout.n > 1 samples per prompt, got n={n}")
    if scores.dim() != 1 or scores.numel() % n:
        raise ValueError(f"scores must have shape (prompts * n,) with n={n}, got {tuple(scores.shape)}")
    return scores.reshape(-1, n)


def token_level_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores (B,) on the last response token of each row: (B, T), zeros elsewhere (an empty
    response, all mask 0, keeps its score on token 0 so that no score is lost)."""
    last = (mask.sum(-1).long() - 1).clamp(min=0)  # (B,)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    return out.scatter(1, last[:, None].cpu(), scores.float()[:, None].cpu()).to(mask.device)


def kl_in_reward(
    token_scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
    kl_coef: float, kind: KLKind,
) -> tuple[torch.Tensor, float]:
    """EasyR1's apply_kl_penalty: token-level rewards = token_scores - kl_coef * KL per token.

    token_scores, old_logp, ref_logp, mask: (B, T); the KL is of the rollout policy (old_logp) from
    the reference, `kind` as in grpo.kl_penalty, 0 on padding. Returns (rewards (B, T), current_kl):
    current_kl is the mean over rows of each row's token-mean KL, what EasyR1 logs as
    actor/kl_penalty and feeds its KL controller.
    """
    mask = mask.float()
    kld = kl_penalty(old_logp, ref_logp, kind) * mask  # (B, T)
    current_kl = (kld.sum(-1) / (mask.sum(-1) + 1e-8)).mean().item()
    return token_scores.float() - kl_coef * kld, current_kl


def adaptive_kl_coef(kl_coef: float, current_kl: float, n_steps: int, target: float, horizon: float) -> float:
    """EasyR1's AdaptiveKLController.update (Ziegler et al. 2019): the next step's coefficient.

    kl_coef * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon), where n_steps is
    the step's number of responses (EasyR1 passes the batch size). A fixed controller keeps kl_coef.
    """
    if horizon <= 0:
        raise ValueError(f"algorithm.kl_horizon must be > 0 for the adaptive KL controller, got {horizon}")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def grpo_passk_advantages(scores: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k advantages (arXiv 2503.19595), as EasyR1: (B,) -> (B,).

    In each group only the best response (the first of equal bests) gets a non-zero advantage:
    (best - second best) / (unbiased group std + eps); a group whose two best are equal gets 0.
    """
    groups = _groups(scores.float(), n, "grpo_passk")  # (G, n)
    top, index = torch.topk(groups, k=2, dim=1)  # (G, 2)
    value = (top[:, 0] - top[:, 1]) / (groups.std(dim=1) + eps)  # (G,)
    return torch.zeros_like(groups).scatter(1, index[:, :1], value[:, None]).reshape(-1)


def rloo_advantages(scores: torch.Tensor, n: int) -> torch.Tensor:
    """REINFORCE leave-one-out (arXiv 2402.14740): score - mean of the group's other scores, (B,) -> (B,)."""
    groups = _groups(scores.float(), n, "rloo")  # (G, n)
    return (groups - (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)).reshape(-1)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go: G_t = r_t + gamma * G_{t+1}, restarting after the last response token; (B, T) -> (B, T)."""
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32, device=token_rewards.device)
    mask = mask.float()
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t].float() + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - masked mean) / sqrt(unbiased masked variance + eps) over all valid tokens: (B, T) -> (B, T)."""
    mask = mask.float()
    count = mask.sum()
    mean = (values * mask).sum() / (count + 1e-8)
    var = ((values - mean).square() * mask).sum() / (count + 1e-8)
    if count > 1:
        var = var * count / (count - 1)  # Bessel's correction, as EasyR1's masked_var
    return (values - mean) * torch.rsqrt(var + eps)


def compute_advantages(
    estimator: str, token_rewards: torch.Tensor, mask: torch.Tensor, n: int, gamma: float = 1.0,
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's algorithm.adv_estimator on token-level rewards (B, T): (advantages, returns), (B, T) each.

    grpo: (R - group mean) / (group std + 1e-6), R = a row's summed rewards (0 for an all-equal group).
    grpo_passk: grpo_passk_advantages of R.  rloo: rloo_advantages of R.  For these three returns =
    advantages. reinforce_plus_plus: returns = discounted_returns(gamma); advantages = those whitened
    over the batch's valid tokens. remax: advantages = R - baselines (B,), the reward of the prompt's
    greedy response; returns = reward-to-go (gamma 1).
    """
    mask = mask.float()
    scores = (token_rewards.float() * mask).sum(-1)  # (B,)
    if estimator in ("grpo", "grpo_passk", "rloo"):
        per_row = {"grpo": grpo_advantages, "grpo_passk": grpo_passk_advantages, "rloo": rloo_advantages}[estimator](scores, n)
        advantages = per_row[:, None] * mask
        return advantages, advantages
    if estimator == "reinforce_plus_plus":
        returns = discounted_returns(token_rewards, mask, gamma)
        return masked_whiten(returns, mask) * mask, returns
    if estimator == "remax":
        if baselines is None or baselines.shape != scores.shape:
            raise ValueError(f"remax needs baselines of shape {tuple(scores.shape)} (the greedy responses' rewards)")
        returns = (token_rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)
        return (scores - baselines.float())[:, None] * mask, returns
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")


def kept_groups(values: torch.Tensor, n: int, low: float, high: float) -> torch.Tensor:
    """DAPO's online filter, as EasyR1: a group is kept when the mean of its n values (the reward's
    filter_key) lies strictly between low and high. values (B,) -> (B / n,) bool."""
    means = values.double().reshape(-1, n).mean(dim=1)
    return (means > low) & (means < high)

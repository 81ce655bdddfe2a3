"""GRPO math as pure tensor functions: advantages, loss aggregation, policy losses, KL, entropy.

Faithful to EasyR1 (verl/trainer/core_algos.py): its loss types (default, gspo, gspo_token, cispo,
sapo) and KL estimators; the other advantage estimators, KL in the reward and its controller, and
online filtering live beside it in vlgrpo.estimators. Shapes: B rows
(responses; prompts x n, each prompt's n samples consecutive), T response tokens; `mask` (B, T) is 1
on response tokens and 0 on padding. Losses take an explicit `denominator` so that summing the
losses of micro-batches gives exactly the mean over the whole mini-batch (gradient accumulation).
"""

from __future__ import annotations

from typing import Literal

import torch

AggregateMode = Literal["token", "seq"]
KLKind = Literal["low_var_kl", "kl", "abs", "mse"]
LossType = Literal["default", "gspo", "gspo_token", "cispo", "sapo"]
LOSS_TYPES = ("default", "gspo", "gspo_token", "cispo", "sapo")
# EasyR1 logs the clip fractions only for the losses that clip the ratio inside a max/min.
CLIPPING_LOSSES = ("default", "gspo", "gspo_token")

# exp() of a log-ratio beyond this overflows to inf and gives NaN gradients (pytorch issue 10729).
_LOG_RATIO_LIMIT = 20.0


def grpo_advantages(scores: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised outcome advantages.

    scores: (B,) one scalar reward per response, B = prompts * n, a prompt's samples consecutive.
    Returns (B,): (score - group mean) / (unbiased group std + eps). A group whose scores are all
    equal carries no signal and gets exactly 0 (float rounding of its mean could leave ~1e-2 after
    dividing by eps).
    """
    assert n > 1, f"GRPO needs n > 1 samples per prompt, got n={n}"
    if scores.dim() != 1 or scores.numel() % n:
        raise ValueError(f"scores must have shape (prompts * n,) with n={n}, got {tuple(scores.shape)}")
    groups = scores.reshape(-1, n)
    advantages = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    all_equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return advantages.masked_fill(all_equal, 0.0).reshape(-1)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregateMode = "token",
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token values (B, T) under mask (B, T) to a scalar.

    token: sum(values * mask) / denominator, default the number of unmasked tokens.
    seq:   sum over rows of the row's token mean / denominator, default the number of rows.
    With denominator = the mini-batch's token count (token) or row count (seq), the sum over
    micro-batches equals the mean over the mini-batch. An all-masked input gives 0, not NaN.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values and mask must both be (B, T), got {tuple(values.shape)} and {tuple(mask.shape)}")
    if isinstance(denominator, (int, float)) and denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    mask = mask.to(values.dtype)
    if mode == "token":
        total = (values * mask).sum()
        default = mask.sum().clamp(min=1.0)
    elif mode == "seq":
        total = ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
        default = values.shape[0]
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected 'token' or 'seq'")
    return total / (default if denominator is None else denominator)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_dual: float,
    mode: AggregateMode = "token",
    denominator: float | torch.Tensor | None = None,
    loss_type: LossType = "default",
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EasyR1's policy losses (worker.actor.loss_type), per token, aggregated by `aggregate`.

    logp, old_logp: (B, T) log-probs of the sampled tokens under the current / rollout policy.
    advantages: (B,) per response or (B, T) per token. mask: (B, T).
    The log importance ratio s is per token, logp - old_logp (default, cispo, sapo), or per sequence
    (gspo: the row's masked mean of logp - old_logp, on every token; gspo_token: that mean detached
    plus logp - logp.detach(), the same value with each token's own gradient). ratio = exp(clamp(s,
    -20, 20)), clipped = clip(ratio, 1 - clip_low, 1 + clip_high). Per token loss:
      default, gspo, gspo_token: PPO clip with decoupled range (DAPO) and dual clip:
          A >= 0: max(-A * ratio, -A * clipped);  A < 0: min(that, -A * clip_dual)
      cispo: -A * logp * clipped.detach()   (the clipped weight carries no gradient)
      sapo:  -A * 4 / tau * sigmoid(tau * (ratio - 1)), tau = tau_positive where A >= 0, else tau_negative
    Returns (loss, metrics), all scalars aggregated by `aggregate(mode, denominator)` so they add up
    over micro-batches like the loss: pg_loss (= loss, detached), ppo_kl (mean of old_logp - logp),
    and for the clipping losses pg_clipfrac_higher (fraction of tokens where the clipped term is
    chosen) and pg_clipfrac_lower (fraction where dual clip bounds a negative-advantage token).
    (EasyR1 reports token means for the metrics even in seq mode; here they follow the loss so
    micro-batch sums stay exact.) Computed in float32 whatever the dtype of the inputs.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(LOSS_TYPES)}")
    if clip_dual < 1.0:
        raise ValueError(f"clip_dual must be >= 1 (it bounds the loss at clip_dual * |A|), got {clip_dual}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape[0] != logp.shape[0] or advantages.dim() != 2:
        raise ValueError(
            f"advantages must be (B,) or (B, T) for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    # bf16 ratios near 1 are too coarse to tell 1.3 from 1.296 at the clip boundary.
    logp, old_logp, advantages = logp.float(), old_logp.float(), advantages.float()
    log_ratio = logp - old_logp  # (B, T)
    if loss_type in ("gspo", "gspo_token"):
        fmask = mask.to(log_ratio.dtype)
        seq = (log_ratio * fmask).sum(-1, keepdim=True) / fmask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        log_importance = seq.detach() + logp - logp.detach() if loss_type == "gspo_token" else seq * fmask
    else:
        log_importance = log_ratio
    ratio = torch.exp(log_importance.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipping = loss_type in CLIPPING_LOSSES
    if loss_type == "cispo":
        per_token = -advantages * logp * clipped_ratio.detach()
    elif loss_type == "sapo":
        tau = torch.where(advantages >= 0, tau_positive, tau_negative)  # (B, 1) or (B, T)
        per_token = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * clipped_ratio
        dual = -advantages * clip_dual
        loss_ppo = torch.maximum(unclipped, clipped)
        per_token = torch.where(advantages < 0, torch.minimum(loss_ppo, dual), loss_ppo)

    loss = aggregate(per_token, mask, mode, denominator)
    with torch.no_grad():
        metrics = {"pg_loss": loss.detach()}
        if clipping:
            clipfrac_higher = (unclipped < clipped).to(logp.dtype)
            clipfrac_lower = ((loss_ppo > dual) & (advantages < 0)).to(logp.dtype)
            metrics["pg_clipfrac_higher"] = aggregate(clipfrac_higher, mask, mode, denominator)
            metrics["pg_clipfrac_lower"] = aggregate(clipfrac_lower, mask, mode, denominator)
        metrics["ppo_kl"] = aggregate(-log_ratio, mask, mode, denominator)
    return loss, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference, (B, T) -> (B, T), in float32.

    low_var_kl (Schulman's k3): x = clamp(ref_logp - logp, -20, 20); exp(x) - x - 1, clamped to
    [-10, 10]. kl: logp - ref_logp. abs: |logp - ref_logp|. mse: 0.5 (logp - ref_logp)^2.
    (EasyR1's `full`, the KL of the whole vocabulary distributions, needs them at every token; only
    the sampled token's log-prob is kept, so config validation refuses it.)
    Aggregate with `aggregate` to get the KL loss; mask and subtract it from the reward for KL in the reward.
    """
    logp, ref_logp = logp.float(), ref_logp.float()
    if kind == "low_var_kl":
        x = (ref_logp - logp).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    raise ValueError(f"unknown KL kind {kind!r}; expected one of low_var_kl, kl, abs, mse")


def entropy_from_logp(
    logp: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregateMode = "token",
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy metric (EasyR1 actor/entropy_loss): aggregate of -logp of the sampled tokens, no grad.

    logp, mask: (B, T). -logp of a sampled token is an unbiased one-sample estimate of the entropy
    of the distribution it was sampled from (at the rollout policy). Returns a detached scalar.
    """
    with torch.no_grad():
        return aggregate(-logp, mask, mode, denominator)

"""GRPO math as pure tensor functions: advantages, loss aggregation, policy loss, KL, entropy.

Faithful to EasyR1 (verl/trainer/core_algos.py) for the geometry3k recipe. Shapes: B rows
(responses; prompts x n, each prompt's n samples consecutive), T response tokens; `mask` (B, T) is 1
on response tokens and 0 on padding. Losses take an explicit `denominator` so that summing the
losses of micro-batches gives exactly the mean over the whole mini-batch (gradient accumulation).
"""

from __future__ import annotations

from typing import Literal

import torch

AggregateMode = Literal["token", "seq"]
KLKind = Literal["low_var_kl", "kl", "abs", "mse"]

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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with decoupled clip range (DAPO) and dual clip, as EasyR1.

    logp, old_logp: (B, T) log-probs of the sampled tokens under the current / rollout policy.
    advantages: (B,) per response or (B, T) per token. mask: (B, T).
    ratio = exp(clamp(logp - old_logp, -20, 20)); per token loss
      A >= 0: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
      A <  0: min(that, -A * clip_dual)   (dual clip bounds the loss of a huge ratio)
    Returns (loss, metrics), all scalars aggregated by `aggregate(mode, denominator)` so they add up
    over micro-batches like the loss: pg_loss (= loss, detached), pg_clipfrac_higher (fraction of
    tokens where the clipped term is chosen), pg_clipfrac_lower (fraction where dual clip bounds a
    negative-advantage token), ppo_kl (mean of old_logp - logp). (EasyR1 reports token means for
    the metrics even in seq mode; here they follow the loss so micro-batch sums stay exact.)
    Computed in float32 whatever the dtype of the inputs.
    """
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
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    dual = -advantages * clip_dual
    loss_ppo = torch.maximum(unclipped, clipped)
    per_token = torch.where(advantages < 0, torch.minimum(loss_ppo, dual), loss_ppo)

    loss = aggregate(per_token, mask, mode, denominator)
    with torch.no_grad():
        clipfrac_higher = (unclipped < clipped).to(logp.dtype)
        clipfrac_lower = ((loss_ppo > dual) & (advantages < 0)).to(logp.dtype)
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac_higher": aggregate(clipfrac_higher, mask, mode, denominator),
            "pg_clipfrac_lower": aggregate(clipfrac_lower, mask, mode, denominator),
            "ppo_kl": aggregate(-log_ratio, mask, mode, denominator),
        }
    return loss, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference, (B, T) -> (B, T), in float32.

    low_var_kl (Schulman's k3): x = clamp(ref_logp - logp, -20, 20); exp(x) - x - 1, clamped to
    [-10, 10]. kl: logp - ref_logp. abs: |logp - ref_logp|. mse: 0.5 (logp - ref_logp)^2.
    Aggregate with `aggregate` to get the KL loss.
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

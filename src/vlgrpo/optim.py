"""The actor's optimizer and learning-rate schedule: the one place both are made.

worker.actor.optim.strategy, with EasyR1's names and semantics:
  adamw       AdamW with fp32 moments and fp32 master weights. The model keeps its dtype (bf16
              weights compute in bf16); after each step its weights are the master weights rounded.
              For a float32 model this is torch's AdamW (fused on CUDA). Per parameter: 12 bytes of
              state (master, exp_avg, exp_avg_sq) beside bf16 weights; EasyR1 gets the same from
              fp32 FSDP parameters with bf16 compute.
  adamw_bf16  EasyR1's AnyPrecisionAdamW (torchdistx, llama-cookbook) with Kahan summation: bf16
              exp_avg, exp_avg_sq and compensation buffer, 6 bytes of state per parameter. The
              compensation holds what rounding the weights to bf16 left out of past updates, so an
              update far below half a bf16 ulp (lr 1e-6 on weights of size 0.02) still accumulates.
              One difference from EasyR1: the decoupled weight decay (w -= lr * wd * w) goes through the
              compensated sum too; EasyR1 multiplies the bf16 weights by (1 - lr * wd), which rounds to
              no change at lr 1e-6.
Both strategies compute the bias corrections 1 - beta1^t and sqrt(1 - beta2^t), and the step size
lr / (1 - beta1^t), in float64 (Python floats from the step count); AnyPrecisionAdamW computes them
from its float32 step tensor, in float32. A difference of rounding only (relative 1e-7 at most), but
not bit for bit.
Both step with torch._foreach_* kernels, per (device, dtype) and in chunks of at most CHUNK_NUMEL
elements, so temporaries stay small. Every piece of state is a per-parameter tensor in
optimizer.state[p], so optimizer.state_dict() (torch.save or torch.distributed.checkpoint) carries it,
and load_state_dict restores each tensor in the dtype it was saved in.

The schedule is EasyR1's (verl/utils/torch_functional.py), lr_scheduler_type:
  constant  training step k (1-based) updates with lr * min(1, (k - 1) / W) while k - 1 < W, else lr;
  cosine    the same warm-up, then lr * max(m, m + (1 - m) * (1 + cos(pi * p)) / 2) with
            p = (k - 1 - W) / max(1, T - W) and m = min_lr_ratio (null: 0).
W = lr_warmup_steps, or int(lr_warmup_ratio * T); T = the run's total steps (plan.total_steps:
trainer.max_steps where set, as EasyR1 counts them). EasyR1 steps its scheduler once per training
step, after the update, so the first update's factor counts from 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

CHUNK_NUMEL = 2**28  # elements per foreach launch group: bounds the step's temporaries (1 GiB in fp32)

STRATEGIES = ("adamw", "adamw_bf16")


def _local(tensor):
    """The local shard of a DTensor (FSDP2's parameters, gradients and state), in place; else the tensor.
    The update is elementwise, so each rank steps its shard and no DTensor op (some have no sharding
    rule: _foreach_copy_) runs."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _chunks(params: list[torch.Tensor], max_numel: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `params` holding at most max_numel elements (a bigger tensor runs alone)."""
    chunk, numel = [], 0
    for p in params:
        if chunk and numel + p.numel() > max_numel:
            yield chunk
            chunk, numel = [], 0
        chunk.append(p)
        numel += p.numel()
    if chunk:
        yield chunk


class _ForeachAdamW(torch.optim.Optimizer):
    """AdamW's moment update and bias-corrected denominator, shared by both strategies; a subclass
    says what state a parameter has (_init_state) and how the update reaches the weights (_apply)."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _init_state(self, p: torch.Tensor) -> dict:
        raise NotImplementedError

    def _apply(self, params: list[torch.Tensor], states: list[dict], exp_avgs, denoms, step_sizes: list[float], decay: float) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then each state tensor as saved: torch casts state to the
        parameter's dtype, which would round fp32 master weights on bf16 parameters to bf16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step" and torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets = defaultdict(list)  # (device, dtype) -> parameters: one foreach launch each
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if not self.state[p]:
                    self.state[p] = self._init_state(p)
                buckets[(p.device, p.dtype)].append(p)
            for bucket in buckets.values():
                for chunk in _chunks(bucket, CHUNK_NUMEL):
                    self._update(group, chunk)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        for p in params:
            self.state[p]["step"] += 1  # a float32 CPU scalar, as torch's AdamW keeps it
        steps = [self.state[p]["step"].item() for p in params]
        states = [{k: _local(v) for k, v in self.state[p].items()} for p in params]
        grads, params = [_local(p.grad) for p in params], [_local(p) for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        grads = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, exp_avgs)]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m = b1 m + (1 - b1) g, one rounding
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)  # v = b2 v + (1 - b2) g^2
        del grads
        denoms = torch._foreach_sqrt(exp_avg_sqs)  # sqrt(v / (1 - b2^t)) + eps
        torch._foreach_div_(denoms, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denoms, group["eps"])
        step_sizes = [-group["lr"] / (1 - beta1**t) for t in steps]
        self._apply(params, states, exp_avgs, denoms, step_sizes, group["lr"] * group["weight_decay"])


class KahanAdamW(_ForeachAdamW):
    """adamw_bf16: AdamW with bf16 moments whose updates reach the weights through a bf16 Kahan
    compensation buffer (EasyR1's AnyPrecisionAdamW, use_kahan_summation=True)."""

    def _init_state(self, p: torch.Tensor) -> dict:
        zeros = lambda: torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)  # noqa: E731
        return {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros(), "compensation": zeros()}

    def _apply(self, params, states, exp_avgs, denoms, step_sizes, decay) -> None:
        compensation = [s["compensation"] for s in states]
        if decay:
            torch._foreach_add_(compensation, params, alpha=-decay)  # w -= lr * wd * w, compensated
        torch._foreach_addcdiv_(compensation, exp_avgs, denoms, step_sizes)  # the update, and what is owed
        del denoms
        old = torch._foreach_mul(params, 1.0)  # a copy, in one launch
        torch._foreach_add_(params, compensation)  # w + c, rounded to the weights' dtype
        torch._foreach_sub_(old, params)
        torch._foreach_add_(compensation, old)  # c -= (new w - old w): what the rounding left out


class MasterAdamW(_ForeachAdamW):
    """adamw on weights below float32: fp32 master weights and moments; the weights are the master
    weights rounded after each step (EasyR1's fp32 FSDP parameters with bf16 compute)."""

    def _init_state(self, p: torch.Tensor) -> dict:
        zeros = lambda: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)  # noqa: E731
        return {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros(), "master": p.detach().to(torch.float32, copy=True)}

    def _apply(self, params, states, exp_avgs, denoms, step_sizes, decay) -> None:
        masters = [s["master"] for s in states]
        if decay:
            torch._foreach_mul_(masters, 1 - decay)
        torch._foreach_addcdiv_(masters, exp_avgs, denoms, step_sizes)
        torch._foreach_copy_(params, masters)  # round to nearest


def build_optimizer(cfg: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer worker.actor.optim configures, over the model's trainable parameters."""
    optim = cfg["worker"]["actor"]["optim"]
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = {"lr": optim["lr"], "betas": tuple(optim["betas"]), "eps": optim["eps"], "weight_decay": optim["weight_decay"]}
    strategy = optim["strategy"]
    if strategy == "adamw_bf16":
        return KahanAdamW(params, **hyper)
    if strategy != "adamw":
        raise ValueError(f"unknown optimizer strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    if all(p.dtype == torch.float32 for p in params):
        cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW(params, **hyper, fused=cuda or None)  # one kernel for all parameters on CUDA
    return MasterAdamW(params, **hyper)


def warmup_steps(cfg: dict, total_steps: int) -> int:
    """Warm-up length in training steps: lr_warmup_steps, else int(lr_warmup_ratio * total_steps)."""
    optim = cfg["worker"]["actor"]["optim"]
    if optim["lr_warmup_steps"] is not None:
        return optim["lr_warmup_steps"]
    return int(optim["lr_warmup_ratio"] * total_steps)


def lr_at(cfg: dict, step: int, total_steps: int) -> float:
    """The learning rate of training step `step` (1-based): EasyR1's factor min(1, (step - 1) / W)
    during the warm-up of W steps, then 1 (constant) or the half-cosine down to min_lr_ratio (cosine)."""
    optim = cfg["worker"]["actor"]["optim"]
    warmup = warmup_steps(cfg, total_steps)
    done = step - 1  # scheduler steps taken before this update
    if done < warmup:
        factor = min(1.0, done / max(1, warmup))
    elif optim["lr_scheduler_type"] == "cosine":
        floor = optim["min_lr_ratio"] or 0.0
        progress = (done - warmup) / max(1, total_steps - warmup)
        factor = max(floor, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    else:
        factor = 1.0
    return optim["lr"] * factor

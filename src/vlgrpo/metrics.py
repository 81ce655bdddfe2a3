"""Step metrics with EasyR1's names and meanings (verl/trainer/metrics.py, utils/seqlen_balancing.py,
utils/flops_counter.py, workers/fsdp_workers.py), as pure functions of the step's tensors and timings.

N = rollout.batch_size x rollout.n sequences in a step, R = the longest response.
Where vlgrpo's meaning differs from EasyR1's, docs/metrics.md says so.
"""

from __future__ import annotations

import os
import resource
import sys

import psutil
import torch

# Dense bf16 peak of one device, TFLOP/s (datasheets; EasyR1's table plus the H200). Matched as a
# substring of the device name, longest first, so an "H200" is not taken for an "H20".
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40": 181.05,
               "L20": 119.5, "H20": 148.0, "910B": 354.0}
GIB = 2**30


def world_size() -> int:
    """Processes (one device each) that share the step's work: 1 for a single-process run, CPU or CUDA."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def stats(prefix: str, values: torch.Tensor) -> dict:
    """{prefix}/mean, /max, /min of a 1-D tensor of any length >= 1."""
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def length_metrics(prefix: str, lengths: torch.Tensor, limit: int) -> dict:
    """stats of (N,) token counts plus {prefix}/clip_ratio: the fraction that reached `limit`."""
    return {**stats(prefix, lengths), f"{prefix}/clip_ratio": (lengths == limit).float().mean().item()}


def data_metrics(scores: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                 returns: torch.Tensor | None = None) -> dict:
    """critic/score, critic/rewards, critic/advantages, critic/returns: mean/max/min.

    scores, rewards: (N,) sequence score (the reward function's overall) and sequence reward (the
    sum of its token-level rewards: score minus the in-reward KL penalty, == score with a KL loss).
    advantages, returns: (N, R) per token, or (N,) per sequence broadcast over its tokens; returns
    default to the advantages (GRPO's, RLOO's and pass@k's are the same tensor in EasyR1).
    response_mask: (N, R). Advantages and returns are over valid tokens.
    """
    mask = response_mask.bool()

    def valid(values: torch.Tensor) -> torch.Tensor:
        values = values.float()
        return (values[:, None].expand_as(mask) if values.dim() == 1 else values)[mask]

    return {
        **stats("critic/score", scores),
        **stats("critic/rewards", rewards),
        **stats("critic/advantages", valid(advantages)),
        **stats("critic/returns", valid(advantages if returns is None else returns)),
    }


def seqlen_metrics(seqlens: list[int], partitions: list[list[int]] | None = None, world: int = 1) -> dict:
    """global_seqlen/*: tokens (prompt + response) per data-parallel rank, before and after balancing.

    seqlens: N sequence lengths in batch order. min/max/minmax_diff: over `world` contiguous chunks
    of the batch order (what each rank gets without balancing); balanced_min/max: over `partitions`
    (lists of batch indices, one per rank: the split the step actually used; default the contiguous
    chunks, so without balancing they equal min/max); mean: total tokens / ranks.
    """
    chunk = len(seqlens) // world
    contiguous = [list(range(r * chunk, (r + 1) * chunk)) for r in range(world)]
    sums = [sum(seqlens[i] for i in part) for part in contiguous]
    balanced = [sum(seqlens[i] for i in part) for part in (partitions or contiguous)]
    return {
        "global_seqlen/min": min(sums),
        "global_seqlen/max": max(sums),
        "global_seqlen/minmax_diff": max(sums) - min(sums),
        "global_seqlen/balanced_min": min(balanced),
        "global_seqlen/balanced_max": max(balanced),
        "global_seqlen/mean": sum(seqlens) / world,
    }


def timing_metrics(timing: dict[str, float], response_tokens: int, total_tokens: int) -> dict:
    """timing_s/<phase> as measured, and timing_per_token_ms/<phase>: gen and reward per response
    token, the phases that run over whole sequences (old, ref, adv, update_actor) per prompt +
    response token, as EasyR1's compute_timing_metrics."""
    per_token = {**dict.fromkeys(("gen", "reward"), response_tokens),
                 **dict.fromkeys(("old", "ref", "adv", "update_actor"), total_tokens)}
    return {
        **{f"timing_s/{name}": seconds for name, seconds in timing.items()},
        **{f"timing_per_token_ms/{name}": timing[name] * 1000 / per_token[name] for name in per_token if name in timing},
    }


def throughput_metrics(total_tokens: int, step_s: float, world: int) -> dict:
    """perf/total_num_tokens (prompt + response, all ranks), perf/time_per_step, and perf/throughput:
    tokens per second per device the step actually ran on (`world`)."""
    return {"perf/total_num_tokens": total_tokens, "perf/time_per_step": step_s,
            "perf/throughput": total_tokens / (step_s * world)}


def actor_flops(text_config, seqlens: list[int]) -> float:
    """FLOPs of one forward and backward of the language model over sequences of `seqlens` tokens:
    6 x dense parameters x tokens + 12 x sum(seqlen^2) x head_dim x heads x layers (EasyR1's
    FlopsCounter for llama-like models; the vision tower is not counted)."""
    c = text_config
    head_dim = c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * c.intermediate_size * 3 + c.hidden_size * (q + 2 * kv + q)
    dense = per_layer * c.num_hidden_layers + c.vocab_size * c.hidden_size * 2
    attention = 12 * sum(s * s for s in seqlens) * head_dim * c.num_attention_heads * c.num_hidden_layers
    return 6 * dense * sum(seqlens) + attention


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from PEAK_TFLOPS, or None (a CPU or an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((PEAK_TFLOPS[k] for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in name), None)


def mfu(flops: float, seconds: float, ppo_epochs: int, peak: float | None, world: int) -> float:
    """perf/mfu_actor: the update's model FLOPs (one epoch's `flops` x ppo_epochs) per second over
    the devices' peak; 0.0 when the peak is unknown (as EasyR1 logs for unlisted devices)."""
    if not peak or seconds <= 0:
        return 0.0
    return flops * ppo_epochs / seconds / (peak * 1e12 * world)


def memory_metrics(device: torch.device) -> dict:
    """perf/max_memory_allocated_gb and perf/max_memory_reserved_gb: the CUDA allocator's peaks since
    the last torch.cuda.reset_peak_memory_stats (the trainer resets them each step); on a CPU both
    are the process's peak resident memory since it started (what it allocated from the host).
    perf/cpu_memory_used_gb: the host's used memory (psutil, as EasyR1; other processes included);
    perf/cpu_memory_rss_gb: this process's resident memory now."""
    rss = psutil.Process(os.getpid()).memory_info().rss
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        allocated = reserved = max(rss, peak if sys.platform == "darwin" else peak * 1024)
    return {
        "perf/max_memory_allocated_gb": allocated / GIB,
        "perf/max_memory_reserved_gb": reserved / GIB,
        "perf/cpu_memory_used_gb": psutil.virtual_memory().used / GIB,
        "perf/cpu_memory_rss_gb": rss / GIB,
    }

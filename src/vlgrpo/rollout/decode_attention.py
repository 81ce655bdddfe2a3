"""The static decode step's attention as one Triton kernel: each row's query heads over that row's
own keys in the static cache, reading nothing else.

The cache holds every row right-aligned at the prompt width, so SDPA over it under a row mask reads
each row's left padding and the columns not yet written as well (601 validation rows whose prompts
average ~470 tokens in a 1408-wide cache: about half of what it reads). FlashAttention's varlen
forward can skip them (per-row key counts), but it computes 128 query rows a tile for the 8 query
heads a key/value head serves: on an H100 it took the validation's generation only from 20.0 to
19.7 s, where this kernel reads at ~2.8 TB/s (scripts/bench_decode_attention.py). One program here
serves one row and key/value head: its group of query heads (padded to 16, the least a tensor-core
dot takes) against its keys, in blocks with an online softmax, as FlashAttention computes it: scores
and sums in float32, probabilities rounded to the cache's dtype before they weigh the values.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the decode step attends under a mask
    triton = None

BLOCK_N = 64  # keys a program reads at a time

log = logging.getLogger(__name__)

if triton is not None:

    @triton.jit
    def _rows_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, counts_ptr, scale,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        pair = tl.program_id(0)  # row r, key/value head h: r KV + h
        start = tl.load(starts_ptr + pair).to(tl.int64)  # its first key among the flattened cache places
        count = tl.load(counts_ptr + pair)
        g, d, n = tl.arange(0, GROUP_PAD), tl.arange(0, D), tl.arange(0, BLOCK_N)
        heads = pair.to(tl.int64) * GROUP + g  # its query heads among all rows'
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g < GROUP)[:, None], other=0.0)  # (GROUP_PAD, D)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
        s = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for first in range(0, count, BLOCK_N):
            real = first + n < count
            places = (start + first + n)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + places, mask=real[:, None], other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptr + places, mask=real[:, None], other=0.0)
            score = tl.dot(q, tl.trans(k)) * scale  # (GROUP_PAD, BLOCK_N) float32
            score = tl.where(real[None, :], score, float("-inf"))
            new_m = tl.maximum(m, tl.max(score, 1))
            p = tl.exp(score - new_m[:, None])
            shrink = tl.exp(m - new_m)
            s = s * shrink + tl.sum(p, 1)
            acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
            m = new_m
        out = acc / s[:, None]
        tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(q.dtype), mask=(g < GROUP)[:, None])


@functools.cache
def serves(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can run the decode step's attention here (a GPU, or Triton's interpreter:
    TRITON_INTERPRET=1); on a GPU, says why not once."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    reason = ("Triton is not installed" if triton is None
              else f"it takes bf16 or fp16, not {dtype}" if dtype not in (torch.bfloat16, torch.float16)
              else f"it takes head sizes that are powers of two from 16, not {head_dim}"
              if head_dim < 16 or head_dim & (head_dim - 1) else None)
    if reason:
        log.info("static engine: the decode step attends the whole cache under a mask: the decode attention kernel "
                 "does not serve (%s)", reason)
    return reason is None


def rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                   counts: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's query heads over its own keys: the `count` cache columns from `start`.

    query: (rows, kv_heads, group, D); key/value: (rows, kv_heads, W, D) contiguous (the static cache);
    starts: (rows kv_heads,) int, each row and head's first key among the rows kv_heads W flattened
    places; counts: (rows kv_heads,) int32, at least 1. Returns (rows, kv_heads, group, D).
    """
    rows, kv_heads, group, dim = query.shape
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("rows_attention reads the cache's keys and values in place: they must be contiguous")
    query = query.contiguous()
    out = torch.empty_like(query)
    _rows_kernel[(rows * kv_heads,)](query, key, value, out, starts, counts, float(scale), GROUP=group,
                                     GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=BLOCK_N,
                                     num_warps=4, num_stages=3)
    return out

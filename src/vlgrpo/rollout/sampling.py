"""Keyed sampling: every sample's randomness is a pure function of (seed, step, prompt, sample).

Sampling from softmax(logits / T) is done by the Gumbel-max trick with noise drawn from a
counter-based hash of (row key, position, token id) instead of a stateful generator. So a sample
does not depend on which other samples share its batch, on the batch order, or on anything that
ran before in the process: a resumed run reproduces the uninterrupted one token for token.
"""

from __future__ import annotations

import functools
import logging

import torch

from vlgrpo.rollout import fused_sampling

log = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 keep every product of a 32-bit value below 2**63 (no int64 overflow).
_M1, _M2, _M3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of 32-bit values held in int64 (two xorshift-multiply rounds)."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _M1) & _MASK32
    x = ((x ^ (x >> 15)) * _M2) & _MASK32
    return x ^ (x >> 16)


def sample_key(*parts: int) -> int:
    """One 32-bit key from integers, e.g. sample_key(seed, step, prompt_index, sample_index)."""
    h = torch.tensor(0x9E3779B9, dtype=torch.int64)
    for p in parts:
        h = _mix32(h ^ _mix32(torch.tensor(int(p) & _MASK32, dtype=torch.int64) + _M3))
    return int(h)


def row_hash(keys: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """The noise's per-row hash of (key, position): keys (N,) int64 -> (N,) int64 in [0, 2**32)."""
    return _mix32(keys.to(torch.int64) * 31 + position * _M3)


def uniform_noise(keys: torch.Tensor, position: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise, one value per (row, token).

    keys: (N,) int64 row keys; position: an int or a (1,) int64 tensor on keys' device (the static
    engine keeps it there); returns (N, V) float32 that depends only on (key, position, token).
    """
    row = _as_int32(row_hash(keys, position))[:, None]  # (N, 1)
    tok = _as_int32(_mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64) + _M1))[None, :]  # (1, V)
    h = _mix32_int32(row ^ tok)  # (N, V): the same 32 bits as _mix32 in int64, half the memory traffic
    return unit_interval(h)


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int32 or int64) -> float32 in (0, 1), both ends excluded: the top 23 bits, centred.

    (k + 0.5) / 2**23 for k < 2**23 is exact in float32 (spacing 0.5 below 2**23), so u < 1 and
    -log(-log(u)) is finite. With 24 bits, k = 2**24 - 1 rounded to u = 1.0: infinite Gumbel noise
    for 1 token in 2**24, about one per 110 decode-step rows at Qwen's vocabulary, sampled whatever
    its probability.
    """
    return (((h >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) / float(1 << 23)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 (0 .. 2**32 - 1) -> the same bits in int32."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """_mix32 on int32 bit patterns: logical shifts by masking, products wrap mod 2**32 as in _mix32."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2
    return x ^ ((x >> 16) & 0xFFFF)


def nucleus_edge(logits: torch.Tensor, top_p: float, temperature: float = 1.0) -> torch.Tensor:
    """The least likely logit in the nucleus of softmax(logits / temperature) of mass top_p.

    The nucleus: the most likely tokens, in order, while the mass before each is at most top_p,
    and every token as likely as the last of them (ties at the edge all stay, whatever order a
    sort puts them in). Sorted in the logits' own dtype (bf16 logits: half the bytes a float32
    sort moves); dividing by a positive temperature keeps the order, so the edge is exact.
    logits: (N, V) -> (N, 1) in the logits' dtype.
    """
    sorted_logits = logits.sort(dim=-1, descending=True).values
    probs = (sorted_logits.float() / temperature).softmax(dim=-1)
    kept = (probs.cumsum(dim=-1) - probs <= top_p).sum(dim=-1, keepdim=True)  # (N, 1), at least 1
    return sorted_logits.gather(-1, kept - 1)


def top_k_mask(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set logits below the k-th largest of their row to -inf (ties with it all stay). top_k <= 0 or
    >= V keeps every token. logits: (N, V) -> (N, V)"""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    return logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the nucleus of mass top_p (nucleus_edge) to -inf. logits: (N, V) -> (N, V)"""
    if top_p >= 1.0:
        return logits
    return logits.masked_fill(logits < nucleus_edge(logits, top_p), float("-inf"))


@functools.cache
def _log_top_k_once() -> None:
    log.info("top_k sampling: the fused sampling kernel has no top-k; sampling runs in PyTorch operations")


def keyed_sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    position: int | torch.Tensor,
    temperature: float,
    top_p: float,
    banned: torch.Tensor | None = None,
    top_k: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens (N,), log-prob of each token under softmax(logits/T)).

    logits: (N, V) raw logits; keys: (N,) int64; banned: (V,) bool, tokens never sampled (vision
    placeholders, ids past the tokenizer). temperature 0 means greedy decoding. top_k > 0 keeps the
    k most likely tokens, then top_p applies to their renormalised distribution (vLLM's order).
    The returned log-prob is that of the full tempered distribution (no top-k/p, no ban), which is
    what the training forward recomputes (EasyR1/verl divide logits by T and nothing else).
    On a GPU with Triton it runs as one kernel (fused_sampling), elsewhere as keyed_sample_torch;
    the kernel has no top-k, so a top_k below the vocabulary runs keyed_sample_torch (logged once).
    """
    if 0 < top_k < logits.shape[-1] and temperature != 0:
        if fused_sampling.available(logits):
            _log_top_k_once()
        return keyed_sample_torch(logits, keys, position, temperature, top_p, banned, top_k)
    if fused_sampling.available(logits) and logits.stride(-1) == 1:
        hashes = row_hash(keys.to(logits.device), position)
        return fused_sampling.keyed_sample_fused(logits, hashes, temperature, top_p, banned)
    return keyed_sample_torch(logits, keys, position, temperature, top_p, banned)


def keyed_sample_torch(
    logits: torch.Tensor,
    keys: torch.Tensor,
    position: int | torch.Tensor,
    temperature: float,
    top_p: float,
    banned: torch.Tensor | None = None,
    top_k: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """keyed_sample in PyTorch operations (any device): the definition the fused kernel follows."""
    scaled = logits.float() if temperature == 0 else logits.float() / temperature
    logp = scaled.log_softmax(dim=-1)
    allowed = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    if temperature == 0:
        tokens = allowed.argmax(dim=-1)
    else:
        top_k_on = 0 < top_k < logits.shape[-1]
        if top_k_on or top_p < 1.0:  # both found on the logits as they come (bf16 from the model): same order, fewer bytes
            raw = logits if banned is None else logits.masked_fill(banned, float("-inf"))
        if top_k_on:
            raw = top_k_mask(raw, top_k)
            allowed = allowed.masked_fill(raw == float("-inf"), float("-inf"))
        if top_p < 1.0:  # the nucleus of the (top-k) distribution
            allowed = allowed.masked_fill(raw < nucleus_edge(raw, top_p, temperature), float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(keys, position, logits.shape[-1])))
        tokens = (allowed + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

"""sampling.keyed_sample as one Triton kernel: the same tokens, far fewer passes over the vocabulary.

The PyTorch form runs ~30 full-vocabulary passes per decode step (float32 copies, a sort for top-p,
the noise hash, two logs, argmax, log-softmax): 12.7 ms a step at 601 rows x 151,936 tokens on an
H200, as long as the rest of the decode step. Here one program per row reads its logits a few times
(from L2 where the row fits):
1. max and sum of exp of logits / T, online: over every token (the returned log-prob is of the full
   tempered distribution) and over the allowed ones (not banned: the nucleus is their mass);
2. top-p: the nucleus edge is the least logit w whose strictly-higher mass is at most top_p, which is
   what sorting and a cumulative sum find (ties at the edge all stay). It is found by a 16-way search
   over an order-preserving integer key of the logits, 4 bits a pass: 4 passes for bf16 (16-bit
   keys), 8 for float32, each summing the mass at or above 16 candidate edges at once;
3. Gumbel-max over the allowed tokens at or above the edge. sampling.uniform_noise's hash is
   computed inline (its 32-bit products wrap the same way) with libdevice's log, the function torch
   calls, so the noise and the sampled tokens are the PyTorch form's; ties go to the lowest id.
Differences: the nucleus masses are summed in another order than the sort's cumulative sum, so a row
whose top_p boundary lies within float rounding of a token's mass may keep one token more or fewer;
the log-prob may differ in its last bit.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no Triton: sampling.keyed_sample keeps its PyTorch form
    triton = None

BLOCK = 1024  # vocabulary entries a program reads at a time

if triton is not None:

    @triton.jit
    def _mix32(x):
        """sampling._mix32 on uint32 (products wrap mod 2**32 as the int64 form's masks do)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x2C1B3C6D
        return x ^ (x >> 16)

    @triton.jit
    def _order_key(x, KEY_BITS: tl.constexpr):
        """Float32 values -> int64 keys in [0, 2**KEY_BITS) with the values' order (bf16: KEY_BITS 16)."""
        s = x.to(tl.int32, bitcast=True) >> (32 - KEY_BITS)  # arithmetic: a bf16's 16 bits, sign kept
        s = s.to(tl.int64)
        return tl.where(s >= 0, s + (1 << (KEY_BITS - 1)), -1 - s)

    @triton.jit
    def _online_logsumexp(m, s, z, keep):
        """Running max m and sum s of exp(z - m) over the kept entries, one more block z folded in."""
        new_m = tl.maximum(m, tl.max(tl.where(keep, z, float("-inf")), 0))
        scale = tl.where(new_m == m, 1.0, tl.exp(m - new_m))  # m == new_m == -inf before the first finite entry
        return new_m, s * scale + tl.sum(tl.where(keep & (z > float("-inf")), tl.exp(z - new_m), 0.0), 0)

    @triton.jit
    def _keyed_sample_kernel(
        logits_ptr, row_stride, banned_ptr, row_hash_ptr, tokens_ptr, logp_ptr, V, temperature, top_p,
        HAS_BANNED: tl.constexpr, GREEDY: tl.constexpr, TOP_P: tl.constexpr, KEY_BITS: tl.constexpr,
        BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)

        # 1. max and sum of exp, all tokens (log-prob) and allowed tokens (nucleus mass)
        m_all = tl.full([], float("-inf"), tl.float32)
        s_all = tl.zeros([], tl.float32)
        m_ok = tl.full([], float("-inf"), tl.float32)
        s_ok = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            inside = offs < V
            x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
            z = x if GREEDY else tl.math.div_rn(x, temperature)
            ok = inside
            if HAS_BANNED:
                ok = ok & (tl.load(banned_ptr + offs, mask=inside, other=1) == 0)
            m_all, s_all = _online_logsumexp(m_all, s_all, z, inside)
            m_ok, s_ok = _online_logsumexp(m_ok, s_ok, z, ok)

        # 2. the nucleus edge: the least key whose strictly-higher mass is at most top_p
        edge = tl.zeros([], tl.int64)  # the edge lies in [edge, edge + 16 * step)
        if TOP_P:
            limit = top_p * s_ok
            digits = tl.arange(0, 16).to(tl.int64)
            step = 1 << (KEY_BITS - 4)
            for _ in tl.static_range(KEY_BITS // 4):
                candidates = edge + digits * step  # (16,)
                mass = tl.zeros([16], tl.float32)  # mass at or above each candidate
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    inside = offs < V
                    x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
                    ok = inside
                    if HAS_BANNED:
                        ok = ok & (tl.load(banned_ptr + offs, mask=inside, other=1) == 0)
                    p = tl.where(ok, tl.exp(tl.math.div_rn(x, temperature) - m_ok), 0.0)
                    at_or_above = _order_key(x, KEY_BITS)[:, None] >= candidates[None, :]
                    mass += tl.sum(tl.where(at_or_above, p[:, None], 0.0), 0)
                # candidate 0 (the current edge) always has more than top_p at or above it
                edge += (tl.sum((mass > limit).to(tl.int64), 0) - 1) * step
                step = step // 16

        # 3. Gumbel-max over the allowed tokens at or above the edge
        if not GREEDY:
            row_hash = tl.load(row_hash_ptr + row).to(tl.uint32)
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            inside = offs < V
            x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
            ok = inside
            if HAS_BANNED:
                ok = ok & (tl.load(banned_ptr + offs, mask=inside, other=1) == 0)
            if GREEDY:
                score = x
            else:
                if TOP_P:
                    ok = ok & (_order_key(x, KEY_BITS) >= edge)
                token_hash = _mix32(offs.to(tl.uint32) + 0x7FEB352D)
                h = _mix32(row_hash ^ token_hash)
                u = (((h >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # 2**-24: exact, as /
                if INTERPRET:  # numpy's log: the interpreter has no libdevice
                    gumbel = -tl.log(-tl.log(u))
                else:
                    gumbel = -libdevice.log(-libdevice.log(u))
                score = tl.math.div_rn(x, temperature) + gumbel
            score = tl.where(ok, score, float("-inf"))
            block_best = tl.max(score, 0)
            block_id = start + tl.argmax(score, 0)
            best_id = tl.where(block_best > best, block_id, best_id)  # strict: the earlier block wins ties
            best = tl.maximum(best, block_best)

        x = tl.load(base + best_id).to(tl.float32)
        z = x if GREEDY else tl.math.div_rn(x, temperature)
        tl.store(tokens_ptr + row, best_id)
        tl.store(logp_ptr + row, (z - m_all) - tl.log(s_all))


def available(logits: torch.Tensor) -> bool:
    """Whether keyed_sample can run as the kernel on these logits (Triton and a GPU)."""
    return triton is not None and logits.is_cuda


def keyed_sample_fused(
    logits: torch.Tensor,
    row_hash: torch.Tensor,
    temperature: float,
    top_p: float,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (N,) and their log-probs (N,) as sampling.keyed_sample gives them.

    logits: (N, V), bf16 or float32, rows contiguous; row_hash: (N,) int64, sampling's per-row hash of
    (key, position) (sampling.row_hash); banned: (V,) bool or None. Works on CPU tensors under
    TRITON_INTERPRET=1 (the tests).
    """
    if logits.stride(-1) != 1:
        raise ValueError("keyed_sample_fused needs logits with contiguous rows")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    _keyed_sample_kernel[(rows,)](
        logits, logits.stride(0), logits if banned is None else banned.view(torch.uint8), row_hash, tokens, logp,
        vocab, 1.0 if greedy else float(temperature), float(top_p),
        HAS_BANNED=banned is not None, GREEDY=greedy, TOP_P=not greedy and top_p < 1.0,
        KEY_BITS=16 if logits.dtype == torch.bfloat16 else 32, BLOCK=BLOCK, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=8,
    )
    return tokens, logp

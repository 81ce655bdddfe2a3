"""sampling.keyed_sample as one Triton kernel: the same tokens, far fewer passes over the vocabulary.

The PyTorch form runs ~30 full-vocabulary passes per decode step (float32 copies, a sort for top-p,
the noise hash, two logs, argmax, log-softmax): 12.7 ms a step at 601 rows x 151,936 tokens on an
H200, as long as the rest of the decode step. Here one program per row reads its logits a few times,
keeping every running max, sum and argmax per lane and reducing once per pass:
1. max and sum of exp of logits / T, online: over every token (the returned log-prob is of the full
   tempered distribution) and over the allowed ones (not banned: the nucleus is their mass); and the
   Gumbel-max winner over the allowed tokens (sampling.uniform_noise's hash computed inline, its
   32-bit products wrapping the same way, with libdevice's log, the function torch calls), which is
   the token without top-p;
2. top-p: the nucleus edge is the least logit whose strictly-higher allowed mass is at most top_p,
   which is what sorting and a cumulative sum find (ties at the edge all stay). The winner of 1 is in
   the nucleus iff the mass strictly above its own logit is at most top_p: one pass checks that, and
   for a share of rows about top_p (Gumbel-max samples the untruncated distribution) it is the token;
3. only for the other rows, the edge by a 16-way search over an order-preserving integer key of the
   logits, 4 bits a pass (4 passes for bf16's 16-bit keys, 8 for float32), each summing the mass at
   or above 16 candidate edges at once, then the Gumbel-max over the allowed tokens at or above it.
Ties go to the lowest id, as torch.argmax's.
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
    def _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED: tl.constexpr, GREEDY: tl.constexpr):
        """One block of a row: token ids, logits x (float32), tempered z, and allowed (inside, not banned)."""
        offs = start + lanes
        inside = offs < V
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
        ok = inside
        if HAS_BANNED:
            ok = ok & (tl.load(banned_ptr + offs, mask=inside, other=1) == 0)
        z = x if GREEDY else tl.math.div_rn(x, temperature)
        return offs, inside, x, z, ok

    @triton.jit
    def _gumbel(offs, row_hash, INTERPRET: tl.constexpr):
        """sampling.uniform_noise's value for these tokens of the row, as Gumbel noise -log(-log(u))."""
        token_hash = _mix32(offs.to(tl.uint32) + 0x7FEB352D)
        h = _mix32(row_hash ^ token_hash)
        u = (((h >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # sampling.unit_interval; 2**-23: exact, as /
        if INTERPRET:  # numpy's log: the interpreter has no libdevice
            return -tl.log(-tl.log(u))
        return -libdevice.log(-libdevice.log(u))

    @triton.jit
    def _lane_logsumexp(m, s, z, keep):
        """Per lane, running max m and sum s of exp(z - m) over kept entries: (BLOCK,) each, no reduction."""
        z = tl.where(keep, z, float("-inf"))
        new_m = tl.maximum(m, z)
        live = new_m > float("-inf")  # else m - new_m is nan; the lane has seen nothing kept yet
        return new_m, tl.where(live, s * tl.exp(m - new_m) + tl.exp(z - new_m), 0.0)

    @triton.jit
    def _reduce_logsumexp(m, s):
        """Lanes' (max, sum) -> the row's max and sum of exp(z - max)."""
        top = tl.max(m, 0)
        return top, tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), 0)

    @triton.jit
    def _lane_argmax(best, best_id, score, offs):
        """Per lane, the best score so far and its token; strict: the earlier token wins ties."""
        better = score > best
        return tl.where(better, score, best), tl.where(better, offs, best_id)

    @triton.jit
    def _reduce_argmax(best, best_id, V):
        """Lanes' (best, id) -> the row's best token, the lowest id among ties (torch.argmax's)."""
        top = tl.max(best, 0)
        return tl.min(tl.where(best == top, best_id, V), 0)

    @triton.jit
    def _sample_kernel(
        logits_ptr, row_stride, banned_ptr, row_hash_ptr, tokens_ptr, logp_ptr, V, temperature, top_p,
        HAS_BANNED: tl.constexpr, GREEDY: tl.constexpr, TOP_P: tl.constexpr, KEY_BITS: tl.constexpr,
        BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """Passes 1 and 2. A row whose winner is outside the nucleus gets token -1, for _nucleus_kernel."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        row_hash = tl.load(row_hash_ptr + row).to(tl.uint32)
        # Every accumulator is per lane, reduced once after its pass: no cross-warp reduction per block.
        neg = tl.full([BLOCK], float("-inf"), tl.float32)
        zero = tl.zeros([BLOCK], tl.float32)

        # 1. max and sum of exp over all tokens (the log-prob) and the allowed ones (the nucleus mass);
        #    the Gumbel-max winner over all allowed tokens, which is the answer without top-p
        m_all, s_all, m_ok, s_ok = neg, zero, neg, zero
        best, best_id = neg, tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs, inside, x, z, ok = _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED, GREEDY)
            m_all, s_all = _lane_logsumexp(m_all, s_all, z, inside)
            if TOP_P:
                m_ok, s_ok = _lane_logsumexp(m_ok, s_ok, z, ok)
            score = x if GREEDY else z + _gumbel(offs, row_hash, INTERPRET)
            best, best_id = _lane_argmax(best, best_id, tl.where(ok, score, float("-inf")), offs)
        m_all, s_all = _reduce_logsumexp(m_all, s_all)
        token = _reduce_argmax(best, best_id, V)
        x_w = tl.load(base + token).to(tl.float32)
        logp = ((x_w if GREEDY else tl.math.div_rn(x_w, temperature)) - m_all) - tl.log(s_all)  # as log_softmax rounds

        if TOP_P:
            # 2. the winner is in the nucleus iff the allowed mass strictly above its logit is at most
            #    top_p (the nucleus edge is the least logit for which that holds): true for a share of
            #    rows about top_p, whatever the logits, as Gumbel-max samples the untruncated distribution
            m_ok, s_ok = _reduce_logsumexp(m_ok, s_ok)
            key_w = _order_key(x_w, KEY_BITS)
            above = zero
            for start in range(0, V, BLOCK):
                offs, inside, x, z, ok = _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED, GREEDY)
                above += tl.where(ok & (_order_key(x, KEY_BITS) > key_w), tl.exp(z - m_ok), 0.0)
            if tl.sum(above, 0) > top_p * s_ok:
                token = tl.full([], -1, tl.int32)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, logp)

    @triton.jit
    def _nucleus_kernel(
        logits_ptr, row_stride, banned_ptr, row_hash_ptr, tokens_ptr, logp_ptr, V, temperature, top_p,
        HAS_BANNED: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """Pass 3, for the rows _sample_kernel left at token -1 (the others return at once). A kernel of
        its own: its 16-way sums need registers that would halve the occupancy of the first. It sums
        the row's exps again rather than reading them from the first kernel: one more pass for ~5%
        of the rows, against scratch buffers written for all of them."""
        row = tl.program_id(0)
        if tl.load(tokens_ptr + row) < 0:
            base = logits_ptr + row.to(tl.int64) * row_stride
            lanes = tl.arange(0, BLOCK)
            neg, zero = tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.float32)
            m_all, s_all, m_ok, s_ok = neg, zero, neg, zero
            for start in range(0, V, BLOCK):
                offs, inside, x, z, ok = _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED, False)
                m_all, s_all = _lane_logsumexp(m_all, s_all, z, inside)
                m_ok, s_ok = _lane_logsumexp(m_ok, s_ok, z, ok)
            m_all, s_all = _reduce_logsumexp(m_all, s_all)
            m_ok, s_ok = _reduce_logsumexp(m_ok, s_ok)
            limit = top_p * s_ok
            # the edge by a 16-way search over the order keys, 4 bits a pass; candidate 0 (the edge
            # so far) always has more than top_p at or above it
            edge = tl.zeros([], tl.int64)  # the edge lies in [edge, edge + 16 * step)
            digits = tl.arange(0, 16).to(tl.int64)
            step = 1 << (KEY_BITS - 4)
            for _ in tl.static_range(KEY_BITS // 4):
                candidates = edge + digits * step  # (16,)
                mass = tl.zeros([BLOCK, 16], tl.float32)  # per lane, the mass at or above each candidate
                for start in range(0, V, BLOCK):
                    offs, inside, x, z, ok = _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED, False)
                    p = tl.where(ok, tl.exp(z - m_ok), 0.0)
                    mass += tl.where(_order_key(x, KEY_BITS)[:, None] >= candidates[None, :], p[:, None], 0.0)
                edge += (tl.sum((tl.sum(mass, 0) > limit).to(tl.int64), 0) - 1) * step
                step = step // 16
            # Gumbel-max over the allowed tokens at or above the edge
            row_hash = tl.load(row_hash_ptr + row).to(tl.uint32)
            best, best_id = neg, tl.zeros([BLOCK], tl.int32)
            for start in range(0, V, BLOCK):
                offs, inside, x, z, ok = _block(base, banned_ptr, start, lanes, V, temperature, HAS_BANNED, False)
                keep = ok & (_order_key(x, KEY_BITS) >= edge)
                score = tl.where(keep, z + _gumbel(offs, row_hash, INTERPRET), float("-inf"))
                best, best_id = _lane_argmax(best, best_id, score, offs)
            token = _reduce_argmax(best, best_id, V)
            z = tl.math.div_rn(tl.load(base + token).to(tl.float32), temperature)
            tl.store(tokens_ptr + row, token.to(tl.int64))
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
    top_p_on = not greedy and top_p < 1.0
    args = (logits, logits.stride(0), logits if banned is None else banned.view(torch.uint8), row_hash, tokens, logp,
            vocab, 1.0 if greedy else float(temperature), float(top_p))
    common = dict(HAS_BANNED=banned is not None, KEY_BITS=16 if logits.dtype == torch.bfloat16 else 32, BLOCK=BLOCK,
                  INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=8)
    _sample_kernel[(rows,)](*args, GREEDY=greedy, TOP_P=top_p_on, **common)
    if top_p_on:
        _nucleus_kernel[(rows,)](*args, **common)
    return tokens, logp

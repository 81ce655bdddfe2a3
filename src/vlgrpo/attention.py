"""vlgrpo's attention functions, registered with transformers under their own names.

- PACKED_VISION_ATTENTION: the vision tower's packed images (cu_seqlens) in one call
  (model.packed_vision_attention, Qwen2.5-VL's windowed tower): flash varlen on CUDA in bf16/fp16,
  else SDPA over the segments padded to the longest.
- PREFIX_ROWS_ATTENTION: the language model's SDPA, which also attends a packed prefix row
  [prompt | response 1 | ... | response k] (policy._packed_prefix_hidden, the update under gradient
  checkpointing) segment by segment: the prompt attends to itself, each response to the prompt and to
  its own earlier tokens, so the pairs between responses are never computed. On CUDA in bf16/fp16 the
  segments are two flash varlen calls over the real tokens (VarlenPrefixRows: no masks, FlashAttention's
  kernels); elsewhere two SDPA calls under masks (PrefixRows). A call without the row's layout (every
  other forward) is transformers' SDPA as is.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vlgrpo.batch import to_device

try:  # torch 2.11+: FlashAttention-2's varlen kernels, causal as the window (-1, 0), with a backward
    from torch.nn.attention.varlen import varlen_attn
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        varlen_attn = None
except ImportError:
    varlen_attn = None

log = logging.getLogger(__name__)


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Attention within packed segments in one call: flash varlen on CUDA in bf16/fp16, else one SDPA
    call with each segment padded to the longest.

    query/key/value: (1, heads, S, D), S tokens of segments bounded by cu_seq_lens_q (n + 1,).
    Returns ((1, S, heads, D), None) as transformers' flash-attention functions do.
    """
    if flash_varlen_serves(query.device.type, query.dtype):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (S, heads, D)
        bounds, longest = cu_seq_lens_q.int(), int(max_length_q)
        return varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scaling)[None], None
    _, heads, total, dim = query.shape
    bounds = cu_seq_lens_q.long()
    lengths = bounds[1:] - bounds[:-1]
    count, width = lengths.numel(), -(-int(max_length_q) // 16) * 16  # aligned rows for the fused kernels
    positions = torch.arange(total, device=query.device)
    segment = torch.repeat_interleave(torch.arange(count, device=query.device), lengths, output_size=total)
    slot = segment * width + positions - bounds[segment]  # (S,) place of each token in the padded layout

    def pad(x):  # (1, heads, S, D) -> (count, heads, width, D)
        padded = x.new_zeros(heads, count * width, dim).index_copy(1, slot, x[0])
        return padded.view(heads, count, width, dim).transpose(0, 1)

    valid = torch.arange(width, device=query.device) < lengths[:, None]  # (count, width) real keys
    out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), attn_mask=valid[:, None, None, :], scale=scaling)
    out = out.transpose(0, 1).reshape(heads, count * width, dim)[:, slot]  # (heads, S, D)
    return out.transpose(0, 1)[None], None


# "flash" in the name: Qwen2.5-VL's vision attention hands packed cu_seqlens only to such implementations.
PACKED_VISION_ATTENTION = "vlgrpo_packed_flash_varlen"
AttentionInterface.register(PACKED_VISION_ATTENTION, packed_attention)


@dataclass(frozen=True)
class PrefixRows:
    """The masks of U packed prefix rows, each [prompt (P) | response 1 (R) | ... | response k (R)],
    made once per forward (every layer, and its recompute, reads them)."""

    prompt_mask: torch.Tensor  # (U, 1, P, P) bool, True: attend
    response_mask: torch.Tensor  # (U k, 1, R, P + R) bool: each response's prompt, then its own tokens

    @classmethod
    def of(cls, prompt_keys: torch.Tensor, response_keys: torch.Tensor) -> "PrefixRows":
        """prompt_keys: (U, P) real prompt tokens (left padding False); response_keys: (U, k, R) real
        response tokens (padding and empty slots False). A query with no key (left padding) sees
        itself: its output is never read."""
        (U, P), (_, k, R) = prompt_keys.shape, response_keys.shape
        device = prompt_keys.device
        causal_p = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        prompt = (causal_p & prompt_keys[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)  # (U, P, P)
        causal_r = torch.ones(R, R, dtype=torch.bool, device=device).tril() & response_keys.view(U * k, 1, R)
        sees_prompt = prompt_keys.repeat_interleave(k, dim=0)[:, None, :].expand(-1, R, -1)  # (U k, R, P)
        return cls(prompt[:, None], torch.cat([sees_prompt, causal_r], dim=-1)[:, None])


@dataclass(frozen=True)
class VarlenPrefixRows:
    """The layout of U packed prefix rows, each [prompt (P, left-padded) | response 1 (R) | ... | response k (R)],
    as flash varlen calls take it: token places and cumulative lengths, made once per forward on the host.
    Responses keep all R places (a causal query never reads the padding after it; its own output is
    never read)."""

    k: int
    response_width: int  # R
    prompt_tokens: torch.Tensor  # (Tp,) long: each real prompt token's place among the U P prompt places, row by row
    prompt_bounds: torch.Tensor  # (U + 1,) int32: where each row's prompt starts in prompt_tokens
    longest_prompt: int
    response_keys: torch.Tensor  # (Tk,) long: places among the U L row places of each response's keys: its prompt's real tokens, then its R
    response_key_bounds: torch.Tensor  # (U k + 1,) int32
    response_query_bounds: torch.Tensor  # (U k + 1,) int32: R each

    @classmethod
    def of(cls, prompt_lengths: torch.Tensor, prompt_width: int, k: int, response_width: int, device) -> "VarlenPrefixRows":
        """prompt_lengths: (U,) real tokens of each left-padded prompt, on the host (the layout is read
        there: no wait for the device)."""
        U, P, R = len(prompt_lengths), prompt_width, response_width
        L = P + k * R
        lengths = prompt_lengths.long().cpu()
        real = torch.arange(P) >= (P - lengths)[:, None]  # (U, P) the real (right-aligned) prompt places
        prompt_tokens = torch.arange(U * P).view(U, P)[real]  # among the U P prompt places
        in_rows = (torch.arange(U)[:, None] * L + torch.arange(P))[real].split(lengths.tolist())  # among the U L row places
        response = torch.arange(U)[:, None, None] * L + P + torch.arange(k)[:, None] * R + torch.arange(R)  # (U, k, R) row places
        keys = torch.cat([torch.cat([in_rows[u], response[u, j]]) for u in range(U) for j in range(k)])

        def bounds(sizes):
            return to_device(F.pad(torch.as_tensor(sizes).cumsum(0), (1, 0)).int(), device)

        return cls(k, R, to_device(prompt_tokens, device), bounds(lengths), int(lengths.max()),
                   to_device(keys, device), bounds((lengths + R).repeat_interleave(k)), bounds([R] * (U * k)))


@functools.cache
def flash_varlen_serves(device_type: str, dtype: torch.dtype) -> bool:
    """Whether packed segments (prefix rows, vision windows) can be attended by flash varlen calls on this
    device and dtype; on CUDA, says why not once."""
    if device_type != "cuda":
        return False
    if varlen_attn is None:
        log.info("torch %s has no flash varlen attention with a causal window (torch 2.11+): packed prefix rows "
                 "and vision windows are attended by SDPA under masks", torch.__version__)
        return False
    if dtype not in (torch.bfloat16, torch.float16):
        log.info("flash varlen attention takes bf16 or fp16, not %s: packed prefix rows and vision windows are "
                 "attended by SDPA under masks", dtype)
        return False
    return True


def varlen_rows_attention(query, key, value, rows: VarlenPrefixRows, scaling: float | None) -> torch.Tensor:
    """Packed prefix rows in two flash varlen calls: each prompt causally over its real tokens, each
    response over its prompt's real tokens and its own (causal, aligned at the end: response token t
    sees the prompt and response tokens 0..t).

    query: (U, heads, L, D), key/value: (U, kv_heads, L, D), L = P + k R. Returns (U, L, heads, D), zero
    at the prompts' padding.
    """
    (U, heads, L, D), kv_heads = query.shape, key.shape[1]
    k, R = rows.k, rows.response_width
    P = L - k * R

    def tokens(x, part):  # (U, h, L, D) -> (U * part width, h, D), token-major
        x = x[:, :, part]
        return x.transpose(1, 2).reshape(-1, x.shape[1], D)

    def widen(x):  # (T, kv_heads, D) -> (T, heads, D): each key/value head serves its group of query heads
        return x[:, :, None].expand(-1, -1, heads // kv_heads, -1).reshape(x.shape[0], heads, D)

    prompt, every = slice(0, P), slice(None)
    q_p, k_p, v_p = (tokens(x, prompt).index_select(0, rows.prompt_tokens) for x in (query, key, value))
    out_p = varlen_attn(q_p, widen(k_p), widen(v_p), rows.prompt_bounds, rows.prompt_bounds, rows.longest_prompt,
                   rows.longest_prompt, scale=scaling, window_size=(-1, 0))  # (Tp, heads, D)
    k_r, v_r = (widen(tokens(x, every).index_select(0, rows.response_keys)) for x in (key, value))
    out_r = varlen_attn(tokens(query, slice(P, L)), k_r, v_r, rows.response_query_bounds, rows.response_key_bounds, R,
                   rows.longest_prompt + R, scale=scaling, window_size=(-1, 0))  # (U k R, heads, D)
    out_p = out_p.new_zeros(U * P, heads, D).index_copy(0, rows.prompt_tokens, out_p)
    return torch.cat([out_p.view(U, P, heads, D), out_r.view(U, k * R, heads, D)], dim=1)


def whole_row_mask(prompt_keys: torch.Tensor, response_keys: torch.Tensor) -> torch.Tensor:
    """The (U, 1, L, L) boolean mask of U packed prefix rows as one attention call takes them, L = P + k R
    (what PrefixRows splits in two): a prompt token sees the real prompt tokens up to itself, a response
    token the real prompt tokens and its own real earlier tokens. prompt_keys: (U, P), response_keys:
    (U, k, R), as PrefixRows.of. A query with no key (left padding) sees itself: its output is never read."""
    (U, P), (_, k, R) = prompt_keys.shape, response_keys.shape
    device = prompt_keys.device
    segment = torch.cat([torch.full((P,), -1, device=device), torch.arange(k, device=device).repeat_interleave(R)])  # (L,) -1: prompt
    index = torch.cat([torch.arange(P, device=device), torch.arange(R, device=device).repeat(k)])  # (L,) place in its segment
    keys = torch.cat([prompt_keys, response_keys.view(U, k * R)], dim=1)  # (U, L) keys that exist
    causal = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])  # (L, L) query x key
    sees = (causal | ((segment[:, None] >= 0) & (segment[None, :] < 0)))[None] & keys[:, None, :]  # responses see the prompt
    sees |= torch.eye(P + k * R, dtype=torch.bool, device=device)
    return sees[:, None]


def prefix_rows_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None,
                          prefix_rows: PrefixRows | VarlenPrefixRows | None = None, **kwargs):
    """transformers' SDPA; over packed prefix rows (`prefix_rows` given) in two calls, the prompts and
    the responses, whose keys are each response's prompt and itself: flash varlen calls over the real
    tokens (VarlenPrefixRows) or SDPA under masks (PrefixRows).

    query: (U, heads, L, D), key/value: (U, kv_heads, L, D), L = P + k R. Returns ((U, L, heads, D), None).
    """
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if prefix_rows is None:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(prefix_rows, VarlenPrefixRows):
        return varlen_rows_attention(query, key, value, prefix_rows, scaling), None
    U, P, R = query.shape[0], prefix_rows.prompt_mask.shape[-1], prefix_rows.response_mask.shape[-2]
    k = prefix_rows.response_mask.shape[0] // U

    def responses(x):  # (U, h, L, D) -> (U k, h, R, D)
        return x[:, :, P:].unflatten(2, (k, R)).transpose(1, 2).flatten(0, 1)

    def with_prompt(x):  # (U, h, L, D) -> (U k, h, P + R, D): each response after its prompt
        return torch.cat([x[:, :, :P].repeat_interleave(k, dim=0), responses(x)], dim=2)

    head, _ = sdpa(module, query[:, :, :P], key[:, :, :P], value[:, :, :P], prefix_rows.prompt_mask,
                   dropout=dropout, scaling=scaling, **kwargs)  # (U, P, heads, D)
    tail, _ = sdpa(module, responses(query), with_prompt(key), with_prompt(value), prefix_rows.response_mask,
                   dropout=dropout, scaling=scaling, **kwargs)  # (U k, R, heads, D)
    return torch.cat([head, tail.unflatten(0, (U, k)).flatten(1, 2)], dim=1), None


PREFIX_ROWS_ATTENTION = "vlgrpo_prefix_rows_sdpa"
AttentionInterface.register(PREFIX_ROWS_ATTENTION, prefix_rows_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX_ROWS_ATTENTION, sdpa_mask)  # its masks are SDPA's

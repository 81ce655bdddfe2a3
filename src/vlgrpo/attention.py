"""vlgrpo's attention functions, registered with transformers under their own names.

- PACKED_VISION_ATTENTION: the vision tower's packed images (cu_seqlens) in one SDPA call
  (model.packed_vision_attention, Qwen2.5-VL's windowed tower).
- PREFIX_ROWS_ATTENTION: the language model's SDPA, which also attends a packed prefix row
  [prompt | response 1 | ... | response k] (policy._packed_prefix_hidden, the update under gradient
  checkpointing) segment by segment: the prompt attends to itself, each response to the prompt and to
  its own earlier tokens, so the pairs between responses are never computed. A call without the
  row's layout (every other forward) is transformers' SDPA as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Attention within packed segments in one SDPA call: each segment padded to the longest.

    query/key/value: (1, heads, S, D), S tokens of segments bounded by cu_seq_lens_q (n + 1,).
    Returns ((1, S, heads, D), None) as transformers' flash-attention functions do.
    """
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
                          prefix_rows: PrefixRows | None = None, **kwargs):
    """transformers' SDPA; over packed prefix rows (`prefix_rows` given) in two calls, the prompts and
    the responses, whose keys are each response's prompt and itself.

    query: (U, heads, L, D), key/value: (U, kv_heads, L, D), L = P + k R. Returns ((U, L, heads, D), None).
    """
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if prefix_rows is None:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
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

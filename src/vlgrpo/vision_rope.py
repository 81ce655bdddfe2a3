"""The vision tower's rotary embedding as one Triton kernel, forward and backward.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate each patch's queries and keys in float32
(transformers' apply_rotary_pos_emb_vision): a cast of the strided q and k out of the qkv GEMM's
output, rotate_half's negation and concatenation, two products, a sum and a cast back, ~14 kernels a
layer over (patches, heads, head_dim) float32 tensors. In the seed validation's prefill (601 images,
~0.9 M patches) the tower's elementwise kernels took 1.6 of its 4.0 s on an H100. Here one kernel
reads q and k from the qkv output in place and writes them rotated: the same float32 products and sum,
each rounded as PyTorch rounds it (no fused multiply-add), so the output and gradients are bit-equal
to transformers' (tests/test_vision_rope.py).

y = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1] on the halves of head_dim;
dx = g cos + rotate_half^T(g sin), rotate_half^T(z) = [z2, -z1].
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import get_max_seqlen, is_flash_attention_requested

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the towers rotate as transformers does
    triton = None

BLOCK_S = 16  # patches a program rotates

log = logging.getLogger(__name__)

if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, patches, heads, x_row, x_part, x_head, out_row, out_part, out_head,
                     cs_row, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BACKWARD: tl.constexpr):
        part_head = tl.program_id(1)  # q or k (part), and head
        part, head = part_head // heads, part_head % heads
        s = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)[:, None]  # (BLOCK_S, 1) patches
        d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D) places in the head
        partner = (d + D // 2) % D  # what rotate_half moves to d
        inside = (s < patches) & (d < D)
        x = x_ptr + part * x_part + head * x_head + s * x_row
        val = tl.load(x + d, mask=inside, other=0.0).to(tl.float32)
        other = tl.load(x + partner, mask=inside, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + s * cs_row + d, mask=inside, other=0.0)
        sin = tl.load(sin_ptr + s * cs_row + (partner if BACKWARD else d), mask=inside, other=0.0)
        turned = other * sin
        negative = (d >= D // 2) if BACKWARD else (d < D // 2)  # where rotate_half (or its transpose) negates
        out = val * cos + tl.where(negative, -turned, turned)
        tl.store(out_ptr + part * out_part + head * out_head + s * out_row + d, out.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, backward: bool) -> None:
    """Rotate x (patches, parts, heads, D) into out (the same shape; strided, unit stride in D)."""
    patches, parts, heads, dim = x.shape
    grid = (triton.cdiv(patches, BLOCK_S), parts * heads)
    _rope_kernel[grid](x, cos, sin, out, patches, heads, *x.stride()[:3], *out.stride()[:3], cos.stride(0), D=dim,
                       BLOCK_D=triton.next_power_of_2(dim), BLOCK_S=BLOCK_S, BACKWARD=backward, num_warps=4,
                       enable_fp_fusion=False)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        """qkv: (patches, 3, heads, D), the qkv GEMM's output; cos/sin: (patches, D) float32.
        Returns q and k rotated, (patches, heads, D) each, contiguous, in qkv's dtype."""
        patches, _, heads, dim = qkv.shape
        out = qkv.new_empty(2, patches, heads, dim)  # q and k each contiguous, as transformers' are
        _launch(qkv[:, :2], cos, sin, out.transpose(0, 1), backward=False)
        ctx.save_for_backward(cos, sin)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        patches, heads, dim = grad_q.shape
        grad = grad_q.new_empty(patches, 3, heads, dim)
        grad[:, 2].zero_()  # v's gradient reaches qkv through its own view
        for part, g in enumerate((grad_q, grad_k)):
            g = g if g.stride(-1) == 1 else g.contiguous()
            _launch(g[:, None], cos, sin, grad[:, part:part + 1], backward=True)
        return grad, None, None


@functools.cache
def serves(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the kernel can rotate here (a GPU, or Triton's interpreter: TRITON_INTERPRET=1); on a
    GPU, says why not once."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    reason = ("Triton is not installed" if triton is None
              else f"it takes bf16 or fp16, not {dtype}" if dtype not in (torch.bfloat16, torch.float16) else None)
    if reason:
        log.info("model.fused_vision_rope: the vision tower rotates as transformers does: the kernel does not serve (%s)", reason)
    return reason is None


def rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_pos_emb_vision of the q and k in `qkv` (patches, 3, heads, D): -> q, k (patches, heads, D)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("the fused vision rope takes cos and sin as constants (the tower computes them from a buffer)")
    return _Rope.apply(qkv, cos.float().contiguous(), sin.float().contiguous())


def fused_rope_attention(attn, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, position_embeddings=None,
                         max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
    """The towers' VisionAttention forward (qkv, num_heads, scaling, proj, config) with q and k rotated
    by rotate_qk; bound to each such module by policy.set_fused_vision_rope. The attention after it is
    the module's own: one call over the packed images for flash-style implementations, else one a segment.

    hidden_states: (patches, hidden); cu_seqlens: (images or windows + 1,) segment bounds.
    """
    patches = hidden_states.shape[0]
    qkv = attn.qkv(hidden_states).view(patches, 3, attn.num_heads, -1)  # (S, 3, heads, D)
    q, k = rotate_qk(qkv, *position_embeddings)  # (S, heads, D) each
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, qkv[:, 2]))  # (1, heads, S, D)
    eager = sys.modules[type(attn).__module__].eager_attention_forward  # the family's own, as its forward falls back to
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    common = {"attention_mask": None, "scaling": attn.scaling, "is_causal": False,
              "dropout": attn.attention_dropout if attn.training else 0.0}
    if is_flash_attention_requested(attn.config):
        longest = get_max_seqlen(cu_seqlens, attn.config, kwargs={"max_seqlen": max_seqlen})
        out = attention(attn, q, k, v, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest,
                        max_length_k=longest, **common, **kwargs)[0]
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        out = torch.cat([attention(attn, *parts, **common, **kwargs)[0]
                         for parts in zip(*(x.split(lengths, dim=2) for x in (q, k, v)))], dim=1)
    return attn.proj(out.reshape(patches, -1).contiguous())

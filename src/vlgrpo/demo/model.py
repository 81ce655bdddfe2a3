"""The demo's tiny Qwen2.5-VL: the real Qwen2_5_VLForConditionalGeneration at a few hundred thousand parameters.

Shapes follow Qwen2.5-VL-3B's config scaled down (cfg["demo"] sizes); what ties the model to the
tokenizer (vocabulary size, image/video/vision token ids, bos/eos) is read from the tokenizer, so
the two always agree.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from vlgrpo.demo.processor import EOS_TOKEN, PAD_TOKEN

ROPE_THETA = 1_000_000.0  # Qwen2.5-VL's text rope base
VISION_PATCH_SIZE = 14  # Qwen2.5-VL's vision tower works on 14 px patches, merged 2 x 2 into one token
VISION_WINDOW_SIZE = 112
VISION_TOKENS_PER_SECOND = 2


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies into (temporal, height, width) as Qwen does ([16, 24, 24] for 128)."""
    if head_dim % 2:
        raise ValueError(f"text head dim {head_dim} must be even for rotary embeddings")
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def full_attention_blocks(depth: int) -> list[int]:
    """Vision blocks with full (not windowed) attention: every 8th and the last, as in Qwen2.5-VL (7, 15, 23, 31)."""
    return [i for i in range(depth) if i % 8 == 7 or i == depth - 1]


def tiny_config(demo: dict, tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """A Qwen2_5_VLConfig with cfg["demo"] sizes and the token ids of `tokenizer`."""
    hidden, heads, kv_heads = demo["text_hidden_size"], demo["text_heads"], demo["text_kv_heads"]
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"demo.text_hidden_size ({hidden}) must be divisible by demo.text_heads ({heads}), "
            f"and text_heads by demo.text_kv_heads ({kv_heads})"
        )
    if demo["vision_hidden_size"] % demo["vision_heads"]:
        raise ValueError(
            f"demo.vision_hidden_size ({demo['vision_hidden_size']}) must be divisible by "
            f"demo.vision_heads ({demo['vision_heads']})"
        )
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": demo["text_intermediate_size"],
            "num_hidden_layers": demo["text_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_window_layers": demo["text_layers"],
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": mrope_section(hidden // heads),
                "rope_theta": ROPE_THETA,
            },
            "bos_token_id": ids(PAD_TOKEN),
            "eos_token_id": ids(EOS_TOKEN),
        },
        vision_config={
            "depth": demo["vision_depth"],
            "hidden_size": demo["vision_hidden_size"],
            "intermediate_size": demo["vision_intermediate_size"],
            "num_heads": demo["vision_heads"],
            "out_hidden_size": hidden,
            "patch_size": VISION_PATCH_SIZE,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": VISION_WINDOW_SIZE,
            "fullatt_block_indexes": full_attention_blocks(demo["vision_depth"]),
            "tokens_per_second": VISION_TOKENS_PER_SECOND,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
        dtype="float32",
    )


def generation_config(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Qwen2.5-VL's stop and pad tokens (eos = <|im_end|> or <|endoftext|>); sampling is left to the caller."""
    pad, eos = tokenizer.convert_tokens_to_ids(PAD_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=[eos, pad])


def init_model(demo: dict, tokenizer: Qwen2Tokenizer, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """A freshly initialised tiny Qwen2.5-VL in float32; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(demo, tokenizer))
    model.generation_config = generation_config(tokenizer)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied input/output embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())

"""The demo's tokenizer and processor: a small BPE learnt from the synthetic corpus, dressed as Qwen2.5-VL's.

The tokenizer is transformers' own Qwen2Tokenizer (Qwen's NFC normalizer, pre-tokenizer regex and
byte-level BPE) with a vocabulary learnt from the demo's texts instead of Qwen's 151k tokens. It has
Qwen2.5-VL's special tokens in Qwen's order after the ordinary vocabulary, Qwen's eos/pad tokens
and Qwen's chat template, so everything downstream handles it exactly like the real processor.
The <think>/<answer> tags stay ordinary text (Qwen's tokenizer splits them too): were they special,
decoding with skip_special_tokens would strip them and the format reward would always be 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2_5_VLProcessor, Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

# Qwen2.5-VL's special tokens, in the order of their ids there (151643..151656).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen/Qwen2.5-VL-3B-Instruct's chat_template.json, verbatim (a test compares it with the original).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = "
    "image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content "
    "%}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value "
    "}}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ "
    "content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt "
    "%}<|im_start|>assistant\n{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn a byte-level BPE with Qwen's normalizer and pre-tokenizer on `texts`.

    vocab_size counts the special tokens too, so the final tokenizer has about that many entries.
    Special tokens occurring in `texts` are cut out before training, never merged into words.
    Returns (vocab: token -> id, ordinary tokens only; merges in order).
    """
    n_ordinary = vocab_size - len(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if n_ordinary < len(alphabet):
        raise ValueError(
            f"demo.vocab_size={vocab_size} is too small: the byte alphabet ({len(alphabet)}) and the "
            f"{len(SPECIAL_TOKENS)} special tokens need at least {len(alphabet) + len(SPECIAL_TOKENS)}"
        )
    qwen = Qwen2Tokenizer(vocab={PAD_TOKEN: 0}, merges=[]).backend_tokenizer
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = qwen.normalizer
    tokenizer.pre_tokenizer = qwen.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=n_ordinary, initial_alphabet=alphabet, min_frequency=2, show_progress=False
    )
    # The trainer does not cut out added tokens itself: split the texts at them.
    special = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    tokenizer.train_from_iterator((piece for text in texts for piece in special.split(text) if piece), trainer)
    learnt = json.loads(tokenizer.to_str())["model"]
    ordinary = sorted((i, t) for t, i in learnt["vocab"].items() if t not in SPECIAL_TOKENS)
    vocab = {t: new_id for new_id, (_, t) in enumerate(ordinary)}
    return vocab, [tuple(m) for m in learnt["merges"]]


def build_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer over `vocab` + `merges` with Qwen2.5-VL's special tokens after the vocab."""
    full = dict(vocab)
    for token in SPECIAL_TOKENS:
        full[token] = len(full)
    return Qwen2Tokenizer(
        vocab=full,
        merges=list(merges),
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t != PAD_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,  # the text model's max_position_embeddings (Qwen2_5_VLTextConfig's default)
    )


def build_processor(tokenizer: Qwen2Tokenizer, min_pixels: int, max_pixels: int) -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL's processor around `tokenizer`, with the real Qwen2-VL image processor at small pixel bounds."""
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        chat_template=CHAT_TEMPLATE,
    )

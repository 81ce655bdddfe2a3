"""Make the demo's model folder: tokenizer, processor, tiny Qwen2.5-VL, perception and text warm-ups, save_pretrained.

The folder loads exactly like Qwen/Qwen2.5-VL-3B-Instruct (AutoProcessor,
AutoModelForImageTextToText), so the trainer, the evaluator and the rollout engine take no
special path for the demo.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from vlgrpo import atomic
from vlgrpo.data.images import decode_image, image_factor, image_tokens, processor_pixel_bounds, resize_image
from vlgrpo.data.prompts import render_prompt
from vlgrpo.demo.model import count_parameters, init_model
from vlgrpo.demo.perception import warm_up_vision
from vlgrpo.demo.processor import build_processor, build_tokenizer, train_bpe
from vlgrpo.demo.responses import warmup_response
from vlgrpo.demo.task import STREAMS, make_rows
from vlgrpo.demo.warmup import warm_up

# The warm-up's response texts and batch draws get their own stream, apart from the figures'.
_WARMUP_TEXT_STREAM = (STREAMS["warmup"], 1)


def make_model(cfg: dict, out_dir: Path) -> dict:
    """Build, warm up and save the demo model and processor into `out_dir` (replaced atomically).

    Everything is a function of cfg["seed"], cfg["demo"] and cfg["data"] (pixel bounds, format
    template). Returns stats: parameter count, tokenizer size, image tokens per image, warm-up
    losses and seconds.
    """
    start = time.perf_counter()
    demo, data, seed = cfg["demo"], cfg["data"], cfg["seed"]
    template = data["format_prompt"]
    out_dir = Path(out_dir)

    figures = make_rows(seed, "warmup", demo["warmup_images"], demo["image_size"])
    rng = np.random.default_rng([seed, *_WARMUP_TEXT_STREAM])

    # The BPE learns from the prompts as the chat template renders them (the text does not depend on
    # the vocabulary, so a tokenizer with special tokens only renders it) and from warm-up responses.
    bootstrap = build_processor(build_tokenizer({}, []), data["min_pixels"], data["max_pixels"])
    prompts = [render_prompt(bootstrap, row["problem"], template) for row in figures]
    responses = [warmup_response(rng, template, demo["warmup_format_fraction"]) for _ in figures]
    vocab, merges = train_bpe(prompts + responses, demo["vocab_size"])
    processor = build_processor(build_tokenizer(vocab, merges), data["min_pixels"], data["max_pixels"])
    pixels = processor_pixel_bounds(processor)

    rows = [
        {
            "prompt": prompt,
            "images": [resize_image(decode_image(image), data["min_pixels"], data["max_pixels"], pixels, image_factor(processor)) for image in row["images"]],
        }
        for prompt, row in zip(prompts, figures)
    ]
    model = init_model(demo, processor.tokenizer, seed)
    perception = warm_up_vision(model, processor, [row["images"][0] for row in rows], demo, rng)
    # The text warm-up keeps the tower as perception left it: its targets ignore the image.
    model.model.visual.requires_grad_(False)
    warmup = warm_up(model, processor, rows, demo, template, rng)
    model.model.visual.requires_grad_(True)

    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    atomic.replace_dir(tmp, out_dir)

    image = rows[0]["images"][0]
    return {
        "out_dir": str(out_dir),
        "parameters": count_parameters(model),
        "tokenizer_size": len(processor.tokenizer),
        "image_size": [image.width, image.height],
        "image_tokens_per_image": image_tokens(image, image_factor(processor)),
        "perception_warmup": perception,
        "warmup": warmup,
        "seconds": round(time.perf_counter() - start, 3),
    }

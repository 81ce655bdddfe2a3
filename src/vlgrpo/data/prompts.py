"""Prompts as EasyR1 renders them: format template, chat template, token counts, model inputs.

EasyR1 (verl/utils/dataset.py, RLHFDataset) renders the stripped Jinja format prompt with the
problem as `content`, splits the text on "<image>" (a video row: on "<video>") into image (video)
and text content parts of one user turn, and applies the processor's chat template with the
generation prompt (the template's default system turn included); the processor then expands each
image and video placeholder to its tokens.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import torch
from PIL import Image
from transformers import BatchFeature, ProcessorMixin

from vlgrpo.data.images import ResizeMismatchError, check_image_grid, decode_images, image_factor, image_tokens
from vlgrpo import models
from vlgrpo.data.videos import VIDEO_PLACEHOLDER, Video, fetch, second_per_grid_ts, video_tokens
from vlgrpo.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
TEMPLATE_DIR = Path(__file__).parents[1] / "templates"


@functools.lru_cache(maxsize=16)
def format_template(template: str) -> jinja2.Template:
    """Compiled format template: a built-in name (templates/<name>.jinja) or a .jinja file path.

    Raises DataError for an unknown name, a syntax error, or a template that drops `content`.
    """
    names = sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))
    path = TEMPLATE_DIR / f"{template}.jinja" if template in names else Path(template).expanduser()
    if not path.is_file():
        raise DataError(f"format prompt {template!r}: not one of {names} and no such .jinja file")
    # EasyR1 strips the template text, so a trailing newline in the file does not reach the prompt.
    source = path.read_text(encoding="utf-8").strip()
    env = jinja2.Environment()
    try:
        variables = jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"format prompt {path}: Jinja syntax error on line {e.lineno}: {e.message}") from e
    if "content" not in variables:
        raise DataError(f"format prompt {path} never uses {{{{ content }}}}, so the problem would be lost")
    return env.from_string(source)


def format_prompt(problem: str, template: str) -> str:
    """The problem wrapped in the format template ('r1v', 'math', or a .jinja path) as `content`."""
    return format_template(template).render(content=problem)


_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def chat_messages(prompt: str) -> list[dict[str, Any]]:
    """One user turn whose content alternates text parts and image (video) parts where "<image>"
    ("<video>") stood."""
    parts: list[dict[str, Any]] = []
    for piece in _PLACEHOLDERS.split(prompt):
        if piece in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
            parts.append({"type": "image" if piece == IMAGE_PLACEHOLDER else "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts}]


def render_prompt(processor: ProcessorMixin, problem: str, template: str, vision: bool = True) -> str:
    """The chat-template text the model is prompted with (the template's default system turn,
    the user turn with vision placeholders, then the assistant generation prompt).

    vision=False (a dataset without an image or video column): as EasyR1, the user turn is the plain
    text through the tokenizer's chat template.
    """
    if not vision:
        messages = [{"role": "user", "content": format_prompt(problem, template)}]
        return models.tokenizer(processor).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    messages = chat_messages(format_prompt(problem, template))
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def count_prompt_tokens(processor: ProcessorMixin, prompt: str, images: list[Image.Image], videos: list[Video] = ()) -> int:
    """Tokens of `prompt` once the processor expands its image and video placeholders, without pixel
    work for the images.

    The processor replaces each <|image_pad|> with one token per 2x2 patch group of its image; the
    tokenizer and the image processor's own patch count give the same total (the filter checks this
    against a full processor call on a sample of rows). Each <|video_pad|> becomes its video's tokens
    (videos.video_tokens: the video processor's grid). Raises ResizeMismatchError if the processor
    would resize an image, ValueError if placeholders and images or videos disagree. A text-only
    model's processor is its tokenizer: the count is its tokens, as EasyR1 counts them.
    """
    ids = models.tokenizer(processor)(prompt, add_special_tokens=False)["input_ids"]
    if not models.takes_images(processor):
        return len(ids)
    image_processor = processor.image_processor
    placeholders = ids.count(processor.image_token_id)
    if placeholders != len(images):
        raise ValueError(f"{placeholders} image placeholders in the prompt for {len(images)} images")
    video_placeholders = ids.count(processor.video_token_id)
    if video_placeholders != len(videos):
        raise ValueError(f"{video_placeholders} video placeholders in the prompt for {len(videos)} videos")
    per_image = [
        image_processor.get_number_of_image_patches(im.height, im.width, {}) // image_processor.merge_size**2
        for im in images
    ]
    expected = [image_tokens(im, image_factor(processor)) for im in images]
    if per_image != expected:
        raise ResizeMismatchError(
            f"the processor would resize images (tokens {per_image}, expected {expected}): its pixel "
            "bounds differ from the ones the images were sized with"
        )
    return len(ids) - placeholders + sum(per_image) - video_placeholders + sum(video_tokens(processor, list(videos)))


def fetch_videos(rows: list[dict[str, Any]]) -> list[list[Video]]:
    """Each row's videos (its "videos" specs, none for a row without), fetched by qwen-vl-utils."""
    return [[fetch(spec) for spec in row.get("videos") or ()] for row in rows]


def encode_prompts(
    processor: ProcessorMixin, rows: list[dict[str, Any]], device: str | torch.device | None = None,
    videos: list[list[Video]] | None = None,
) -> BatchFeature:
    """Left-padded model inputs for a batch of filtered rows (B rows, L = longest prompt).

    Returns input_ids and attention_mask (B, L), pixel_values (sum of h*w/196 patches, 1176),
    image_grid_thw (n_images, 3), and mm_token_type_ids (B, L) where the processor makes them;
    rows may be text-only (no images): without any image there are no pixel_values or grids.
    Rows with videos add pixel_values_videos, video_grid_thw (n_videos, 3) and, where the processor
    takes them, second_per_grid_ts (n_videos,) as EasyR1 sets them; videos: the rows' videos
    already fetched (fetch_videos), else they are fetched here.
    device: where the image processor normalizes and patchifies the images (its torchvision
    backend moves each uint8 image there first): pixel_values come back on it, everything else
    stays on the CPU for host code (PromptBatch row slicing, the rope index). None: the CPU, as
    the processor does by default (identical tensors to device="cpu").
    Raises ResizeMismatchError if the processor would resize an image (its pixel bounds differ from
    the ones the filter used).
    """
    if not rows:
        raise ValueError("encode_prompts needs at least one row")
    images = [im for row in rows for im in row["images"]]  # in prompt order: the processor fills placeholders so
    decode_images(images)
    vision = models.takes_images(processor)  # else a text-only model's tokenizer
    clips = [v for row in (fetch_videos(rows) if videos is None else videos) for v in row]
    if (images or clips) and not vision:  # never trained as text: the filter drops such rows for a text-only model
        raise DataError(f"{len(images)} images and {len(clips)} videos in rows given to a text-only model "
                        f"({type(processor).__name__}): filter the split with this model.path (it drops them as 'text_only_model')")
    inputs = processor(
        text=[row["prompt"] for row in rows],
        **({"images": images or None, "videos": [v.frames for v in clips] or None} if vision else {}),  # text-only rows have none
        padding=True,
        padding_side="left",
        add_special_tokens=False,
        return_tensors="pt",
        **({} if device is None or not vision else {"device": device}),
    )
    if images:
        check_image_grid(images, inputs["image_grid_thw"], processor.image_processor.patch_size)
    if clips:  # EasyR1's value: the fps qwen-vl-utils sampled at, not the processor's default
        seconds = second_per_grid_ts(processor, clips)
        inputs.pop("second_per_grid_ts", None)
        if seconds is not None:
            inputs["second_per_grid_ts"] = seconds
    return inputs

"""Image sizing for Qwen vision-language models as EasyR1 does it, and the image plumbing around it.

EasyR1 (verl/utils/dataset.py, process_image) scales an image above max_pixels down and one below
min_pixels up (int sizes, PIL's default filter), converts it to RGB, and hands it to a processor
loaded with the model's own pixel bounds (preprocessor_config.json; 3136..12845056 for
Qwen2.5-VL), whose smart_resize snaps each side to a multiple of the image factor (patch_size x
merge_size: 28 for Qwen2/2.5-VL's 14-pixel patches merged 2x2, 32 for Qwen3-VL/3.5's 16-pixel ones;
`image_factor` reads it from the processor, models.Family says which a family needs).
With those wide bounds the snap rounds each side to the nearest multiple, so the result may land a
row or column outside [min_pixels, max_pixels]; that is EasyR1's prompt, so it is ours.

`model_image_size` is that rule, the one place image sizes are decided; `resize_image` resizes once
to its result, so the processor (the same bounds) leaves the image unchanged and an h x w image is
(h/factor)*(w/factor) image tokens. One resize instead of EasyR1's two (PIL, then the processor's own) gives
the same size and so the same tokens; the pixels differ by resampling only.
"""

from __future__ import annotations

import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image
from transformers import ProcessorMixin
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from vlgrpo.errors import VlgrpoError

DECODE_THREADS = 8  # PNG decoding releases the GIL: threads run it in parallel


class ResizeMismatchError(VlgrpoError, ValueError):
    """The processor would resize images already sized: its pixel bounds differ from the filter's."""


def processor_pixel_bounds(processor: ProcessorMixin) -> tuple[int, int]:
    """The processor's own (min_pixels, max_pixels), the bounds its smart_resize snaps with; (0, 0) for a
    text-only model's tokenizer (no images)."""
    if getattr(processor, "image_processor", None) is None:
        return 0, 0
    size = processor.image_processor.size
    return size.shortest_edge, size.longest_edge


def image_factor(processor: ProcessorMixin) -> int:
    """Pixels per image-token side: patch_size x merge_size of the processor's image processor."""
    return processor.image_processor.patch_size * processor.image_processor.merge_size


def model_image_size(
    width: int, height: int, min_pixels: int, max_pixels: int, processor_pixels: tuple[int, int], factor: int
) -> tuple[int, int]:
    """(width, height) the model sees for an image of `width` x `height`, by EasyR1's rule.

    min_pixels, max_pixels: the configured bounds (data.min_pixels / max_pixels); the image is
    scaled into them by sqrt of the area ratio, each side truncated to int, down first, then up.
    processor_pixels: the processor's own (min, max) bounds (`processor_pixel_bounds`); the scaled
    size is snapped to multiples of `factor` (image_factor) with them, as EasyR1's processor does.
    Raises ValueError for an aspect ratio over 200, a side that scales to 0, or a snapped size the
    processor would snap again (it would then resize an image that is already sized).
    """
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < min_pixels:
        scale = math.sqrt(min_pixels / max(width * height, 1))
        width, height = int(width * scale), int(height * scale)
    if min(width, height) < 1:
        raise ValueError(f"image of {width}x{height} pixels after scaling into [{min_pixels}, {max_pixels}]")
    low, high = processor_pixels
    snapped_height, snapped_width = smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
    if smart_resize(snapped_height, snapped_width, factor=factor, min_pixels=low, max_pixels=high) != (
        snapped_height,
        snapped_width,
    ):
        raise ValueError(
            f"a {width}x{height} image snaps to {snapped_width}x{snapped_height}, which the processor's "
            f"pixel bounds [{low}, {high}] would snap again"
        )
    return snapped_width, snapped_height


def resize_image(
    image: Image.Image, min_pixels: int, max_pixels: int, processor_pixels: tuple[int, int], factor: int
) -> Image.Image:
    """`image` resized to `model_image_size` and converted to RGB (see the module doc).

    Resizing happens in the source mode with PIL's default filter and RGB conversion after it, as in
    EasyR1 (alpha is dropped, not composited). An RGBA image with opaque alpha is converted first:
    the same pixels, resized faster.
    """
    size = model_image_size(image.width, image.height, min_pixels, max_pixels, processor_pixels, factor)
    if image.mode == "RGBA" and image.getchannel("A").getextrema() == (255, 255):
        image = image.convert("RGB")
    if image.size != size:
        image = image.resize(size)
    return image if image.mode == "RGB" else image.convert("RGB")


def image_tokens(image: Image.Image, factor: int) -> int:
    """Image tokens of a sized image (sides multiples of `factor`): one per factor x factor pixels."""
    return (image.width // factor) * (image.height // factor)


def decode_image(value: Any) -> Image.Image:
    """A loaded PIL image from a {bytes, path} struct, raw bytes, a file path or a PIL image.

    Raises LookupError when there is nothing to decode and ValueError when decoding fails.
    """
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        if not Path(value).is_file():
            raise LookupError(f"image file not found: {value}")
        source: Any = value
    elif isinstance(value, (bytes, bytearray)) and value:
        source = io.BytesIO(value)
    else:
        raise LookupError("no image bytes or path")
    try:
        image = Image.open(source)
        image.load()  # decode now: a broken file fails here, not in a later stage
    except Exception as e:  # PIL raises OSError, SyntaxError, DecompressionBombError, ... on bad data
        raise ValueError(f"cannot decode image: {type(e).__name__}: {e}") from e
    return image


def png_struct(image: Image.Image) -> dict[str, Any]:
    """`image` as a datasets Image struct holding PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # lossless; level 1 is ~2x faster than 6, ~10% larger
    return {"bytes": buffer.getvalue(), "path": None}


def open_rgb(png: bytes) -> Image.Image:
    """An RGB image opened lazily from encoded bytes (decoded on first use)."""
    image = Image.open(io.BytesIO(png))
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_images(images: list[Image.Image]) -> None:
    """Decode lazily opened images (load_filtered's) on several threads, in place.

    The processor would decode them one by one; PIL releases the GIL while decoding, so threads
    overlap (601 Geometry3K test images: 1.9 s on one thread and 1.1 s on two of a shared 2-core
    host, 0.34 s on 8 of the H200 host's 16). load() of an image already decoded returns at once.
    """
    workers = min(DECODE_THREADS, os.cpu_count() or 1, len(images))
    if workers < 2:
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda image: image.load(), images))  # list(): a decoding error is raised here


def check_image_grid(images: list[Image.Image], image_grid_thw, patch: int) -> None:
    """Raise if the processor resized an image: each grid must be (1, h/patch, w/patch) of the image."""
    expected = [[1, im.height // patch, im.width // patch] for im in images]
    got = [list(map(int, g)) for g in image_grid_thw]
    if got != expected:
        raise ResizeMismatchError(
            f"the processor resized images (grids {got}, expected {expected}): its pixel bounds "
            "differ from the ones the images were sized with"
        )

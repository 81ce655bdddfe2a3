"""Prompts and images for GRPO on a vision-language model: load, render, resize, filter, encode.

One rendering path for every stage, the one EasyR1's RLHFDataset uses: the Jinja format prompt is
applied to the problem, the text is split on "<image>" into image and text content parts, and the
processor's chat template renders them with the generation prompt. `filter_split` does this once,
resizes the images once, counts tokens through the processor and stores prompt + images, so the
trainer and the evaluator read the filtered parquet (`load_filtered` + `encode_prompts`) and never
render or resize again.

Image sizes: EasyR1 scales an image above max_pixels down and one below min_pixels up (int sizes,
PIL's default filter), and the processor then snaps it to multiples of 28 (14-pixel patches merged
2x2) with smart_resize. `resized_size` composes the two and `resize_image` resizes once to the
result, so the processor receives an image it leaves unchanged and an h x w image becomes
(h/28)*(w/28) image tokens. One deliberate difference: EasyR1 loads its processor with the model's
own wide pixel bounds, so its snap only rounds and may land a 28-pixel row or column outside
[min_pixels, max_pixels]; here every engine's processor gets the configured bounds, so images stay
inside them (on Geometry3K at 262144..524288: 12 more prompt tokens on average than EasyR1 logs).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import multiprocessing
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import jinja2
import jinja2.meta
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from transformers import AutoProcessor, BatchFeature, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from vlgrpo import atomic
from vlgrpo.errors import VlgrpoError

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
TEMPLATE_DIR = Path(__file__).with_name("templates")
# Qwen2.5-VL: 14-pixel patches, merged 2x2 into one token, so sizes snap to multiples of 28.
IMAGE_FACTOR = 28
MODEL_TYPES = ("qwen2_5_vl",)

# Why a row is dropped; a dropped row counts under the first check it fails.
DROP_REASONS = (
    "problem_empty",
    "answer_empty",
    "image_missing",
    "no_image_placeholder",
    "more_placeholders_than_images",
    "fewer_placeholders_than_images",
    "image_undecodable",
    "image_size_unsupported",
    "processor_error",
    "prompt_too_long",
)
DROPPED_ROWS_LISTED = 20  # source indices listed per reason in the stats, to trace drops

OUTPUT_FEATURES = datasets.Features(
    {
        "index": datasets.Value("int64"),
        "images": datasets.List(datasets.Image()),
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "prompt": datasets.Value("string"),
        "prompt_length": datasets.Value("int64"),
    }
)

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_HUB_SPLIT = re.compile(r"[\w.-]+(\[[^\]]*\])?")  # "train", "test[:100]"


class DataError(VlgrpoError, ValueError):
    """Unusable data, template or model folder; the message names the problem."""


class ResizeMismatchError(VlgrpoError, ValueError):
    """The processor would resize images already resized: its pixel bounds differ from the data's."""


# ---------------------------------------------------------------------------------------------
# Sources: datasets and the processor


def _looks_local(spec: str) -> bool:
    """A string shaped like a file path rather than a hub id ('name' or 'owner/name')."""
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".parquet") or spec.count("/") > 1


def _parse_source(spec: str) -> list[Path] | tuple[str, str]:
    """Parquet files of a local file/folder spec, or (hub id, split) of 'owner/name@split'."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"bad data spec {spec!r}: expected 'owner/name@split' or a parquet file or folder")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".parquet":
            raise DataError(f"{spec}: not a .parquet file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise DataError(f"{spec}: folder holds no *.parquet files")
        return files
    if _looks_local(spec):
        raise FileNotFoundError(f"data file or folder not found: {spec}")
    name, at, split = spec.rpartition("@")
    if not at or not _HUB_ID.fullmatch(name) or not _HUB_SPLIT.fullmatch(split):
        raise DataError(
            f"bad data spec {spec!r}: expected a hub id with a split ('hiyouga/geometry3k@train') "
            "or an existing parquet file or folder"
        )
    return name, split


def load_split(spec: str, image_key: str, prompt_key: str, answer_key: str) -> datasets.Dataset:
    """Load one split: 'owner/name@split' from the hub, or a local parquet file or folder of them.

    Raises FileNotFoundError for a missing local path and DataError for a bad spec, an unreadable
    source, or a missing column (naming it and the columns there are).
    """
    source = _parse_source(spec)
    try:
        if isinstance(source, list):
            ds = datasets.load_dataset("parquet", data_files=[str(f) for f in source], split="train")
        else:
            ds = datasets.load_dataset(source[0], split=source[1])
    except Exception as e:  # any loader failure: say which spec and why
        raise DataError(f"cannot load data {spec!r}: {type(e).__name__}: {e}") from e
    missing = [k for k in (image_key, prompt_key, answer_key) if k not in ds.column_names]
    if missing:
        raise DataError(
            f"{spec}: missing column(s) {', '.join(map(repr, missing))}; the columns there are "
            f"{', '.join(map(repr, ds.column_names))} (set data.image_key / prompt_key / answer_key)"
        )
    return ds


def _json_has_key(path: Path, key: str) -> bool:
    try:
        return path.is_file() and key in json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def check_model_folder(folder: str | os.PathLike) -> None:
    """Raise unless `folder` holds a Qwen2.5-VL config, image processor, tokenizer and chat template.

    Both layouts count: the released one (preprocessor_config.json, vocab.json + merges.txt or
    tokenizer.json, chat_template.json) and the one transformers 5 saves (processor_config.json with
    'image_processor', tokenizer.json, chat_template.jinja). Weights are the trainer's to check.
    """
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model path not found: {folder}")
    if not folder.is_dir():
        raise DataError(f"model path is not a folder: {folder}")
    problems = []
    config = folder / "config.json"
    if not config.is_file():
        problems.append("config.json")
    else:
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            model_type = "<unreadable config.json>"
        if model_type not in MODEL_TYPES:
            problems.append(f"a Qwen2.5-VL config (config.json has model_type {model_type!r}, expected {MODEL_TYPES[0]!r})")
    if not ((folder / "preprocessor_config.json").is_file() or _json_has_key(folder / "processor_config.json", "image_processor")):
        problems.append("an image processor config (preprocessor_config.json, or processor_config.json with 'image_processor')")
    if not ((folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))):
        problems.append("tokenizer files (tokenizer.json, or vocab.json + merges.txt)")
    if not (
        (folder / "chat_template.jinja").is_file()
        or (folder / "chat_template.json").is_file()
        or _json_has_key(folder / "tokenizer_config.json", "chat_template")
        or _json_has_key(folder / "processor_config.json", "chat_template")
    ):
        problems.append("a chat template (chat_template.jinja, chat_template.json, or 'chat_template' in tokenizer_config.json)")
    if problems:
        raise DataError(f"{folder} is not a Qwen2.5-VL model folder; missing " + "; ".join(problems))


def load_processor(model_path: str, min_pixels: int, max_pixels: int) -> ProcessorMixin:
    """The model's processor with the pixel bounds set at load time and left padding.

    transformers 5 ignores min/max_pixels set as attributes after loading, and `size=` is overridden
    by preprocessor_config.json, so the bounds go to from_pretrained and are checked afterwards.
    A local-looking path is checked first (`check_model_folder`); anything else is a hub id.
    """
    if _looks_local(model_path) or Path(model_path).expanduser().exists():
        check_model_folder(model_path)
        model_path = str(Path(model_path).expanduser())
    try:
        processor = AutoProcessor.from_pretrained(model_path, min_pixels=min_pixels, max_pixels=max_pixels)
    except OSError as e:
        raise DataError(f"model.path {model_path!r} is neither a local model folder nor a reachable hub id: {e}") from e
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or getattr(processor, "tokenizer", None) is None:
        raise DataError(f"{model_path}: loaded {type(processor).__name__}, not a vision-language processor")
    size = image_processor.size
    if (size.shortest_edge, size.longest_edge) != (min_pixels, max_pixels):
        raise DataError(
            f"{model_path}: processor pixel bounds are ({size.shortest_edge}, {size.longest_edge}) after "
            f"loading, not the requested ({min_pixels}, {max_pixels})"
        )
    factor = image_processor.patch_size * image_processor.merge_size
    if factor != IMAGE_FACTOR:
        raise DataError(f"{model_path}: image patch factor {factor} (patch_size * merge_size), expected {IMAGE_FACTOR}")
    processor.tokenizer.padding_side = "left"
    return processor


# ---------------------------------------------------------------------------------------------
# Prompts


@functools.lru_cache(maxsize=16)
def _template(template: str) -> jinja2.Template:
    """Compiled format template: a built-in name (templates/<name>.jinja) or a .jinja file path."""
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
    return _template(template).render(content=problem)


def chat_messages(prompt: str) -> list[dict[str, Any]]:
    """One user turn whose content alternates text and image parts where "<image>" stood."""
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(prompt.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def render_prompt(processor: ProcessorMixin, problem: str, template: str) -> str:
    """The chat-template text the model is prompted with (the template's default system turn,
    the user turn with vision placeholders, then the assistant generation prompt)."""
    messages = chat_messages(format_prompt(problem, template))
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------------------------------------
# Images


def resized_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) the model sees for an image of `width` x `height`.

    EasyR1's pre-scaling (down to max_pixels, then up to min_pixels, int sizes), then the processor's
    smart_resize to multiples of 28, repeated until smart_resize leaves it alone so the processor
    will not resize again. Raises ValueError for an aspect ratio over 200 or bounds too tight to
    hold a stable size.
    """
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < min_pixels:
        scale = math.sqrt(min_pixels / max(width * height, 1))
        width, height = int(width * scale), int(height * scale)
    if min(width, height) < 1:
        raise ValueError(f"image of {width}x{height} pixels after scaling into [{min_pixels}, {max_pixels}]")
    size = (height, width)
    for _ in range(4):
        snapped = smart_resize(size[0], size[1], factor=IMAGE_FACTOR, min_pixels=min_pixels, max_pixels=max_pixels)
        if snapped == size:
            return size[1], size[0]
        size = snapped
    raise ValueError(f"no size for a {width}x{height} image is stable under pixel bounds [{min_pixels}, {max_pixels}]")


def resize_image(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """`image` resized to `resized_size` and converted to RGB, the Qwen2.5-VL way (see module doc).

    Resizing happens in the source mode with PIL's default filter and RGB conversion after it, as in
    EasyR1 (alpha is dropped, not composited). An RGBA image with opaque alpha is converted first:
    the same pixels, resized faster.
    """
    size = resized_size(image.width, image.height, min_pixels, max_pixels)
    if image.mode == "RGBA" and image.getchannel("A").getextrema() == (255, 255):
        image = image.convert("RGB")
    if image.size != size:
        image = image.resize(size)
    return image if image.mode == "RGB" else image.convert("RGB")


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


def _png_struct(image: Image.Image) -> dict[str, Any]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # lossless; level 1 is ~2x faster than 6, ~10% larger
    return {"bytes": buffer.getvalue(), "path": None}


def _check_image_grid(images: list[Image.Image], image_grid_thw) -> None:
    """Raise if the processor resized an image: each grid must be (1, h/14, w/14) of the image."""
    patch = IMAGE_FACTOR // 2
    expected = [[1, im.height // patch, im.width // patch] for im in images]
    got = [list(map(int, g)) for g in image_grid_thw]
    if got != expected:
        raise ResizeMismatchError(
            f"the processor resized images (grids {got}, expected {expected}): its min/max_pixels "
            "differ from the ones the images were resized with"
        )


def count_prompt_tokens(processor: ProcessorMixin, prompt: str, images: list[Image.Image]) -> int:
    """Tokens of `prompt` once the processor expands its image placeholders, without pixel work.

    The processor replaces each <|image_pad|> with one token per 2x2 patch group of its image; the
    tokenizer and the image processor's own patch count give the same total (the filter checks this
    against a full processor call on a sample of rows). Raises ResizeMismatchError if the processor
    would resize an image, ValueError if placeholders and images disagree.
    """
    image_processor = processor.image_processor
    ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    placeholders = ids.count(processor.image_token_id)
    if placeholders != len(images):
        raise ValueError(f"{placeholders} image placeholders in the prompt for {len(images)} images")
    per_image = [
        image_processor.get_number_of_image_patches(im.height, im.width, {}) // image_processor.merge_size**2
        for im in images
    ]
    expected = [(im.height // IMAGE_FACTOR) * (im.width // IMAGE_FACTOR) for im in images]
    if per_image != expected:
        raise ResizeMismatchError(
            f"the processor would resize images (tokens {per_image}, expected {expected}): its "
            "min/max_pixels differ from the ones the images were resized with"
        )
    return len(ids) - placeholders + sum(per_image)


# ---------------------------------------------------------------------------------------------
# Filtering


@dataclass(frozen=True)
class _FilterSettings:
    image_key: str
    prompt_key: str
    answer_key: str
    template: str
    min_pixels: int
    max_pixels: int
    max_prompt_length: int
    drop_overlong: bool


class _Dropped(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _as_image_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _prepare_row(row: dict[str, Any], processor: ProcessorMixin, s: _FilterSettings, verify: bool) -> dict[str, Any]:
    """The kept output row for one source row, or raise _Dropped with the reason.

    With `verify`, the prompt also goes through the full processor call that training makes, and
    its token count and image grids must equal `count_prompt_tokens`' (else RuntimeError).
    """
    problem, answer = row[s.prompt_key], row[s.answer_key]
    if not isinstance(problem, str) or not problem.strip():
        raise _Dropped("problem_empty")
    if answer is None or not str(answer).strip():
        raise _Dropped("answer_empty")
    raw_images = _as_image_list(row[s.image_key])
    if not raw_images:
        raise _Dropped("image_missing")
    placeholders = problem.count(IMAGE_PLACEHOLDER)
    if placeholders == 0:
        raise _Dropped("no_image_placeholder")
    if placeholders > len(raw_images):
        raise _Dropped("more_placeholders_than_images", f"{placeholders} placeholders, {len(raw_images)} images")
    if placeholders < len(raw_images):
        raise _Dropped("fewer_placeholders_than_images", f"{placeholders} placeholders, {len(raw_images)} images")
    images = []
    for value in raw_images:
        try:
            image = decode_image(value)
        except LookupError as e:
            raise _Dropped("image_missing", str(e)) from e
        except ValueError as e:
            raise _Dropped("image_undecodable", str(e)) from e
        try:
            images.append(resize_image(image, s.min_pixels, s.max_pixels))
        except ValueError as e:
            raise _Dropped("image_size_unsupported", str(e)) from e
    prompt = render_prompt(processor, problem, s.template)
    try:
        prompt_length = count_prompt_tokens(processor, prompt, images)
        full = processor(images=images, text=[prompt], add_special_tokens=False) if verify else None
    except ResizeMismatchError:
        raise  # a setup error, not a bad row
    except Exception as e:  # a row the processor rejects must not stop the whole split
        raise _Dropped("processor_error", f"{type(e).__name__}: {e}") from e
    if full is not None:
        _check_image_grid(images, full["image_grid_thw"])
        if len(full["input_ids"][0]) != prompt_length:
            raise RuntimeError(f"counted {prompt_length} prompt tokens, the processor made {len(full['input_ids'][0])}")
    if s.drop_overlong and prompt_length > s.max_prompt_length:
        raise _Dropped("prompt_too_long", f"{prompt_length} > {s.max_prompt_length} tokens")
    return {
        "images": [_png_struct(im) for im in images],
        "problem": problem,
        "answer": str(answer),
        "prompt": prompt,
        "prompt_length": prompt_length,
    }


# State for worker processes, set in the parent before forking so that children inherit the
# processor (building its tokenizer takes seconds) and the memory-mapped dataset.
_WORKER_STATE: dict[str, Any] = {}


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core; also keeps OpenMP out of the forked child


def _filter_range(bounds: tuple[int, int]) -> list[tuple[int, dict | None, str | None, str]]:
    """(source index, kept row or None, drop reason or None, detail) for rows [start, stop)."""
    ds, processor, settings = _WORKER_STATE["ds"], _WORKER_STATE["processor"], _WORKER_STATE["settings"]
    start, stop = bounds
    rows = ds.with_format("arrow")[start:stop].to_pylist()  # raw image structs: we decode ourselves
    out = []
    for index, row in enumerate(rows, start):
        try:
            # The first row of each range is checked against the full processor call.
            out.append((index, _prepare_row(row, processor, settings, verify=index == start), None, ""))
        except _Dropped as d:
            out.append((index, None, d.reason, str(d)))
    return out


def _default_workers() -> int:
    """The CPUs this process may use, at most 16 (more gains little: the parent writes the output)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, 16)


def _filter_rows(ds: datasets.Dataset, processor: ProcessorMixin, settings: _FilterSettings, workers: int, chunk: int = 32):
    """Yield `_filter_range` results for all rows in source order, on `workers` forked processes."""
    ranges = [(i, min(i + chunk, len(ds))) for i in range(0, len(ds), chunk)]
    _WORKER_STATE.update(ds=ds, processor=processor, settings=settings)
    try:
        workers = min(workers, len(ranges))
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for bounds in ranges:
                yield from _filter_range(bounds)
            return
        with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
            for results in pool.imap(_filter_range, ranges):
                yield from results
    finally:
        _WORKER_STATE.clear()


def prompt_length_stats(lengths: list[int]) -> dict[str, float]:
    """min, mean, p50, p95, max of prompt lengths in tokens (linear-interpolated percentiles)."""
    a = np.asarray(lengths, dtype=np.float64)
    return {
        "min": int(a.min()),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "max": int(a.max()),
    }


def filter_split(
    cfg: dict, split: str, out_parquet: str | os.PathLike, out_stats: str | os.PathLike, workers: int | None = None
) -> dict:
    """Filter cfg["data"][split] ('train' or 'val') into a parquet of ready prompts and a stats JSON.

    Each row is rendered exactly as training will render it, its images resized once, and its
    prompt counted in tokens (image tokens included) through the processor (`count_prompt_tokens`,
    checked against the full processor call on the first row of every 32). Rows are dropped with a
    reason (DROP_REASONS) instead of failing; zero kept rows raise DataError. Output columns: index
    (row in the source), images (resized, PNG, list<struct<bytes, path>>), problem, answer, prompt,
    prompt_length. Both files are written atomically. `workers` processes (default: the CPUs
    available, at most 16) share the rows. Returns the stats dict written to `out_stats`.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = cfg["data"]
    settings = _FilterSettings(
        image_key=data["image_key"],
        prompt_key=data["prompt_key"],
        answer_key=data["answer_key"],
        template=data["format_prompt"],
        min_pixels=data["min_pixels"],
        max_pixels=data["max_pixels"],
        max_prompt_length=data["max_prompt_length"],
        drop_overlong=data["filter_overlong_prompts"],
    )
    batch_size = cfg["worker"]["rollout"]["batch_size"]
    # Fail on a bad model, template or source before any per-row work.
    processor = load_processor(cfg["model"]["path"], settings.min_pixels, settings.max_pixels)
    _template(settings.template)
    ds = load_split(data[split], settings.image_key, settings.prompt_key, settings.answer_key)

    kept: list[dict[str, Any]] = []
    dropped: Counter[str] = Counter()
    dropped_rows: dict[str, list[int]] = {}
    for index, row, reason, detail in _filter_rows(ds, processor, settings, workers or _default_workers()):
        if row is None:
            dropped[reason] += 1
            listed = dropped_rows.setdefault(reason, [])
            if len(listed) < DROPPED_ROWS_LISTED:
                listed.append(index)
            log.debug("%s row %d dropped: %s", data[split], index, detail)
        else:
            kept.append({"index": index, **row})
    if not kept:
        raise DataError(f"no usable rows in {data[split]!r} ({len(ds)} rows; dropped: {dict(dropped)})")

    stats = {
        "source": data[split],
        "rows_in": len(ds),
        "rows_kept": len(kept),
        "dropped": {reason: dropped[reason] for reason in DROP_REASONS},
        "dropped_rows": dropped_rows,
        "prompt_length": prompt_length_stats([r["prompt_length"] for r in kept]),
        "max_prompt_length": settings.max_prompt_length,
        "rollout_batch_size": batch_size,
        "steps_per_epoch": len(kept) // batch_size,  # drop_last
    }
    table = pa.Table.from_pylist(kept, schema=OUTPUT_FEATURES.arrow_schema)
    with atomic.replacing(out_parquet) as tmp:
        pq.write_table(table, tmp)
    atomic.write_text(out_stats, json.dumps(stats, indent=2) + "\n")
    log.info("%s: kept %d of %d rows, %d steps per epoch", data[split], len(kept), len(ds), stats["steps_per_epoch"])
    if split == "train" and not stats["steps_per_epoch"]:
        log.warning("%s: %d rows kept, fewer than one rollout batch of %d", data[split], len(kept), batch_size)
    return stats


# ---------------------------------------------------------------------------------------------
# Reading the filtered split


FILTERED_COLUMNS = ("index", "images", "problem", "answer", "prompt")


def load_filtered(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a parquet written by `filter_split`: index, prompt, images (PIL RGB), answer, problem.

    Images are opened lazily: each is decoded on first use.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"filtered data not found: {path} (run the filter_data stage)")
    table = pq.read_table(path)
    missing = [c for c in FILTERED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; not written by filter_split?")
    rows = table.select(list(FILTERED_COLUMNS)).to_pylist()
    for row in rows:
        row["images"] = [_open_rgb(image["bytes"]) for image in row["images"]]
    return rows


def _open_rgb(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    return image if image.mode == "RGB" else image.convert("RGB")


DECODE_THREADS = 8  # PNG decoding releases the GIL: threads run it in parallel


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


def encode_prompts(
    processor: ProcessorMixin, rows: list[dict[str, Any]], device: str | torch.device | None = None
) -> BatchFeature:
    """Left-padded model inputs for a batch of filtered rows (B rows, L = longest prompt).

    Returns input_ids and attention_mask (B, L), pixel_values (sum of h*w/196 patches, 1176),
    image_grid_thw (n_images, 3), and mm_token_type_ids (B, L) where the processor makes them.
    device: where the image processor normalizes and patchifies the images (its torchvision
    backend moves each uint8 image there first): pixel_values come back on it, everything else
    stays on the CPU for host code (PromptBatch row slicing, the rope index). None: the CPU, as
    the processor does by default (identical tensors to device="cpu").
    Raises ResizeMismatchError if the processor would resize an image (its pixel bounds differ from
    the ones the filter used).
    """
    if not rows:
        raise ValueError("encode_prompts needs at least one row")
    images = [row["images"] for row in rows]
    decode_images([im for row_images in images for im in row_images])
    inputs = processor(
        text=[row["prompt"] for row in rows],
        images=images,
        padding=True,
        padding_side="left",
        add_special_tokens=False,
        return_tensors="pt",
        **({} if device is None else {"device": device}),
    )
    _check_image_grid([im for row_images in images for im in row_images], inputs["image_grid_thw"])
    return inputs

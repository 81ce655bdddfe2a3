"""The filter stage: every row rendered, sized and counted once, kept or dropped with a reason.

`filter_split` writes a parquet of ready prompts (prompt text, sized PNG images, video requests for
qwen-vl-utils, token count) and a stats JSON; `load_filtered` reads the parquet back for the
trainer and the evaluator. A split that cannot feed training (fewer kept rows than one rollout batch; no row for validation) stops the stage
with the top drop reasons and the first exception that dropped a row, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import ProcessorMixin

from vlgrpo import atomic, models
from vlgrpo.data.images import (
    ResizeMismatchError,
    check_image_grid,
    decode_image,
    image_tokens,
    open_rgb,
    png_struct,
    image_factor,
    processor_pixel_bounds,
    resize_image,
)
from vlgrpo.data.prompts import IMAGE_PLACEHOLDER, count_prompt_tokens, format_template, render_prompt
from vlgrpo.data.sources import load_processor, load_split, override_chat_template
from vlgrpo.data.videos import VIDEO_PLACEHOLDER, fetch, video_spec
from vlgrpo.errors import DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

# Why a row is dropped; a dropped row counts under the first check it fails.
DROP_REASONS = (
    "text_only_model",  # an image or video row for a model that takes no images (models.Family.vision)
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
    "video_missing",
    "no_video_placeholder",
    "more_placeholders_than_videos",
    "fewer_placeholders_than_videos",
    "video_undecodable",
)
ROW_KINDS = ("image", "video", "text")  # the stats count kept and dropped rows of each kind
DROPPED_ROWS_LISTED = 20  # source indices listed per reason in the stats, to trace drops
# More undecodable images than this fraction of a split is a damaged source, not a few bad rows: the
# filter warns (its log, the stats' "warnings", the workflow's last words and the report).
UNDECODABLE_WARN_FRACTION = 0.05


def output_schema() -> pa.Schema:
    """The filtered parquet's schema, with datasets' feature metadata (load_dataset reads its images
    back as images). datasets is imported here, not at the top: training and evaluation read filtered
    splits without it, and every segment job's start would pay for its import."""
    import datasets

    return datasets.Features(
        {
            "index": datasets.Value("int64"),
            "images": datasets.List(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "prompt": datasets.Value("string"),
            "prompt_length": datasets.Value("int64"),
            "image_tokens": datasets.Value("int64"),
            "videos": datasets.List(datasets.Value("string")),  # videos.video_spec of each video
        }
    ).arrow_schema


@dataclass(frozen=True)
class _FilterSettings:
    image_key: str
    image_dir: str | None
    has_image_column: bool
    video_key: str
    video_fps: float
    has_video_column: bool
    prompt_key: str
    answer_key: str
    template: str
    min_pixels: int
    max_pixels: int
    processor_pixels: tuple[int, int]
    max_prompt_length: int
    drop_overlong: bool
    text_only_model: str = ""  # the family's title where it takes no images (its image and video rows are dropped)


class _Dropped(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _as_image_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _under_image_dir(value: Any, image_dir: str | None) -> Any:
    """An image path (a string, or a {bytes: None, path} struct) joined to data.image_dir, as EasyR1
    joins it (an absolute path stays as it is); bytes and images pass through."""
    if image_dir is None:
        return value
    if isinstance(value, str):
        return os.path.join(image_dir, value)
    if isinstance(value, dict) and not value.get("bytes") and isinstance(value.get("path"), str):
        return {**value, "path": os.path.join(image_dir, value["path"])}
    return value


def _row_kind(row: dict[str, Any], s: _FilterSettings) -> str:
    """'video' for a row with videos or a video placeholder, 'image' for one with images or an image
    placeholder, else 'text' (the filter stats' kinds)."""
    problem = row.get(s.prompt_key)
    problem = problem if isinstance(problem, str) else ""
    if VIDEO_PLACEHOLDER in problem or _as_image_list(row.get(s.video_key)):
        return "video"
    return "image" if IMAGE_PLACEHOLDER in problem or _as_image_list(row.get(s.image_key)) else "text"


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
    raw_images = [_under_image_dir(v, s.image_dir) for v in _as_image_list(row.get(s.image_key))]
    placeholders = problem.count(IMAGE_PLACEHOLDER)
    if not raw_images and placeholders:
        raise _Dropped("image_missing")
    if raw_images and placeholders == 0:
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
            images.append(resize_image(image, s.min_pixels, s.max_pixels, s.processor_pixels, image_factor(processor)))
        except ValueError as e:
            raise _Dropped("image_size_unsupported", str(e)) from e
    videos = _fetch_videos(row, problem, s)
    prompt = render_prompt(processor, problem, s.template, vision=(s.has_image_column or s.has_video_column) and not s.text_only_model)
    try:
        prompt_length = count_prompt_tokens(processor, prompt, images, [video for _, video in videos])
        full = processor(images=images or None, videos=[v.frames for _, v in videos] or None, text=[prompt],
                         add_special_tokens=False) if verify else None
    except ResizeMismatchError:
        raise  # a setup error, not a bad row
    except Exception as e:  # a row the processor rejects must not stop the whole split
        raise _Dropped("processor_error", f"{type(e).__name__}: {e}") from e
    if full is not None:
        if images:
            check_image_grid(images, full["image_grid_thw"], processor.image_processor.patch_size)
        if len(full["input_ids"][0]) != prompt_length:
            raise RuntimeError(f"counted {prompt_length} prompt tokens, the processor made {len(full['input_ids'][0])}")
    if s.drop_overlong and prompt_length > s.max_prompt_length:
        raise _Dropped("prompt_too_long", f"{prompt_length} > {s.max_prompt_length} tokens")
    return {
        "images": [png_struct(im) for im in images],
        "problem": problem,
        "answer": str(answer),
        "prompt": prompt,
        "prompt_length": prompt_length,
        "image_tokens": sum(image_tokens(im, image_factor(processor)) for im in images),
        "videos": [spec for spec, _ in videos],
    }


def _fetch_videos(row: dict[str, Any], problem: str, s: _FilterSettings) -> list:
    """(video_spec, fetched Video) of each of the row's videos, or raise _Dropped with the reason."""
    raw = _as_image_list(row.get(s.video_key))
    placeholders = problem.count(VIDEO_PLACEHOLDER)
    if not raw and placeholders:
        raise _Dropped("video_missing")
    if raw and placeholders == 0:
        raise _Dropped("no_video_placeholder")
    if placeholders != len(raw):
        reason = "more_placeholders_than_videos" if placeholders > len(raw) else "fewer_placeholders_than_videos"
        raise _Dropped(reason, f"{placeholders} placeholders, {len(raw)} videos")
    videos = []
    for value in raw:
        try:
            spec = video_spec(value, s.image_dir, s.min_pixels, s.max_pixels, s.video_fps)
        except LookupError as e:
            raise _Dropped("video_missing", str(e)) from e
        except ValueError as e:
            raise _Dropped("video_undecodable", str(e)) from e
        try:
            videos.append((spec, fetch(spec)))
        except ValueError as e:
            raise _Dropped("video_undecodable", str(e)) from e
    return videos


# State for worker processes, set in the parent before forking so that children inherit the
# processor (building its tokenizer takes seconds) and the memory-mapped dataset.
_WORKER_STATE: dict[str, Any] = {}


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core; also keeps OpenMP out of the forked child


def _filter_range(bounds: tuple[int, int]) -> list[tuple[int, str, dict | None, str | None, str, str]]:
    """(source index, row kind, kept row or None, drop reason or None, detail, traceback of the
    exception that dropped the row or "") for rows [start, stop)."""
    ds, processor, settings = _WORKER_STATE["ds"], _WORKER_STATE["processor"], _WORKER_STATE["settings"]
    start, stop = bounds
    rows = ds.with_format("arrow")[start:stop].to_pylist()  # raw image structs: we decode ourselves
    out = []
    for index, row in enumerate(rows, start):
        kind = _row_kind(row, settings)
        try:
            if kind != "text" and settings.text_only_model:
                raise _Dropped("text_only_model", f"a {kind} row; {settings.text_only_model} is a text-only model, it takes no {kind}s")
            # The first row of each range is checked against the full processor call.
            out.append((index, kind, _prepare_row(row, processor, settings, verify=index == start), None, "", ""))
        except _Dropped as d:
            trace = "".join(traceback.format_exception(d.__cause__)).rstrip() if d.__cause__ else ""
            out.append((index, kind, None, d.reason, str(d), trace))
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


def token_stats(lengths: list[int]) -> dict[str, float]:
    """min, mean, p50, p95, max of token counts (linear-interpolated percentiles)."""
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

    Each row is rendered exactly as training will render it, its images sized once
    (`images.model_image_size`), and its prompt counted in tokens (image tokens included) through
    the processor (`count_prompt_tokens`, checked against the full processor call on the first row
    of every 32). Rows are dropped with a reason (DROP_REASONS) instead of failing. Output columns:
    index (row in the source), images (sized, PNG, list<struct<bytes, path>>), problem, answer,
    prompt, prompt_length, image_tokens, videos (videos.video_spec of each video: its resolved
    path(s) and sampling settings; the frames are fetched again per batch). Both files are written
    atomically. `workers` processes (default: the CPUs available, at most 16) share the rows. Returns the stats dict written to
    `out_stats`.

    Raises DataError, writing nothing, when the split keeps fewer rows than it needs (one rollout
    batch, worker.rollout.batch_size, for train; one row for val): the message gives the counts, the
    top drop reasons and the first exception that dropped a row, with its traceback.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = cfg["data"]
    batch_size = cfg["worker"]["rollout"]["batch_size"]
    # Fail on a bad model, template or source before any per-row work.
    processor = load_processor(cfg["model"]["path"])
    override_chat_template(processor, data["override_chat_template"])
    family = models.family_of(cfg["model"]["path"])
    settings = _FilterSettings(
        image_key=data["image_key"],
        image_dir=data["image_dir"],
        has_image_column=True,  # set from the loaded split below
        video_key=data["video_key"],
        video_fps=data["video_fps"],
        has_video_column=True,
        prompt_key=data["prompt_key"],
        answer_key=data["answer_key"],
        template=data["format_prompt"],
        min_pixels=data["min_pixels"],
        max_pixels=data["max_pixels"],
        processor_pixels=processor_pixel_bounds(processor),
        max_prompt_length=data["max_prompt_length"],
        drop_overlong=data["filter_overlong_prompts"],
        text_only_model="" if family.vision else family.title,
    )
    format_template(settings.template)
    ds = load_split(data[split], settings.image_key, settings.prompt_key, settings.answer_key)
    settings = dataclasses.replace(settings, has_image_column=settings.image_key in ds.column_names,
                                   has_video_column=settings.video_key in ds.column_names)

    kept: list[dict[str, Any]] = []
    dropped: Counter[str] = Counter()
    dropped_rows: dict[str, list[int]] = {}
    first_error = ""
    kinds = {kind: {"kept": 0, "dropped": Counter()} for kind in ROW_KINDS}
    for index, kind, row, reason, detail, trace in _filter_rows(ds, processor, settings, workers or _default_workers()):
        if row is None:
            dropped[reason] += 1
            kinds[kind]["dropped"][reason] += 1
            listed = dropped_rows.setdefault(reason, [])
            if len(listed) < DROPPED_ROWS_LISTED:
                listed.append(index)
            if trace and not first_error:
                first_error = f"row {index} ({reason}):\n{trace}"
            log.debug("%s row %d dropped: %s", data[split], index, detail)
        else:
            kinds[kind]["kept"] += 1
            kept.append({"index": index, **row})
    needed = batch_size if split == "train" else 1
    if len(kept) < needed:
        need = f"one rollout batch of {batch_size} (worker.rollout.batch_size)" if split == "train" else "1 row"
        top = ", ".join(f"{reason} {n} (rows {dropped_rows[reason][:5]})" for reason, n in dropped.most_common(3))
        raise DataError(
            f"{data[split]!r} ({split}): {len(kept)} of {len(ds)} rows kept, fewer than {need}; "
            f"top drop reasons: {top or 'none'}" + (f"; the first exception, {first_error}" if first_error else "")
        )

    stats = {
        "source": data[split],
        "rows_in": len(ds),
        "rows_kept": len(kept),
        "dropped": {reason: dropped[reason] for reason in DROP_REASONS},
        "dropped_rows": dropped_rows,
        "kinds": {kind: {"kept": k["kept"], "dropped": dict(k["dropped"])} for kind, k in kinds.items()},
        "prompt_length": token_stats([r["prompt_length"] for r in kept]),
        "image_tokens": token_stats([r["image_tokens"] for r in kept]),
        "max_prompt_length": settings.max_prompt_length,
        "rollout_batch_size": batch_size,
        "steps_per_epoch": len(kept) // batch_size,  # drop_last
    }
    undecodable = dropped["image_undecodable"]
    if undecodable > UNDECODABLE_WARN_FRACTION * len(ds):
        stats["warnings"] = [
            f"{data[split]} ({split}): {undecodable} of {len(ds)} rows ({undecodable / len(ds):.0%}) dropped as "
            f"undecodable images (rows {dropped_rows['image_undecodable'][:5]}...; {split}.stats.json lists more), "
            f"more than {UNDECODABLE_WARN_FRACTION:.0%}: check the source's image column"
        ]
        log.warning("%s", stats["warnings"][0])
    table = pa.Table.from_pylist(kept, schema=output_schema())
    with atomic.replacing(out_parquet) as tmp:
        pq.write_table(table, tmp)
    atomic.write_text(out_stats, json.dumps(stats, indent=2) + "\n")
    log.info("%s: kept %d of %d rows, %d steps per epoch", data[split], len(kept), len(ds), stats["steps_per_epoch"])
    return stats


# ---------------------------------------------------------------------------------------------
# Reading the filtered split


FILTERED_COLUMNS = ("index", "images", "problem", "answer", "prompt", "prompt_length")


def load_filtered(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a parquet written by `filter_split`: index, prompt, images (PIL RGB), answer, problem,
    prompt_length (tokens, images included), videos (videos.video_spec strings; [] in a split filtered
    before videos were read).

    Images are opened lazily: each is decoded on first use; videos are fetched per batch
    (prompts.encode_prompts).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"filtered data not found: {path} (run the filter_data stage)")
    with pq.ParquetFile(path) as file:  # not read_table: its dataset layer imports pandas (0.2 s)
        table = file.read()
    missing = [c for c in FILTERED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; not written by filter_split?")
    columns = list(FILTERED_COLUMNS) + (["videos"] if "videos" in table.column_names else [])
    rows = table.select(columns).to_pylist()
    for row in rows:
        row["images"] = [open_rgb(image["bytes"]) for image in row["images"]]
        row.setdefault("videos", [])
    return rows


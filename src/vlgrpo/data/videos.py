"""Video rows as EasyR1 reads them: frames sampled and sized by qwen-vl-utils, then the processor.

EasyR1 (verl/utils/dataset.py, process_video) hands qwen-vl-utils' `fetch_video` the row's video (a
file path, or a list of frame image paths), data.min_pixels / max_pixels and data.video_fps: it
samples frames at video_fps (at least 4, an even count; a list of frames is taken whole, padded to
an even count, at 2 frames a second) and resizes them (bicubic) to multiples of 28 within the
pixel bounds. The processor's video processor then makes the video tokens from those frames, and
`second_per_grid_ts` (the seconds one temporal patch spans, for Qwen2.5-VL's rope) is
temporal_patch_size / the sampled fps where the processor takes it. Video paths are read relative to
data.image_dir, as EasyR1 reads them.

The filter keeps a row's video as its `fetch_video` request (`VideoSpec`: the resolved path(s) and the
sampling settings), not its frames: the trainer and the evaluator fetch the frames again for each
batch, as EasyR1 does, so a filtered split stays small. Decoding a file takes a reader: qwen-vl-utils
picks torchcodec, decord (the `video` extra) or torchvision's old reader; a list of frame images
needs none.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import ProcessorMixin

VIDEO_PLACEHOLDER = "<video>"


@dataclass(frozen=True)
class Video:
    frames: torch.Tensor  # (T, 3, H, W) float, 0..255, sized by qwen-vl-utils
    sample_fps: float  # frames a second as sampled
    metadata: dict  # qwen-vl-utils' video metadata (fps, frames_indices, total_num_frames)


def video_spec(value: Any, image_dir: str | None, min_pixels: int, max_pixels: int, fps: float) -> str:
    """The JSON `fetch_video` request of a row's video value: a path, or a list of frame image paths,
    each joined to `image_dir` as EasyR1 joins it (an absolute path stays as it is).

    Raises LookupError for a file that does not exist and ValueError for a value that is neither.
    """
    def resolve(path: Any) -> str:
        if not isinstance(path, str) or not path:
            raise ValueError(f"a video is a file path or a list of frame image paths, got {type(path).__name__}")
        full = os.path.join(image_dir, path) if image_dir is not None else path
        if not Path(full).is_file():
            raise LookupError(f"video file not found: {full}")
        return full

    video = [resolve(p) for p in value] if isinstance(value, (list, tuple)) else resolve(value)
    if isinstance(video, list) and not video:
        raise ValueError("a video given as a list of frames has no frames")
    return json.dumps({"video": video, "min_pixels": min_pixels, "max_pixels": max_pixels, "fps": fps})


def fetch(spec: str) -> Video:
    """The frames of a `video_spec`, sampled and sized by qwen-vl-utils' fetch_video as EasyR1 does.

    Raises ValueError (the reader's error in the message) when the video cannot be decoded.
    """
    from qwen_vl_utils.vision_process import fetch_video

    info = json.loads(spec)
    try:
        (frames, metadata), sample_fps = fetch_video(info, return_video_sample_fps=True, return_video_metadata=True)
    except Exception as e:  # readers raise RuntimeError, DECORDError, AttributeError (no reader), ...
        raise ValueError(f"cannot decode video {info['video']!r}: {type(e).__name__}: {e}") from e
    return Video(frames, float(sample_fps), metadata)


def second_per_grid_ts(processor: ProcessorMixin, videos: list[Video]) -> torch.Tensor | None:
    """(num videos,) seconds per temporal patch, as EasyR1 sets them (temporal_patch_size / the
    sampled fps); None for a processor that does not take them (Qwen2-VL, Qwen3-VL)."""
    if "second_per_grid_ts" not in processor.model_input_names:
        return None
    patch = processor.video_processor.temporal_patch_size
    return torch.tensor([patch / v.sample_fps for v in videos], dtype=torch.float32)


def video_tokens(processor: ProcessorMixin, videos: list[Video]) -> list[int]:
    """Tokens the processor makes of each video: its grid's t x h x w patches over merge_size^2."""
    if not videos:
        return []
    grid = processor.video_processor(videos=[v.frames for v in videos], return_tensors="pt")["video_grid_thw"]
    return (grid.prod(-1) // processor.video_processor.merge_size**2).tolist()

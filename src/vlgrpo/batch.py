"""A batch of encoded multimodal prompts that can be repeated and sliced by row.

Generation and every log-prob forward use slices of one PromptBatch, so left padding, attention
mask, image- and video-token positions and mm_token_type_ids agree between them by construction
(Qwen2.5-VL's 3-D rope positions are computed from exactly these tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

PIN_LIMIT = 1 << 28  # bytes: larger tensors (a whole evaluation's images) are copied the plain way


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (and in `dtype` if given).

    From the CPU to a GPU, tensors up to PIN_LIMIT bytes are queued without waiting for the GPU
    (through pinned memory, cast on the GPU), so a caller does not stall its queue.
    """
    if device.type == "cuda" and tensor.device.type == "cpu" and tensor.nbytes <= PIN_LIMIT:
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    else:
        tensor = tensor.to(device)
    return tensor if dtype is None else tensor.to(dtype)


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # (N, P) left-padded
    attention_mask: torch.Tensor  # (N, P)
    mm_token_type_ids: torch.Tensor | None  # (N, P) 1 on image tokens (transformers 5), else None
    pixel_values: torch.Tensor | None  # (sum of patches over all images, D); None without images or where only the grids are kept
    image_grid_thw: torch.Tensor | None  # (num images, 3); (0, 3) for text-only rows; None for a text-only model
    num_images: torch.Tensor  # (N,) images of each row, in order; stays on the CPU
    prompt_ids: torch.Tensor  # (N,) the encoded prompt each row is a copy of (selects keep it); stays on the CPU
    images: list[list] | None = None  # (N,) each row's PIL images, for engines that process them themselves (vllm)
    pixel_values_videos: torch.Tensor | None = None  # (sum of patches over all videos, D); None without videos
    video_grid_thw: torch.Tensor | None = None  # (num videos, 3); None without videos
    second_per_grid_ts: torch.Tensor | None = None  # (num videos,) float32, for processors that take it (Qwen2.5-VL)
    num_videos: torch.Tensor | None = None  # (N,) videos of each row; None: no row has any; stays on the CPU
    videos: list[list] | None = None  # (N,) each row's fetched videos (data.videos.Video), for vllm

    @classmethod
    def from_processor(cls, enc, num_images: list[int], images: list[list] | None = None,
                       num_videos: list[int] | None = None, videos: list[list] | None = None,
                       vision: bool = True) -> "PromptBatch":
        """Wrap the BatchFeature returned by a Qwen2.5-VL processor (left padding); images: the rows'
        images; num_videos, videos: the rows' video counts and fetched videos, where any row has one.

        Rows without images (text-only) may be any of them: a batch of them alone gets an empty grid,
        so the model still computes each row's rope positions from its first real token, as a
        text-only row in a batch with images gets them (and as EasyR1 gives them, row by row).
        vision=False: a text-only model's tokenizer output (no grid at all: its forward takes none).
        """
        grid = enc.get("image_grid_thw")
        if enc.get("video_grid_thw") is not None and num_videos is None:
            raise ValueError("the encoded rows hold videos: pass each row's video count (num_videos)")
        return cls(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            mm_token_type_ids=enc.get("mm_token_type_ids"),
            pixel_values=enc.get("pixel_values"),
            image_grid_thw=torch.zeros((0, 3), dtype=torch.long) if grid is None and vision else grid,
            num_images=torch.tensor(num_images, dtype=torch.long),
            prompt_ids=torch.arange(len(num_images)),
            images=images,
            pixel_values_videos=enc.get("pixel_values_videos"),
            video_grid_thw=enc.get("video_grid_thw"),
            second_per_grid_ts=enc.get("second_per_grid_ts"),
            num_videos=None if num_videos is None or not any(num_videos) else torch.tensor(num_videos, dtype=torch.long),
            videos=videos if num_videos is not None and any(num_videos) else None,
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _patch_ranges(self, grid: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> list[tuple[int, int]]:
        """(start, end) rows of pixel_values (of pixel_values_videos, given the video grid and counts)
        that belong to each prompt row."""
        grid, counts = (self.image_grid_thw, self.num_images) if grid is None else (grid, counts)
        if grid is None:
            return [(0, 0)] * len(self)
        patches = grid.prod(dim=-1).tolist()
        image_offsets = [0]
        for p in patches:
            image_offsets.append(image_offsets[-1] + p)
        row_first_image = [0] + counts.cumsum(0).tolist()
        return [(image_offsets[row_first_image[i]], image_offsets[row_first_image[i + 1]]) for i in range(len(self))]

    def _select_videos(self, picked: list[int]) -> dict:
        """The video fields of rows `picked` (select's helper); all None where no row has a video."""
        if self.num_videos is None:
            return {}
        first = [0] + self.num_videos.cumsum(0).tolist()
        index = torch.tensor([v for r in picked for v in range(first[r], first[r + 1])], dtype=torch.long)
        if not len(index):  # rows without videos: the model takes no video inputs
            return {}
        pixels = None
        if self.pixel_values_videos is not None:  # a batch of grids alone (for host indices) has none
            ranges = self._patch_ranges(self.video_grid_thw, self.num_videos)
            pixels = torch.cat([self.pixel_values_videos[slice(*ranges[r])] for r in picked])
        return {
            "pixel_values_videos": pixels,
            "video_grid_thw": self.video_grid_thw[index],
            "second_per_grid_ts": None if self.second_per_grid_ts is None else self.second_per_grid_ts[index.to(self.second_per_grid_ts.device)],
            "num_videos": self.num_videos[picked],
            "videos": None if self.videos is None else [self.videos[r] for r in picked],
        }

    def select(self, rows: list[int] | torch.Tensor) -> "PromptBatch":
        """Rows `rows` (any order, repeats allowed), with columns that are padding in all of them dropped.

        Consecutive rows share the pixel values with this batch (a view); other selections copy them.
        """
        rows = torch.as_tensor(rows, dtype=torch.long)
        mask = self.attention_mask[rows]
        first = int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else 0  # left padding shared by all
        pixel_values = image_grid_thw = None
        if self.image_grid_thw is not None:
            ranges = self._patch_ranges()
            image_first = [0] + self.num_images.cumsum(0).tolist()
            picked = rows.tolist()
            if self.pixel_values is not None:  # a batch of grids alone (for host indices) has none
                if picked == list(range(picked[0], picked[0] + len(picked))):  # consecutive rows: a view, no copy
                    pixel_values = self.pixel_values[ranges[picked[0]][0] : ranges[picked[-1]][1]]
                else:
                    pixel_values = torch.cat([self.pixel_values[slice(*ranges[r])] for r in picked])
                if not len(pixel_values):  # text-only rows: the model takes no pixels rather than none of them
                    pixel_values = None
            image_grid_thw = torch.cat([self.image_grid_thw[image_first[r] : image_first[r + 1]] for r in picked])
        return PromptBatch(
            input_ids=self.input_ids[rows, first:],
            attention_mask=mask[:, first:],
            mm_token_type_ids=None if self.mm_token_type_ids is None else self.mm_token_type_ids[rows, first:],
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            num_images=self.num_images[rows],
            prompt_ids=self.prompt_ids[rows],
            images=None if self.images is None else [self.images[r] for r in rows.tolist()],
            **self._select_videos(rows.tolist()),
        )

    def repeat_interleave(self, n: int) -> "PromptBatch":
        """Each row n times in a row: rows i*n .. i*n+n-1 are copies of prompt i."""
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def to(self, device, dtype: torch.dtype | None = None) -> "PromptBatch":
        """Move the model inputs to `device` (with to_device); pixel values also take the model's dtype.
        The bookkeeping (num_images, num_videos, prompt_ids, images, videos) stays on the CPU, where select reads it."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in ("num_images", "prompt_ids", "images", "num_videos", "videos"):
                pixels = f.name in ("pixel_values", "pixel_values_videos")
                value = to_device(value, torch.device(device), dtype if pixels else None)
            moved[f.name] = value
        return replace(self, **moved)

    def model_inputs(self) -> dict:
        """Keyword arguments for the model's forward / generate."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        for key in ("mm_token_type_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

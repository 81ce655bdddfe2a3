"""The demo model's perception warm-up: teach the random vision tower to see colours where they are.

A freshly initialised vision tower passes little of the picture to the language model (a linear
probe of the triangle count on its image tokens scores near chance, while the image's mean pixel
alone predicts the count well), so GRPO has nothing to learn the answer from. Qwen2.5-VL-3B
arrives with a pretrained tower; this stands in for that pretraining.

The target is generic and knows nothing of the task: for each image token (a 28 x 28 px region,
2 x 2 patches of 14 px, in the row-major order the tower emits them), the mean and standard
deviation of the region's R, G and B. A throwaway linear head reads the targets from the tower's
output (`visual(...).pooler_output`, the tokens the language model sees); only the tower is kept.
No question, count or answer is involved.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vlgrpo.models import FAMILIES
from vlgrpo.demo.fit import fit

IMAGE_FACTOR = FAMILIES["qwen2_5_vl"].image_factor  # the demo's model is a tiny Qwen2.5-VL
TARGETS_PER_TOKEN = 6  # R, G, B means and standard deviations, in [0, 1]


def region_targets(image: Image.Image) -> torch.Tensor:
    """(tokens, 6): per 28 x 28 region, row-major, the RGB means then the RGB standard deviations.

    The image must already have the processor's size (sides multiples of 28), as resize_image leaves it.
    """
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (H, W, 3)
    h, w = pixels.shape[0] // IMAGE_FACTOR, pixels.shape[1] // IMAGE_FACTOR
    if (h * IMAGE_FACTOR, w * IMAGE_FACTOR) != pixels.shape[:2]:
        raise ValueError(f"image size {image.size} is not a multiple of {IMAGE_FACTOR} px; resize it first")
    regions = pixels.reshape(h, IMAGE_FACTOR, w, IMAGE_FACTOR, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, -1, 3)
    return torch.from_numpy(np.concatenate([regions.mean(1), regions.std(1)], axis=1))


def warm_up_vision(model, processor, images: list[Image.Image], demo: dict, rng: np.random.Generator) -> dict:
    """Train model.model.visual in place for demo["perception_steps"] AdamW steps (lr decaying
    linearly from demo["perception_lr"] to 0) to regress region_targets; return the loss summary.

    images: resized figures; each step draws demo["warmup_batch_size"] of them at random.
    """
    steps, batch_size = demo["perception_steps"], demo["warmup_batch_size"]
    stats = {"steps": steps, "batch_size": batch_size, "lr": demo["perception_lr"], "loss_first": None, "loss_final": None, "seconds": 0.0}
    if steps == 0:
        return stats
    visual = model.model.visual
    encoded = processor.image_processor(images=images, return_tensors="pt")
    pixels = encoded["pixel_values"].split((encoded["image_grid_thw"].prod(-1)).tolist())  # per image (patches, C*T*14*14)
    grids = encoded["image_grid_thw"]  # (images, 3)
    targets = [region_targets(image) for image in images]  # per image (tokens, 6)
    # Targets standardised over the images, read by a fixed orthonormal head from the tokens after
    # an RMS norm (what the language model's first layer applies): the tower must carry the picture
    # as a large change of direction, not as a small offset that only a large trained head could read.
    stacked = torch.cat(targets)
    targets = [(t - stacked.mean(0)) / (stacked.std(0) + 1e-6) for t in targets]
    width = visual.merger.mlp[-1].out_features
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    head = torch.linalg.qr(torch.randn(width, TARGETS_PER_TOKEN, generator=generator)).Q  # (D, 6), orthonormal columns
    optimizer = torch.optim.AdamW(visual.parameters(), lr=demo["perception_lr"])
    visual.train()

    def next_loss() -> torch.Tensor:
        picked = rng.choice(len(images), size=batch_size, replace=True).tolist()
        tokens = visual(torch.cat([pixels[i] for i in picked]), grid_thw=grids[picked]).pooler_output  # (B*tokens, D)
        normed = torch.nn.functional.rms_norm(tokens, (width,))
        return torch.nn.functional.mse_loss(normed @ head, torch.cat([targets[i] for i in picked]))

    stats.update(fit(optimizer, steps, next_loss))
    visual.eval()
    return stats

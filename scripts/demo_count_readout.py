"""Can the demo model learn the triangle count from the image, and which parameters may train?

A fresh 4-way linear head on the language model's last prompt position, trained with Adam on
`--figures` training figures (batches of 16) and scored on 128 test figures, with one of:
head (everything else frozen), lm (the tower frozen), tower (the language model frozen), all.
This is how the demo found that training the tower and the language model together at lr 1e-3
erases the image pathway (accuracy 0.25) while either alone learns it.

    python scripts/demo_count_readout.py results/_demo/tiny_qwen2_5_vl results/_demo/geometry_synth --train all --lr 1e-3

(the workflow makes both in folders keyed by their settings: results/_demo/tiny_qwen2_5_vl-<key>,
results/_demo/geometry_synth-<key>; config.resolved.yaml names them)
"""

import argparse

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForImageTextToText

from vlgrpo.batch import PromptBatch
from vlgrpo.data.images import decode_image, image_factor, processor_pixel_bounds, resize_image
from vlgrpo.data.prompts import encode_prompts, render_prompt
from vlgrpo.data.sources import load_processor

PIXELS = 12544  # the demo's min = max pixels (112 x 112)


def load(processor, folder: str, split: str, n: int) -> tuple[PromptBatch, torch.Tensor]:
    rows = pq.read_table(f"{folder}/{split}.parquet").slice(0, n).to_pylist()
    encoded = [{"prompt": render_prompt(processor, r["problem"], "r1v"),
                "images": [resize_image(decode_image(r["images"][0]), PIXELS, PIXELS, processor_pixel_bounds(processor), image_factor(processor))]}
               for r in rows]
    counts = torch.tensor([int(r["answer"]) // 180 - 1 for r in rows])
    return PromptBatch.from_processor(encode_prompts(processor, encoded), [1] * len(rows)), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data", help="folder with train.parquet and test.parquet")
    parser.add_argument("--train", choices=["head", "lm", "tower", "all"], default="all")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--figures", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(args.model)
    processor = load_processor(args.model)
    train, y_train = load(processor, args.data, "train", args.figures)
    test, y_test = load(processor, args.data, "test", 128)
    model.requires_grad_(args.train in ("all", "lm", "tower"))
    if args.train == "lm":
        model.model.visual.requires_grad_(False)
    if args.train == "tower":
        model.model.language_model.requires_grad_(False)
    head = torch.nn.Linear(model.config.text_config.hidden_size, 4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad] + list(head.parameters()), lr=args.lr)

    def logits(batch: PromptBatch) -> torch.Tensor:
        return head(model.model(**batch.model_inputs(), use_cache=False).last_hidden_state[:, -1])

    rng = np.random.default_rng(0)
    for step in range(1, args.steps + 1):
        picked = rng.choice(len(y_train), 16).tolist()
        loss = torch.nn.functional.cross_entropy(logits(train.select(picked)), y_train[picked])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            with torch.no_grad():
                accuracy = (logits(test).argmax(-1) == y_test).float().mean().item()
            print(f"train={args.train} lr={args.lr} step {step} loss {loss.item():.3f} test accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()

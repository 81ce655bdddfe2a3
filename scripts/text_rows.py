"""Text rows from an image dataset folder, for benchmarking a text-only model where no text math set
is at hand (the GPU machine reaches no hub): each split's parquet file with the image column dropped
and the "<image>" tags taken out of the problems, written as <split>.jsonl (problem, answer).

    python scripts/text_rows.py shared/data/geometry3k shared/data/geometry3k_text

configs/bench_qwen3_4b.yaml reads its output. The problems keep their length and wording; without
the figure many cannot be solved, so the rows serve timing, not accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import datasets


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a folder of <split>.parquet files with images, problem, answer")
    parser.add_argument("out", type=Path, help="the folder the <split>.jsonl files go to")
    parser.add_argument("--image-key", default="images")
    parser.add_argument("--prompt-key", default="problem")
    args = parser.parse_args(argv)
    files = sorted(args.source.glob("*.parquet"))
    if not files:
        raise SystemExit(f"{args.source}: no parquet files")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for file in files:
        ds = datasets.load_dataset("parquet", data_files=str(file), split="train")
        ds = ds.remove_columns([c for c in (args.image_key,) if c in ds.column_names])
        ds = ds.map(lambda row: {args.prompt_key: row[args.prompt_key].replace("<image>", "").strip()})
        out = args.out / f"{file.stem}.jsonl"
        ds.to_json(str(out), lines=True, force_ascii=False)
        written.append(out)
        print(f"{file} -> {out}: {len(ds)} rows")
    return written


if __name__ == "__main__":
    main()

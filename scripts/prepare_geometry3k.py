"""Save the splits of hiyouga/geometry3k (or another hub dataset with images/problem/answer) as local
parquet files, for machines where the training jobs cannot reach the Hugging Face hub.

    python scripts/prepare_geometry3k.py --out data/geometry3k            # needs the hub
    snakemake --cores all --configfile configs/qwen2_5_vl_3b_geo3k.yaml \
        --config 'data={train: data/geometry3k/train.parquet, val: data/geometry3k/test.parquet}'

Each split becomes <out>/<split>.parquet with the columns the recipe reads (`images` as a list of
{bytes, path}, `problem`, `answer`), the images' bytes as the hub stores them, and prints its rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import datasets

COLUMNS = ("images", "problem", "answer")


def prepare(name: str, splits: list[str], out: Path, cache_dir: str | None = None) -> dict[str, int]:
    """Write each split of hub dataset `name` to out/<split>.parquet; return the rows of each."""
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for split in splits:
        ds = datasets.load_dataset(name, split=split, cache_dir=cache_dir)
        missing = [c for c in COLUMNS if c not in ds.column_names]
        if missing:
            raise SystemExit(f"{name}@{split} has no column {', '.join(missing)} (it has {', '.join(ds.column_names)})")
        ds = ds.select_columns(list(COLUMNS))
        path = out / f"{split}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        ds.to_parquet(str(tmp))  # images stay {bytes, path}: the datasets Image feature's storage
        tmp.replace(path)
        rows[split] = len(ds)
        print(f"{name}@{split}: {len(ds)} rows -> {path}", flush=True)
    return rows


def main(argv=None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="hiyouga/geometry3k")
    parser.add_argument("--splits", nargs="+", default=["train", "validation", "test"])
    parser.add_argument("--out", type=Path, required=True, help="folder for <split>.parquet")
    parser.add_argument("--cache-dir", help="the datasets cache (default: HF_HOME's)")
    args = parser.parse_args(argv)
    return prepare(args.dataset, args.splits, args.out, args.cache_dir)


if __name__ == "__main__":
    main()

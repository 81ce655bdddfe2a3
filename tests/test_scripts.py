"""scripts/prepare_geometry3k.py: a hub-style dataset folder becomes parquet files the recipe reads."""

import importlib.util

import pyarrow.parquet as pq

from conftest import ROOT, SHARED, needs_shared
from vlgrpo.data.sources import load_split


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_shared("geometry3k")
def test_prepare_geometry3k_saves_each_split_as_the_recipe_reads_it(tmp_path):
    hub = tmp_path / "hub"  # a dataset folder as the hub serves it: one parquet file per split
    hub.mkdir()
    for split in ("train", "test"):
        pq.write_table(pq.read_table(SHARED / "geometry3k" / f"{split}.parquet").slice(0, 5), hub / f"{split}-00000-of-00001.parquet")
    rows = load_script("prepare_geometry3k").main(["--dataset", str(hub), "--splits", "train", "test", "--out", str(tmp_path / "out"),
                                                   "--cache-dir", str(tmp_path / "cache")])
    assert rows == {"train": 5, "test": 5}
    source = pq.read_table(SHARED / "geometry3k" / "test.parquet").slice(0, 5).to_pylist()
    saved = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [(r["problem"], r["answer"], r["images"][0]["bytes"]) for r in saved] == \
        [(r["problem"], r["answer"], r["images"][0]["bytes"]) for r in source]
    assert len(load_split(str(tmp_path / "out" / "test.parquet"), "images", "problem", "answer")) == 5

"""Metric logs that survive resume: JSONL dedup by step, and one W&B run (offline) across segments."""

import math

import pytest

from vlgrpo import config
from vlgrpo.tracking import Tracker, append_record, read_metrics

BASE = {"experiment": "t", "model": {"path": "m"}, "data": {"train": "a.parquet", "val": "b.parquet"}}


def test_resumed_steps_appear_once_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step, value in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35)]:  # resumed from step 1
        append_record(path, {"step": step, "reward/overall": value})
    append_record(path, {"step": 4, "actor/pg_loss": math.nan})
    with open(path, "a") as f:
        f.write('{"step": 5, "reward/ov')  # killed mid-write
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("reward/overall") for r in records[:3]] == [0.1, 0.25, 0.35]
    assert records[3]["actor/pg_loss"] is None  # NaN stored as null: the line stays valid JSON


def test_one_wandb_run_across_segments_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config.validate({**BASE, "results_dir": str(tmp_path), "trainer": {"logger": ["file", "wandb"], "wandb_mode": "offline"}})
    exp = config.experiment_dir(cfg)
    first = Tracker(cfg, exp)
    first.log({"step": 1, "reward/overall": 0.5})
    first.close()
    second = Tracker(cfg, exp, run_id=first.run_id)  # the next segment, with the id from the checkpoint
    second.log({"step": 2, "reward/overall": 0.6})
    second.close()
    runs = list((exp / "wandb").glob(f"offline-run-*-{first.run_id}"))
    assert len(runs) == 2  # two segments, one run id: `wandb sync` merges them into one run
    assert [r["step"] for r in read_metrics(exp / "metrics.jsonl")] == [1, 2]

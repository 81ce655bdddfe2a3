"""The report's records: from our experiment folders and from EasyR1 logs, merged by step.

A record is a flat dict ``{"step": int, "<group>/<name>": float, ...}`` using EasyR1/verl metric
names; validation results may also carry ``"samples"`` (the fixed logged generations). Reading and
merging are vlgrpo.tracking's (the one metrics reader): nested groups are flattened
(``{"critic": {"score": {"mean": x}}}`` -> ``"critic/score/mean"``), so both sources yield the same
keys, and for a step seen several times a later record overrides an earlier one key by key (so a
re-validation of a step never erases that step's training keys).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from vlgrpo.tracking import SAMPLES as SAMPLES_KEY
from vlgrpo.tracking import Record, RecordError, merge_by_step, read_records, to_record

METRICS_FILE = "metrics.jsonl"
VAL_DIR = "val"
VAL_FILE = re.compile(r"step_\d+\.json")


def read_json(path: str | os.PathLike) -> Record:
    """Read one record from a JSON file (a validation result val/step_XXXXXX.json)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err.msg})") from None
    return to_record(raw, str(path))


def read_experiment(exp_dir: str | os.PathLike) -> list[Record]:
    """Records of one of our experiments: metrics.jsonl (training and validation records), then
    val/step_*.json in step order (the same validation metrics, and the logged samples)."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise RecordError(f"experiment folder not found: {exp_dir}")
    metrics = exp_dir / METRICS_FILE
    records = read_records(metrics) if metrics.is_file() else []
    val_files = [p for p in sorted((exp_dir / VAL_DIR).glob("step_*.json")) if VAL_FILE.fullmatch(p.name)]
    records += sorted((read_json(p) for p in val_files), key=lambda r: r["step"])
    if not records:
        raise RecordError(f"no records in {exp_dir}: neither {METRICS_FILE} nor {VAL_DIR}/step_XXXXXX.json")
    return records


def read_easyr1(paths: Iterable[str | os.PathLike]) -> list[Record]:
    """Records of EasyR1 experiment_log.jsonl files, one per launch of a resumed run, oldest first."""
    paths = list(paths)
    if not paths:
        raise RecordError("no EasyR1 log given")
    records = [record for path in paths for record in read_records(path)]
    if not records:
        raise RecordError(f"no records in {', '.join(map(str, paths))}")
    return records


def merge_records(records: Iterable[Record]) -> pd.DataFrame:
    """One row per step (index "step", sorted), one column per metric; NaN where not logged.

    Logged NaN/±Inf values stay as they are. The "samples" column, when present, holds the list
    of logged generations of a validated step (NaN elsewhere).
    """
    merged = merge_by_step(records)
    if not merged:
        raise RecordError("no records to merge")
    frame = pd.DataFrame.from_records(list(merged.values())).set_index("step").sort_index()
    metric_columns = [c for c in frame.columns if c != SAMPLES_KEY]
    frame[metric_columns] = frame[metric_columns].astype(float)
    return frame

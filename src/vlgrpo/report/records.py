"""Read metric records from our experiment folders and from EasyR1 logs, and merge them by step.

A record is a flat dict ``{"step": int, "<group>/<name>": float, ...}`` using EasyR1/verl metric
names; validation records may also carry ``"samples"`` (the fixed logged generations). Reading
flattens nested groups (``{"critic": {"score": {"mean": x}}}`` -> ``"critic/score/mean"``), so both
sources yield the same keys. Merging applies one rule for resumed runs: records are applied in order
and, for a step seen several times, a later record overrides an earlier one key by key (so a
validation-only re-validation of a step never erases that step's training keys).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from vlgrpo.errors import VlgrpoError

Record = dict[str, Any]

SAMPLES_KEY = "samples"
METRICS_FILE = "metrics.jsonl"
VAL_DIR = "val"
VAL_FILE = re.compile(r"step_\d+\.json")


class RecordError(VlgrpoError, ValueError):
    """A metric file that does not hold valid records; the message names the file and line."""


def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into "group/name" keys; non-dict values are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def to_record(raw: Mapping[str, Any], where: str) -> Record:
    """Validate and normalise one parsed JSON object into a record.

    Metric keys ("group/name") must hold numbers. NaN and ±Inf are kept (they are findings, not
    errors), and JSON null is read as NaN: our tracker writes non-finite values as null, and a
    re-logged step's null must override the value an earlier launch logged. Top-level keys without a
    "/" other than "step" and "samples" are metadata and are ignored. `where` ("file:line") goes
    into errors.
    """
    if not isinstance(raw, Mapping):
        raise RecordError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    flat = flatten(raw)
    step = flat.pop("step", None)
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RecordError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    record: Record = {"step": step}
    for key, value in flat.items():
        if key == SAMPLES_KEY:
            if not isinstance(value, list) or not all(isinstance(s, Mapping) for s in value):
                raise RecordError(f"{where}: '{SAMPLES_KEY}' must be a list of objects")
            record[key] = [dict(s) for s in value]
        elif "/" not in key:
            continue
        elif value is None:
            record[key] = math.nan
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            record[key] = float(value)
        else:
            raise RecordError(f"{where}: metric '{key}' must be a number, got {value!r}")
    return record


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read one JSONL metric file (our metrics.jsonl or an EasyR1 experiment_log.jsonl).

    A malformed last line is skipped: it is what a job killed in the middle of a write leaves
    behind, and the step it held is logged again after the resume. Malformed lines elsewhere are
    errors.
    """
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"metric file not found: {path}")
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise RecordError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        records.append(to_record(raw, f"{path}:{number}"))
    return records


def read_json(path: str | os.PathLike) -> Record:
    """Read one record from a JSON file (a validation result val/step_XXXXXX.json)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err.msg})") from None
    return to_record(raw, str(path))


def read_experiment(exp_dir: str | os.PathLike) -> list[Record]:
    """Records of one of our experiments: metrics.jsonl (training), then val/step_*.json in step order."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise RecordError(f"experiment folder not found: {exp_dir}")
    metrics = exp_dir / METRICS_FILE
    records = read_jsonl(metrics) if metrics.is_file() else []
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
    records = [record for path in paths for record in read_jsonl(path)]
    if not records:
        raise RecordError(f"no records in {', '.join(map(str, paths))}")
    return records


def merge_by_step(records: Iterable[Record]) -> dict[int, Record]:
    """Merge records per step in order; a later value of a key overrides an earlier one."""
    merged: dict[int, Record] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return merged


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

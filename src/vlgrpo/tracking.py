"""Metric logs that survive resume: one JSONL file and one W&B run per experiment, and their one reader.

results/<exp>/metrics.jsonl gets flat records ({"step": k, "kind": "train", "reward/overall": ...}),
appended and fsynced by every job: a training record per step (kind "train"), a validation record
per validated step (kind "val": val/*, val_prompt_length/*, val_response_length/*,
timing_s/validation, the step it validated; step 0 is the baseline), and partial records that add
timings to a step after the fact (`Tracker.add_timings`: timing_s/save_checkpoint after a save).
EasyR1 logs a validated step as one record holding both kinds; `read_metrics` rebuilds exactly that:
records are merged per step in file order, a later value of a key overriding an earlier one, so a
resumed segment's re-logged step replaces the killed attempt's values while the step's validation
keys (disjoint from the training keys) stay. The JSONL file is the report's source; W&B is a view.

W&B: every job of an experiment (each training segment, each validation) resumes the same run, whose
id is made once in results/<exp>/wandb_run_id; every metric is plotted against `global_step`, the
training step, so validation curves share the training axis whatever order jobs log in.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vlgrpo import paths
from vlgrpo.errors import VlgrpoError

log = logging.getLogger(__name__)

Record = dict[str, Any]
KIND = "kind"  # "train" or "val": what wrote the record (metadata, not a metric)
SAMPLES = "samples"  # a validation result's logged generations (val/step_XXXXXX.json only)


class RecordError(VlgrpoError, ValueError):
    """A metric file that does not hold valid records; the message names the file and line."""


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def append_record(path: str | os.PathLike, record: Mapping, kind: str = "train") -> None:
    """Append one JSON line in a single write (jobs that run side by side append to the same file)
    and fsync it. NaN/Inf become null so the line stays valid JSON.

    A job killed in the middle of a write leaves a torn last line, without its newline: it is cut
    off first (the step it held is logged again by the resumed job), with a warning naming the file
    and line and quoting what was cut, so the record does not join it and the file stays valid. The
    check and the write hold an exclusive lock on the file: appending jobs never see each other's
    line half written."""
    line = json.dumps({"step": record["step"], KIND: kind, **{k: _finite_or_none(v) for k, v in record.items()}}) + "\n"
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("%s:%d: cut off a torn last line (a job stopped in the middle of writing it; its step "
                        "is logged again by the resumed job): %r", path, data.count(b"\n") + 1, data[keep:][:300].decode(errors="replace"))
            os.ftruncate(fd, keep)
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock


def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into "group/name" keys (EasyR1 nests its groups); other values stay."""
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
    errors), and JSON null is read as NaN: the tracker writes non-finite values as null, and a
    re-logged step's null must override the value an earlier launch logged. "kind" and "samples"
    are kept; other top-level keys without a "/" are metadata and are ignored. `where` ("file:line")
    goes into errors.
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
        if key == SAMPLES:
            if not isinstance(value, list) or not all(isinstance(s, Mapping) for s in value):
                raise RecordError(f"{where}: '{SAMPLES}' must be a list of objects")
            record[key] = [dict(s) for s in value]
        elif key == KIND:
            record[key] = str(value)
        elif "/" not in key:
            continue
        elif value is None:
            record[key] = math.nan
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            record[key] = float(value)
        else:
            raise RecordError(f"{where}: metric '{key}' must be a number, got {value!r}")
    return record


def read_records(path: str | os.PathLike) -> list[Record]:
    """The records of one JSONL metric file (our metrics.jsonl or an EasyR1 experiment_log.jsonl), in
    file order, unmerged.

    A malformed last line is skipped with a warning naming the file and line: it is what a job
    killed in the middle of a write leaves behind (the next append cuts it off), and the step it
    held is logged again after the resume. Malformed lines elsewhere are errors.
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
                log.warning("%s:%d: skipped a torn last line (%s; a job stopped in the middle of writing it)",
                            path, number, err.msg)
                break
            raise RecordError(f"{path}:{number}: not valid JSON ({err.msg}); only a torn last line is skipped, so "
                                  "this line is damaged: repair or delete it") from None
        records.append(to_record(raw, f"{path}:{number}"))
    return records


def merge_by_step(records: Iterable[Record]) -> dict[int, Record]:
    """Merge records per step in order, a later value of a key overriding an earlier one ("kind" is
    dropped: a merged step may hold both kinds)."""
    merged: dict[int, Record] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update((k, v) for k, v in record.items() if k != KIND)
    return merged


def read_metrics(path: str | os.PathLike) -> list[Record]:
    """One record per step (training and validation keys merged), sorted by step; [] if no file yet."""
    if not Path(path).is_file():
        return []
    merged = merge_by_step(read_records(path))
    return [merged[s] for s in sorted(merged)]


def wandb_run_id(exp_dir: str | os.PathLike) -> str:
    """The experiment's W&B run id, made by the first job that asks and read by every later one.

    Made atomically: written aside, then hard-linked to its name, which fails if another job got
    there first; that job's id is the one returned."""
    path = paths.path(paths.WANDB_RUN_ID, exp_dir)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(uuid.uuid4().hex[:12] + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


class Tracker:
    """Writes records to metrics.jsonl and, when configured, to the experiment's one W&B run."""

    def __init__(self, cfg: dict, exp_dir: Path):
        self.path = paths.path(paths.METRICS, exp_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id, self.wandb = None, None
        trainer = cfg["trainer"]
        if "wandb" in trainer["logger"] and trainer["wandb_mode"] != "disabled":
            import wandb

            self.run_id = wandb_run_id(exp_dir)
            self.wandb = wandb.init(
                project=trainer["project_name"],
                name=cfg["experiment"],
                id=self.run_id,
                resume="allow",
                mode=trainer["wandb_mode"],
                dir=str(exp_dir),
                config=cfg,
            )
            # Our own x-axis: jobs resume the run in any order and may re-log steps W&B has seen.
            self.wandb.define_metric("global_step")
            self.wandb.define_metric("*", step_metric="global_step")

    def log(self, record: dict, kind: str = "train") -> None:
        """Append to metrics.jsonl (always: it is the report's source) and to W&B if enabled."""
        append_record(self.path, record, kind)
        if self.wandb is not None:
            self.wandb.log({"global_step": record["step"], **{k: v for k, v in record.items() if "/" in k}})

    def add_timings(self, step: int, timings: dict[str, float]) -> None:
        """Add timing_s/<name> values to step `step`'s training record (read_metrics merges them in):
        for work that ends after the step was logged, such as the checkpoint save."""
        self.log({"step": step, **{f"timing_s/{name}": seconds for name, seconds in timings.items()}})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()

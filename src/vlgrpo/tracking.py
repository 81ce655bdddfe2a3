"""Metric logging that survives resume: an append-only JSONL file and one W&B run for all segments.

metrics.jsonl gets one flat record per training step ({"step": k, "reward/overall": ...}), appended
and fsynced. A resumed segment re-logs the steps after its checkpoint, so readers deduplicate by
step, the last record winning (`read_metrics`). The JSONL file is the report's source; W&B is a view.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

from vlgrpo import paths


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line and fsync it (NaN/Inf become null so the line stays valid JSON)."""
    line = json.dumps({k: _finite_or_none(v) for k, v in record.items()}) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics JSONL file, one per step (the last written wins), sorted by step.

    A torn last line (a process killed mid-write) is skipped."""
    by_step: dict[int, dict] = {}
    path = Path(path)
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


class Tracker:
    """Writes step records to metrics.jsonl and, when configured, to one W&B run across segments."""

    def __init__(self, cfg: dict, exp_dir: Path, run_id: str | None = None):
        self.path = paths.path(paths.METRICS, exp_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.wandb = None
        trainer = cfg["trainer"]
        if "wandb" in trainer["logger"] and trainer["wandb_mode"] != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=trainer["project_name"],
                name=cfg["experiment"],
                id=self.run_id,
                resume="allow",
                mode=trainer["wandb_mode"],
                dir=str(exp_dir),
                config=cfg,
            )
            # Our own x-axis: a resumed segment may re-log steps W&B has already seen.
            self.wandb.define_metric("global_step")
            self.wandb.define_metric("*", step_metric="global_step")

    def log(self, record: dict) -> None:
        """Append to metrics.jsonl (always: it is the report's source) and to W&B if enabled."""
        append_record(self.path, record)
        if self.wandb is not None:
            self.wandb.log({"global_step": record["step"], **{k: v for k, v in record.items() if k != "step"}})

    def amend(self, step: int, fields: dict) -> None:
        """Add `fields` to step's record (e.g. a segment's timings after its last step): the merged record
        is appended, and readers keep the last record of a step."""
        record = next((r for r in read_metrics(self.path) if r["step"] == step), {"step": step})
        append_record(self.path, {**record, **fields})
        if self.wandb is not None:
            self.wandb.log({"global_step": step, **fields})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()

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

trainer.logger takes EasyR1's names (LOGGERS). `file` is metrics.jsonl, written whatever the list says;
`console` prints each record; `tensorboard` writes event files to results/<exp>/tensorboard (one file
per job, every scalar at its training step); `mlflow` logs to one run per experiment (named after it,
in the MLflow experiment trainer.project_name) in a local SQLite store, results/<exp>/mlflow.db
(`mlflow ui --backend-store-uri sqlite:///results/<exp>/mlflow.db`), whose run id is kept in
results/<exp>/mlflow_run_id; MLflow allows no `@` in a name, so val/pass@4 is logged as val/pass_4.
`swanlab` (refused unless the swanlab package is installed) resumes one offline run per experiment in
results/<exp>/swanlab. A step a resumed segment logs again appears twice in TensorBoard and MLflow (their histories append);
metrics.jsonl and the report keep the later value.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import random
import re
import string
import time
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


# trainer.logger names (EasyR1's) -> the module each needs; "file" and "console" need none.
LOGGERS = {"console": None, "file": None, "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "swanlab": "swanlab"}
LOGGER_INSTALL = "pip install -e '.[loggers]' (tensorboard, mlflow)"


def missing_loggers(names: Iterable[str]) -> list[str]:
    """The trainer.logger names whose package is not installed here."""
    import importlib.util

    return [n for n in names if LOGGERS.get(n) and importlib.util.find_spec(LOGGERS[n]) is None]


def _run_id_file(path: Path, make_id, discard=lambda _id: None) -> str:
    """The id kept in `path`, made by make_id() by the first job that asks and read by every later one.

    Made atomically: written aside, then hard-linked to its name, which fails if another job got there
    first; that job's id is returned and ours is discarded (discard(id))."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        made = make_id()
        tmp.write_text(made + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            discard(made)
        finally:
            tmp.unlink()
    return path.read_text().strip()


def wandb_run_id(exp_dir: str | os.PathLike) -> str:
    """The experiment's W&B run id, made by the first job that asks and read by every later one
    (atomically: _run_id_file)."""
    return _run_id_file(paths.path(paths.WANDB_RUN_ID, exp_dir), lambda: uuid.uuid4().hex[:12])


def _scalars(record: Mapping) -> dict[str, float]:
    """The record's metrics ("group/name" keys with numbers)."""
    return {k: float(v) for k, v in record.items() if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Console:
    """trainer.logger console: each record printed, one line per step."""

    def log(self, step: int, scalars: dict, kind: str) -> None:
        print(f"step {step} ({kind}): " + " ".join(f"{k}={v:.6g}" for k, v in sorted(scalars.items())), flush=True)

    def close(self) -> None:
        pass


class _TensorBoard:
    """trainer.logger tensorboard: torch.utils.tensorboard's SummaryWriter on results/<exp>/tensorboard."""

    def __init__(self, cfg: dict, exp_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(paths.path(paths.TENSORBOARD, exp_dir)))

    def log(self, step: int, scalars: dict, kind: str) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


class _MLflow:
    """trainer.logger mlflow: one run per experiment in the local SQLite store results/<exp>/mlflow.db."""

    def __init__(self, cfg: dict, exp_dir: Path):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=f"sqlite:///{paths.path(paths.MLFLOW_DB, exp_dir).resolve()}")
        project = cfg["trainer"]["project_name"]
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(
            project, artifact_location=paths.path(paths.MLFLOW_ARTIFACTS, exp_dir).resolve().as_uri())

        def make() -> str:
            run = self.client.create_run(experiment_id, run_name=cfg["experiment"])
            params = flatten(cfg, "")
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in list(params.items())[i : i + 100]])
            return run.info.run_id

        from mlflow.entities import Param

        self.run_id = _run_id_file(paths.path(paths.MLFLOW_RUN_ID, exp_dir), make, self.client.delete_run)

    def log(self, step: int, scalars: dict, kind: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        pass


class _SwanLab:
    """trainer.logger swanlab (only where the swanlab package is installed): the experiment's one run, resumed
    by every job (its id in results/<exp>/swanlab_run_id), in results/<exp>/swanlab; mode from SWANLAB_MODE
    as in EasyR1, offline unless set (`swanlab sync` uploads it later)."""

    def __init__(self, cfg: dict, exp_dir: Path):
        import swanlab

        self.swanlab = swanlab
        run_id = _run_id_file(paths.path(paths.SWANLAB_RUN_ID, exp_dir),
                              lambda: "".join(random.choices(string.ascii_lowercase + string.digits, k=21)))
        swanlab.init(project=cfg["trainer"]["project_name"], name=cfg["experiment"], id=run_id, resume="allow",
                     log_dir=str(paths.path(paths.SWANLAB, exp_dir)), mode=os.environ.get("SWANLAB_MODE", "offline"), config=cfg)

    def log(self, step: int, scalars: dict, kind: str) -> None:
        self.swanlab.log(scalars, step=step)

    def close(self) -> None:
        self.swanlab.finish()


class Tracker:
    """Writes records to metrics.jsonl and to each other logger trainer.logger names: the experiment's one
    W&B run, console, TensorBoard, MLflow."""

    def __init__(self, cfg: dict, exp_dir: Path):
        self.path = paths.path(paths.METRICS, exp_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id, self.wandb = None, None
        trainer = cfg["trainer"]
        missing = missing_loggers(trainer["logger"])
        if missing:
            raise VlgrpoError(f"trainer.logger {missing} needs its package, not installed here: {LOGGER_INSTALL}")
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
        makers = {"console": lambda: _Console(), "tensorboard": lambda: _TensorBoard(cfg, exp_dir), "mlflow": lambda: _MLflow(cfg, exp_dir),
                  "swanlab": lambda: _SwanLab(cfg, exp_dir)}
        self.sinks = [makers[name]() for name in trainer["logger"] if name in makers]

    def log(self, record: dict, kind: str = "train") -> None:
        """Append to metrics.jsonl (always: it is the report's source) and to W&B if enabled."""
        append_record(self.path, record, kind)
        if self.wandb is not None:
            self.wandb.log({"global_step": record["step"], **{k: v for k, v in record.items() if "/" in k}})
        for sink in self.sinks:
            sink.log(record["step"], _scalars(record), kind)

    def add_timings(self, step: int, timings: dict[str, float]) -> None:
        """Add timing_s/<name> values to step `step`'s training record (read_metrics merges them in):
        for work that ends after the step was logged, such as the checkpoint save."""
        self.log({"step": step, **{f"timing_s/{name}": seconds for name, seconds in timings.items()}})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        for sink in self.sinks:
            sink.close()

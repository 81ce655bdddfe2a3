"""Where every file of an experiment lives, for both the workflow and the CLIs (one source)."""

from __future__ import annotations

from pathlib import Path

RESOLVED = "{exp}/config.resolved.yaml"
FILTERED = "{exp}/data/{split}.parquet"
STATS = "{exp}/data/{split}.stats.json"
VAL = "{exp}/val/step_{step}.json"
GENERATIONS = "{exp}/val/step_{step}.generations.jsonl"
# A segment's own validation of its checkpoint, until the evaluate rule adopts it as VAL / GENERATIONS.
VAL_IN_PROCESS = "{exp}/val/in_process/step_{step}.json"
GENERATIONS_IN_PROCESS = "{exp}/val/in_process/step_{step}.generations.jsonl"
# Every result the evaluate rule put in place, hard-linked (Snakemake deletes a job's outputs before
# it reruns; a step whose weights are gone cannot be validated again, so its result is put back).
VAL_KEPT = "{exp}/val/kept/step_{step}.json"
GENERATIONS_KEPT = "{exp}/val/kept/step_{step}.generations.jsonl"
MARKER = "{exp}/segments/step_{step}.json"
HEARTBEAT = "{exp}/segments/heartbeat"
TRAINER_LOCK = "{exp}/segments/trainer.lock"  # held by the one trainer that runs (vlgrpo.locks)
CHECKPOINTS = "{exp}/checkpoints"
METRICS = "{exp}/metrics.jsonl"
WANDB_RUN_ID = "{exp}/wandb_run_id"
TENSORBOARD = "{exp}/tensorboard"
MLFLOW_DB = "{exp}/mlflow.db"  # trainer.logger mlflow: a local SQLite store (MLflow's file store is deprecated)
MLFLOW_ARTIFACTS = "{exp}/mlflow_artifacts"
MLFLOW_RUN_ID = "{exp}/mlflow_run_id"
SWANLAB = "{exp}/swanlab"
SWANLAB_RUN_ID = "{exp}/swanlab_run_id"
REPORT = "{exp}/report"
MERGED = "{exp}/export/step_{step}"  # LoRA: base + adapters merged, a from_pretrained folder


def step_str(step: int) -> str:
    """Steps in file names are zero-padded to six digits, so they sort."""
    return f"{step:06d}"


def path(pattern: str, exp: str | Path, **fields) -> Path:
    """A concrete path: `pattern` filled with the experiment folder and integer steps padded."""
    fields = {k: step_str(v) if k == "step" else v for k, v in fields.items()}
    return Path(pattern.format(exp=exp, **fields))

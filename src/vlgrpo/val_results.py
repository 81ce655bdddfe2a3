"""Where a validation result lives, and how a segment's in-process validation reaches the workflow.

A segment job that saves a checkpoint on the validation grid validates it with the model it already
holds (no new process, no model load) and writes the result aside, under val/in_process/, with the key
of the settings it was made with. Snakemake deletes a job's declared outputs before running it, so the
segment cannot write the evaluate rule's outputs itself; instead the evaluate job, finding an in-process
result made with its own settings, moves it into place (a rename: seconds, no GPU) and is done. A result
made with other settings is ignored and the evaluate job validates the checkpoint itself.
"""

from __future__ import annotations

import json
import os

from vlgrpo import config as config_lib
from vlgrpo import paths


def eval_key(cfg: dict) -> str:
    """Hash of what a validation result of a checkpoint depends on (training and validation settings),
    of the config as the resolved file holds it: with `auto` switches, not their values for a device
    (the evaluate rule and the retention of checkpoints key on that file)."""
    parts = {k: cfg[k] for k in ("seed", "model", "data", "algorithm", "worker")}
    return config_lib.config_hash({**parts, "val_generations_to_log": cfg["trainer"]["val_generations_to_log"]})


def in_process_result(cfg: dict, step: int) -> dict | None:
    """The in-process record of `step` if one exists made with cfg's settings, else None."""
    exp = config_lib.experiment_dir(cfg)
    record_path = paths.path(paths.VAL_IN_PROCESS, exp, step=step)
    if not (record_path.is_file() and paths.path(paths.GENERATIONS_IN_PROCESS, exp, step=step).is_file()):
        return None
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("eval_key") == eval_key(cfg) else None


def adopt(cfg: dict, step: int) -> dict | None:
    """Move `step`'s in-process result into the evaluate rule's outputs; None if there is none to adopt."""
    record = in_process_result(cfg, step)
    if record is None:
        return None
    exp = config_lib.experiment_dir(cfg)
    os.replace(paths.path(paths.GENERATIONS_IN_PROCESS, exp, step=step), paths.path(paths.GENERATIONS, exp, step=step))
    os.replace(paths.path(paths.VAL_IN_PROCESS, exp, step=step), paths.path(paths.VAL, exp, step=step))
    return record


def is_validated(cfg: dict, step: int) -> bool:
    """Validated (its weights are no longer needed for it): a result in place, or one waiting to be adopted."""
    return paths.path(paths.VAL, config_lib.experiment_dir(cfg), step=step).exists() or in_process_result(cfg, step) is not None

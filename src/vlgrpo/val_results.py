"""Where a validation result lives, and how a segment's in-process validation reaches the workflow.

A segment job that saves a checkpoint on the validation grid validates it with the model it already
holds (no new process, no model load) and writes the result aside, under val/in_process/, with the key
of the settings it was made with. Snakemake deletes a job's declared outputs before running it, so the
segment cannot write the evaluate rule's outputs itself; instead the evaluate job, finding an in-process
result made with its own settings, moves it into place (a rename: seconds, no GPU) and is done. A result
made with other settings is ignored and the evaluate job validates the checkpoint itself.

Every result the evaluate rule puts in place is also kept under val/kept/ (hard links: no extra
space), where Snakemake deletes nothing. When the rule reruns for a step whose weights were removed
after validation (trainer.keep_validated_weights: false), the kept result made with the same
settings is put back instead of failing: what cannot be recomputed is never lost. A step whose
weights are there is validated again.
"""

from __future__ import annotations

import json
import os
import shutil

from vlgrpo import config as config_lib
from vlgrpo import console, paths


def eval_key(cfg: dict) -> str:
    """Hash of what a validation result of a checkpoint depends on (training and validation settings),
    of the config as the resolved file holds it: with `auto` switches, not their values for a device
    (the evaluate rule and the retention of checkpoints key on that file)."""
    parts = {k: cfg[k] for k in ("seed", "model", "data", "algorithm", "worker")}
    return config_lib.config_hash({**parts, "val_generations_to_log": cfg["trainer"]["val_generations_to_log"]})


def _matching(cfg: dict, step: int, record_pattern: str, generations_pattern: str) -> dict | None:
    """The record of `step` at record_pattern if it and its generations exist and it was made with
    cfg's settings, else None."""
    exp = config_lib.experiment_dir(cfg)
    record_path = paths.path(record_pattern, exp, step=step)
    if not (record_path.is_file() and paths.path(generations_pattern, exp, step=step).is_file()):
        return None
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("eval_key") == eval_key(cfg) else None


def in_process_result(cfg: dict, step: int) -> dict | None:
    """The in-process record of `step` if one exists made with cfg's settings, else None."""
    return _matching(cfg, step, paths.VAL_IN_PROCESS, paths.GENERATIONS_IN_PROCESS)


def adopt(cfg: dict, step: int) -> dict | None:
    """Move `step`'s in-process result into the evaluate rule's outputs; None if there is none to adopt."""
    record = in_process_result(cfg, step)
    if record is None:
        return None
    exp = config_lib.experiment_dir(cfg)
    os.replace(paths.path(paths.GENERATIONS_IN_PROCESS, exp, step=step), paths.path(paths.GENERATIONS, exp, step=step))
    os.replace(paths.path(paths.VAL_IN_PROCESS, exp, step=step), paths.path(paths.VAL, exp, step=step))
    return record


def _link(src, dst) -> None:
    """dst becomes another name of src's file (a copy where the file system has no hard links), atomically."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def keep(cfg: dict, step: int) -> None:
    """Keep `step`'s result in place under val/kept/ too (the record last: it says the pair is complete)."""
    exp = config_lib.experiment_dir(cfg)
    paths.path(paths.VAL_KEPT, exp, step=step).parent.mkdir(parents=True, exist_ok=True)
    for placed, kept in ((paths.GENERATIONS, paths.GENERATIONS_KEPT), (paths.VAL, paths.VAL_KEPT)):
        _link(paths.path(placed, exp, step=step), paths.path(kept, exp, step=step))


def kept_result(cfg: dict, step: int) -> dict | None:
    """The kept record of `step` if one exists made with cfg's settings, else None."""
    return _matching(cfg, step, paths.VAL_KEPT, paths.GENERATIONS_KEPT)


def put_back(cfg: dict, step: int) -> dict | None:
    """Put `step`'s kept result (made with cfg's settings) back in place, said on the console; None if
    there is none. For a step whose weights are gone: its result cannot be made again."""
    record = kept_result(cfg, step)
    if record is None:
        return None
    exp = config_lib.experiment_dir(cfg)
    for placed, kept in ((paths.GENERATIONS, paths.GENERATIONS_KEPT), (paths.VAL, paths.VAL_KEPT)):
        _link(paths.path(kept, exp, step=step), paths.path(placed, exp, step=step))
    console.say(f"step {step}: its weights were removed after validation, so it is not validated again; "
                f"its kept result ({paths.path(paths.VAL_KEPT, exp, step=step)}) is put back")
    return record


def is_validated(cfg: dict, step: int) -> bool:
    """Validated (its weights are no longer needed for it): a result in place, kept, or waiting to be adopted."""
    return (paths.path(paths.VAL, config_lib.experiment_dir(cfg), step=step).exists()
            or in_process_result(cfg, step) is not None or kept_result(cfg, step) is not None)

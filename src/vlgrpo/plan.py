"""The shape of a run, from the config and the filtered dataset size: steps, segments, validations.

Used by the workflow (to build the job graph) and by the trainer and evaluator (to know what to
keep), so both always agree. Nothing here depends on the total number of steps except which
segments exist: raising max_steps later only adds segments.
"""

from __future__ import annotations


def total_steps(cfg: dict, steps_per_epoch: int) -> int:
    """The run's total steps as EasyR1 counts them: max_steps where set (total_epochs is then ignored;
    epochs repeat as needed), else total_epochs * steps_per_epoch. The warm-up ratio and the cosine
    schedule take their length from it."""
    if steps_per_epoch < 1:
        raise ValueError(
            f"the filtered training set is smaller than one rollout batch "
            f"(worker.rollout.batch_size={cfg['worker']['rollout']['batch_size']}): no training step possible"
        )
    trainer = cfg["trainer"]
    total = trainer["total_epochs"] * steps_per_epoch
    return trainer["max_steps"] or total


def segment_ends(cfg: dict, total: int) -> list[int]:
    """End step of every training segment: each save_freq steps, and the last step."""
    freq = cfg["trainer"]["save_freq"]
    ends = list(range(freq, total + 1, freq))
    return ends if ends and ends[-1] == total else ends + [total]


def validation_steps(cfg: dict, total: int) -> list[int]:
    """Steps whose checkpoint is validated: segment ends on the val_freq grid, the last step, and
    step 0 (the base model) when val_before_train."""
    trainer = cfg["trainer"]
    steps = [s for s in segment_ends(cfg, total) if s % trainer["val_freq"] == 0 or s == total]
    return ([0] if trainer["val_before_train"] else []) + steps

"""Pure analysis of a merged metric frame: one row per step (index "step"), one column per metric
(see records.merge_records); NaN where a step did not log a metric.

The rules, stated once here and repeated in the report (RULES):
- Training step: a step that logged any training metric (groups reward, actor, critic,
  response_length, prompt_length, perf, or timing_s/step). Validation step: one that logged a val/ key.
- Format learned: the first validation step whose val/format_reward is >= 0.95.
- Plateau: validation accuracy is smoothed by a centred moving mean over 3 validation points; the
  plateau starts at the first validation step after which the smoothed accuracy never rises more
  than 0.02 (two points of accuracy) above its value there, with at least 2 later validations to
  show it. None when the accuracy is still rising at the end.
- KL trend: a least-squares line through actor/kl_loss over the second half of the training steps;
  "rising" when the line climbs by more than 50% of that half's mean KL, else "bounded".
- Non-finite step: a training step that skipped an update (actor/nonfinite_skipped > 0), whose
  reward, loss, entropy or grad-norm metric (NONFINITE_WATCH) is NaN, ±Inf, null (how our tracker
  writes non-finite values) or missing, or that
  logged ±Inf in any training metric.
- Over the clip threshold: actor/grad_norm (the norm before clipping) > max_grad_norm.
- Clip fraction: pg_clipfrac_higher + pg_clipfrac_lower per step, averaged over training steps.
- Samples shown: the first validation with logged samples, the first where every logged sample has
  the full format score (format >= 1), and the last.
- Efficiency: a normal step is a training step without validation. A step with validation costs
  timing_s/step when validation runs inside the step (EasyR1), else timing_s/step +
  timing_s/validation (ours: validation is a separate job). Phase times and throughput are means
  over normal steps; peak memory is the maximum over training steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

FORMAT_LEARNED_THRESHOLD = 0.95
PLATEAU_WINDOW = 3
PLATEAU_TOL = 0.02
PLATEAU_MIN_AFTER = 2
KL_RISE_FRACTION = 0.5

VAL_ACCURACY = "val/accuracy_reward"
VAL_FORMAT = "val/format_reward"
VAL_OVERALL = "val/overall_reward"
VAL_LENGTH_MEAN = "val_response_length/mean"
VAL_CLIP_RATIO = "val_response_length/clip_ratio"
KL_LOSS = "actor/kl_loss"
GRAD_NORM = "actor/grad_norm"
PG_LOSS = "actor/pg_loss"
CLIPFRAC_HIGHER = "actor/pg_clipfrac_higher"
CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
NONFINITE_SKIPPED = "actor/nonfinite_skipped"
STEP_TIME = "timing_s/step"
VALIDATION_TIME = "timing_s/validation"
THROUGHPUT = "perf/throughput"
TOTAL_TOKENS = "perf/total_num_tokens"
TIME_PER_STEP = "perf/time_per_step"
MEMORY_ALLOCATED = "perf/max_memory_allocated_gb"
MEMORY_RESERVED = "perf/max_memory_reserved_gb"
PHASES = ("gen", "old", "ref", "update_actor")
SAMPLES = "samples"

TRAINING_GROUPS = ("reward", "actor", "critic", "response_length", "prompt_length", "perf")
NONFINITE_WATCH = (
    "reward/overall",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/ppo_kl",
    "actor/entropy_loss",
    "actor/grad_norm",
)

RULES = {
    "format_learned": (
        f"Format learned: the first validation step whose format reward is ≥ {FORMAT_LEARNED_THRESHOLD:.0%}."
    ),
    "plateau": (
        f"Plateau: validation accuracy smoothed by a centred moving mean over {PLATEAU_WINDOW} validation "
        f"points; the plateau starts at the first validation step after which the smoothed accuracy never "
        f"rises more than {PLATEAU_TOL * 100:g} points above its value there, with at least "
        f"{PLATEAU_MIN_AFTER} later validations to show it."
    ),
    "kl_trend": (
        "KL trend: a least-squares line through actor/kl_loss over the second half of the training steps; "
        f"'rising' when it climbs by more than {KL_RISE_FRACTION:.0%} of that half's mean, else 'bounded'."
    ),
    "nonfinite": (
        "Non-finite step: a training step that skipped an update (actor/nonfinite_skipped > 0), whose "
        f"{', '.join(NONFINITE_WATCH)} is NaN, ±Inf, null or missing, or that logged ±Inf in any training metric."
    ),
    "grad_clip": "Over the clip threshold: grad_norm (before clipping) > max_grad_norm.",
    "clipfrac": "Clip fraction: pg_clipfrac_higher + pg_clipfrac_lower per step, averaged over training steps.",
    "samples": (
        "Samples: the first validation with logged generations, the first where every logged sample has the "
        "full format score, and the last."
    ),
    "efficiency": (
        "Normal step: a training step without validation. A step with validation costs timing_s/step when "
        "validation runs inside the step (EasyR1), else timing_s/step + timing_s/validation. Phase times "
        "and throughput are means over normal steps; peak memory is the maximum over training steps."
    ),
}


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    """frame[name], or an all-NaN series on the same steps when the metric was never logged."""
    if name in frame.columns:
        return frame[name].astype(float)
    return pd.Series(np.nan, index=frame.index, dtype=float, name=name)


def training_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of the steps that trained (see the module rule)."""
    names = [c for c in frame.columns if c.split("/")[0] in TRAINING_GROUPS or c == STEP_TIME]
    return frame[frame[names].notna().any(axis=1)] if names else frame.iloc[:0]


def validation_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of the steps that were validated (any val/ metric logged)."""
    names = [c for c in frame.columns if c.startswith("val/")]
    return frame[frame[names].notna().any(axis=1)] if names else frame.iloc[:0]


def finite(series: pd.Series) -> pd.Series:
    """The finite values of a series (drops NaN and ±Inf)."""
    return series[np.isfinite(series.to_numpy(dtype=float))]


def first_step_at_least(series: pd.Series, threshold: float) -> int | None:
    """First step (index) whose value is >= threshold; None if none is."""
    hits = series.index[series.to_numpy(dtype=float) >= threshold]
    return int(hits[0]) if len(hits) else None


def format_learned_step(frame: pd.DataFrame, threshold: float = FORMAT_LEARNED_THRESHOLD) -> int | None:
    """First validation step whose val/format_reward >= threshold."""
    return first_step_at_least(column(validation_rows(frame), VAL_FORMAT).dropna(), threshold)


def smooth(series: pd.Series, window: int) -> pd.Series:
    """Centred moving mean over `window` points (shorter at the ends)."""
    return series.rolling(window, center=True, min_periods=1).mean()


def plateau_start_step(
    accuracy: pd.Series,
    *,
    window: int = PLATEAU_WINDOW,
    tol: float = PLATEAU_TOL,
    min_after: int = PLATEAU_MIN_AFTER,
) -> int | None:
    """First step after which the smoothed accuracy never rises more than `tol` above its value there.

    accuracy: validation accuracy per validation step, shape (V,), indexed by step. Smoothing
    (centred mean over `window` points) damps the sampling noise of one evaluation; `min_after`
    later points must exist, so a run still rising at its end has no plateau (None).
    """
    acc = finite(accuracy.sort_index())
    smoothed = smooth(acc, window).to_numpy()
    for i in range(len(smoothed) - min_after):
        if smoothed[i + 1 :].max() <= smoothed[i] + tol:
            return int(acc.index[i])
    return None


@dataclass(frozen=True)
class Trend:
    """A least-squares line through a metric over a step range.

    verdict: "rising" or "bounded"; change: the line's rise from first_step to last_step;
    mean: the metric's mean over that range.
    """

    verdict: str
    first_step: int
    last_step: int
    mean: float
    change: float


def kl_trend(kl: pd.Series, *, rise_fraction: float = KL_RISE_FRACTION) -> Trend | None:
    """Rising or bounded, from the second half of the KL series, shape (T,) indexed by step.

    "rising" when the fitted line over the second half climbs by more than `rise_fraction` of the
    half's mean |KL|: a KL that keeps growing linearly from 0 climbs 67% in its second half, one
    that levels off climbs far less. None with fewer than 4 finite values in that half.
    """
    values = finite(kl.sort_index())
    half = values.iloc[len(values) // 2 :]
    if len(half) < 4:
        return None
    steps = half.index.to_numpy(dtype=float)
    slope = np.polyfit(steps, half.to_numpy(), 1)[0]
    change = float(slope * (steps[-1] - steps[0]))
    mean = float(half.mean())
    verdict = "rising" if change > rise_fraction * abs(mean) else "bounded"
    return Trend(verdict, int(steps[0]), int(steps[-1]), mean, change)


def steps_above(series: pd.Series, threshold: float) -> list[int]:
    """Steps whose finite value is strictly above threshold."""
    values = finite(series)
    return [int(s) for s in values.index[values.to_numpy() > threshold]]


def nonfinite_steps(frame: pd.DataFrame) -> list[int]:
    """Training steps with a non-finite update or metric (see the module rule)."""
    train = training_rows(frame)
    bad = column(train, NONFINITE_SKIPPED).fillna(0).to_numpy() > 0
    watched = [c for c in NONFINITE_WATCH if c in train.columns]
    if watched:
        bad |= ~np.isfinite(train[watched].to_numpy(dtype=float)).all(axis=1)
    names = [c for c in train.columns if c.split("/")[0] in TRAINING_GROUPS or c == STEP_TIME]
    bad |= np.isinf(train[names].to_numpy(dtype=float)).any(axis=1)
    return [int(s) for s in train.index[bad]]


def clip_fraction(frame: pd.DataFrame) -> pd.Series:
    """Fraction of clipped tokens per training step (higher + lower), shape (T,)."""
    train = training_rows(frame)
    parts = train[[c for c in (CLIPFRAC_HIGHER, CLIPFRAC_LOWER) if c in train.columns]]
    return parts.sum(axis=1, min_count=1).astype(float)


def argmax_step(series: pd.Series) -> int | None:
    """Step of the largest finite value (the earliest on ties); None if there is none."""
    values = finite(series)
    return int(values.idxmax()) if len(values) else None


def number(value) -> float | None:
    """A JSON-safe float: None for missing or non-finite values."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def mean_or_none(series: pd.Series) -> float | None:
    values = finite(series)
    return float(values.mean()) if len(values) else None


def max_or_none(series: pd.Series) -> float | None:
    values = finite(series)
    return float(values.max()) if len(values) else None


def min_or_none(series: pd.Series) -> float | None:
    values = finite(series)
    return float(values.min()) if len(values) else None


def validation_point(frame: pd.DataFrame, step: int | None) -> dict | None:
    """The summary entry of one validation step; None when there is no such step."""
    if step is None:
        return None
    row = frame.loc[step]

    def get(name: str) -> float | None:
        return number(row[name]) if name in frame.columns else None

    return {
        "step": int(step),
        "accuracy": get(VAL_ACCURACY),
        "format": get(VAL_FORMAT),
        "overall": get(VAL_OVERALL),
        "response_length_mean": get(VAL_LENGTH_MEAN),
        "response_clip_ratio": get(VAL_CLIP_RATIO),
    }


def validation_steps(frame: pd.DataFrame) -> dict[str, int | None]:
    """Steps of the first, best (by accuracy, earliest on ties) and final validation."""
    val = validation_rows(frame)
    if val.empty:
        return {"first": None, "best": None, "final": None}
    return {
        "first": int(val.index[0]),
        "best": argmax_step(column(val, VAL_ACCURACY)),
        "final": int(val.index[-1]),
    }


def samples_by_step(frame: pd.DataFrame) -> dict[int, list[dict]]:
    """The logged validation generations of every step that has them, in step order."""
    if SAMPLES not in frame.columns:
        return {}
    return {int(step): value for step, value in frame[SAMPLES].items() if isinstance(value, list) and value}


def well_formatted(samples: list[dict]) -> bool:
    """True when every logged sample earned the full format score."""
    return all(float(s.get("format") or 0.0) >= 1.0 for s in samples)


def sample_steps(frame: pd.DataFrame) -> dict[str, int | None]:
    """Steps whose samples the report shows: the first, the first all well formatted, the final."""
    steps = samples_by_step(frame)
    if not steps:
        return {"first": None, "formatted": None, "final": None}
    formatted = [step for step, samples in steps.items() if well_formatted(samples)]
    return {"first": min(steps), "formatted": formatted[0] if formatted else None, "final": max(steps)}


def infer_n_gpus(frame: pd.DataFrame) -> int | None:
    """GPUs behind perf/throughput (tokens / time / GPUs), from the median over training steps."""
    train = training_rows(frame)
    ratio = column(train, TOTAL_TOKENS) / (column(train, TIME_PER_STEP) * column(train, THROUGHPUT))
    ratio = finite(ratio)
    return int(round(float(ratio.median()))) if len(ratio) and ratio.median() >= 0.5 else None


def throughput_per_gpu(frame: pd.DataFrame, n_gpus: int | None) -> pd.Series:
    """Tokens/s per GPU per training step: perf/throughput, else tokens / timing_s/step / n_gpus."""
    train = training_rows(frame)
    if THROUGHPUT in train.columns:
        return column(train, THROUGHPUT)
    if n_gpus:
        return column(train, TOTAL_TOKENS) / column(train, STEP_TIME) / n_gpus
    return column(train, THROUGHPUT)


def step_split(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Training rows split into (normal steps, steps with validation)."""
    train = training_rows(frame)
    validated = train.index.isin(validation_rows(frame).index)
    return train[~validated], train[validated]


def whole_step_time(rows: pd.DataFrame, *, validation_in_step: bool) -> pd.Series:
    """Wall time of each step including its validation, shape (rows,)."""
    step = column(rows, STEP_TIME)
    return step if validation_in_step else step + column(rows, VALIDATION_TIME)


def efficiency(frame: pd.DataFrame, *, validation_in_step: bool, n_gpus: int | None = None) -> dict:
    """The summary's efficiency block (seconds, tokens/s per GPU, GB); None where not logged."""
    normal, validated = step_split(frame)
    train = training_rows(frame)
    throughput = throughput_per_gpu(frame, n_gpus)
    return {
        "normal_step_s_mean": mean_or_none(column(normal, STEP_TIME)),
        "val_step_s_mean": mean_or_none(whole_step_time(validated, validation_in_step=validation_in_step)),
        "validation_s_mean": mean_or_none(column(frame, VALIDATION_TIME)),
        "phase_s_mean": {p: mean_or_none(column(normal, f"timing_s/{p}")) for p in PHASES},
        "throughput_per_gpu_mean": mean_or_none(throughput.loc[throughput.index.isin(normal.index)]),
        "peak_memory_allocated_gb": max_or_none(column(train, MEMORY_ALLOCATED)),
        "peak_memory_reserved_gb": max_or_none(column(train, MEMORY_RESERVED)),
    }


def stability(frame: pd.DataFrame, *, max_grad_norm: float) -> dict:
    """The summary's stability block."""
    train = training_rows(frame)
    trend = kl_trend(column(train, KL_LOSS))
    return {
        "nonfinite_steps": len(nonfinite_steps(frame)),
        "grad_norm_mean": mean_or_none(column(train, GRAD_NORM)),
        "grad_norm_over_clip_steps": len(steps_above(column(train, GRAD_NORM), max_grad_norm)),
        "kl_loss_trend": trend.verdict if trend else None,
        "pg_loss_min": min_or_none(column(train, PG_LOSS)),
        "pg_loss_max": max_or_none(column(train, PG_LOSS)),
        "clipfrac_mean": mean_or_none(clip_fraction(frame)),
    }


def summarize(
    frame: pd.DataFrame,
    *,
    max_grad_norm: float = 1.0,
    validation_in_step: bool = False,
    n_gpus: int | None = None,
) -> dict:
    """The summary.json dict (JSON-safe: None where the data lacks a value)."""
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    train = training_rows(frame)
    val_steps = validation_steps(frame)
    return {
        "steps": int(train.index[-1]) if len(train) else None,
        "train_steps": int(len(train)),
        "val": {name: validation_point(frame, step) for name, step in val_steps.items()},
        "phases": {
            "format_learned_step": format_learned_step(frame),
            "plateau_start_step": plateau_start_step(column(validation_rows(frame), VAL_ACCURACY)),
        },
        "stability": stability(frame, max_grad_norm=max_grad_norm),
        "efficiency": efficiency(frame, validation_in_step=validation_in_step, n_gpus=n_gpus),
    }

"""The written analysis: sentences computed from the metric frame and its summary (plain text).

Every number and step in these sentences comes from the data; where the data lacks a metric the
sentence says so instead of guessing. The rules behind the verdicts are analysis.RULES.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from vlgrpo.report import analysis as A

EDGE_STEPS = 10  # "start" and "end" of a noisy training series: mean of this many training steps
LISTED_STEPS = 12  # at most this many step numbers written out in a sentence


@dataclass(frozen=True)
class Section:
    title: str
    items: list[str]


def pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * 100:.{digits}f}%"


def num(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def step_list(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:LISTED_STEPS]))
    return shown + (f" and {len(steps) - LISTED_STEPS} more" if len(steps) > LISTED_STEPS else "")


def edge_means(series: pd.Series) -> tuple[float | None, float | None, int]:
    """Means of the first and last EDGE_STEPS finite values (fewer for short runs) and that count."""
    values = A.finite(series)
    n = min(EDGE_STEPS, max(1, len(values) // 2))
    if values.empty:
        return None, None, n
    return float(values.iloc[:n].mean()), float(values.iloc[-n:].mean()), n


def validation_section(frame: pd.DataFrame, summary: dict) -> Section:
    first, best, final = (summary["val"][k] for k in ("first", "best", "final"))
    if first is None:
        return Section("Validation", ["No validation was logged."])
    val = A.validation_rows(frame)
    best_format_step = A.argmax_step(A.column(val, A.VAL_FORMAT))
    best_format = A.number(val.loc[best_format_step, A.VAL_FORMAT]) if best_format_step is not None else None
    items = [
        f"Accuracy: {pct(first['accuracy'])} at step {first['step']} → {pct(final['accuracy'])} at the final "
        f"validation (step {final['step']}); best {pct(best['accuracy'] if best else None)}"
        + (f" at step {best['step']}." if best else "."),
        f"Format reward: {pct(first['format'])} → {pct(final['format'])}; best {pct(best_format)}"
        + (f" at step {best_format_step}." if best_format_step is not None else "."),
        f"Overall reward: {num(first['overall'])} → {num(final['overall'])} over {len(val)} validations.",
    ]
    train = A.training_rows(frame)
    start, end, n = edge_means(A.column(train, "reward/overall"))
    if start is not None:
        items.append(
            f"Training reward (overall, mean of the first and last {n} training steps): {num(start)} → {num(end)}."
        )
    return Section("Validation results", items)


def phases_section(frame: pd.DataFrame, summary: dict) -> Section:
    val = A.validation_rows(frame)
    accuracy = A.finite(A.column(val, A.VAL_ACCURACY))
    if accuracy.empty:
        return Section("Training phases", ["No validation accuracy was logged, so no phases can be told apart."])
    learned, plateau = summary["phases"]["format_learned_step"], summary["phases"]["plateau_start_step"]
    fmt = A.column(val, A.VAL_FORMAT)
    first_step = int(accuracy.index[0])
    items = []
    if learned is None:
        best_step = A.argmax_step(fmt)
        best = A.number(fmt.loc[best_step]) if best_step is not None else None
        items.append(
            f"Format learning did not finish: validation format reward never reached "
            f"{A.FORMAT_LEARNED_THRESHOLD:.0%} (best {pct(best)}"
            + (f" at step {best_step})." if best_step is not None else ").")
        )
    else:
        items.append(
            f"Format learning, steps {first_step}–{learned}: format reward {pct(A.number(fmt.iloc[0]))} → "
            f"{pct(A.number(fmt.loc[learned]))}, first ≥ {A.FORMAT_LEARNED_THRESHOLD:.0%} at step {learned}; "
            f"accuracy meanwhile {pct(accuracy.iloc[0])} → {pct(A.number(accuracy.get(learned)))}."
        )
    growth_from = learned if learned is not None else first_step
    growth_to = plateau if plateau is not None else int(accuracy.index[-1])
    if growth_to > growth_from and {growth_from, growth_to} <= set(accuracy.index):
        gain = accuracy.loc[growth_to] - accuracy.loc[growth_from]
        items.append(
            f"Accuracy growth, steps {growth_from}–{growth_to}: accuracy {pct(accuracy.loc[growth_from])} → "
            f"{pct(accuracy.loc[growth_to])} ({gain * 100:+.1f} points)."
        )
    smoothed = A.smooth(accuracy, A.PLATEAU_WINDOW)
    if plateau is not None:
        after = accuracy.loc[plateau:]
        items.append(
            f"Plateau from step {plateau}: smoothed accuracy {pct(smoothed.loc[plateau])} there and at most "
            f"{pct(smoothed.loc[plateau:].max())} over the {len(after) - 1} later validations; raw accuracy "
            f"{pct(after.min())}–{pct(after.max())} over steps {plateau}–{int(after.index[-1])}."
        )
    elif len(accuracy) <= A.PLATEAU_MIN_AFTER:
        items.append(f"Plateau: {len(accuracy)} validations are too few to tell.")
    else:
        items.append(
            f"No plateau: the smoothed accuracy still rose more than {A.PLATEAU_TOL * 100:g} points after every "
            f"validation up to step {int(accuracy.index[-A.PLATEAU_MIN_AFTER - 1])}; it was "
            f"{pct(smoothed.iloc[-1])} at the last one (step {int(accuracy.index[-1])})."
        )
    return Section("Training phases", items)


def stability_section(frame: pd.DataFrame, summary: dict, *, max_grad_norm: float) -> Section:
    train = A.training_rows(frame)
    if train.empty:
        return Section("Stability", ["No training step was logged."])
    stab = summary["stability"]
    bad = A.nonfinite_steps(frame)
    items = [
        f"Non-finite values: none in {len(train)} training steps."
        if not bad
        else f"Non-finite values: {len(bad)} of {len(train)} training steps ({step_list(bad)})."
    ]
    grad = A.column(train, A.GRAD_NORM)
    peak = A.argmax_step(grad)
    if peak is not None:
        over = A.steps_above(grad, max_grad_norm)
        items.append(
            f"Grad norm (before clipping): mean {num(stab['grad_norm_mean'])}, max {num(grad.loc[peak])} at step "
            f"{peak}; {len(over)} of {len(A.finite(grad))} steps ({len(over) / len(A.finite(grad)):.1%}) above the "
            f"clip threshold {max_grad_norm:g}" + (f" (steps {step_list(over)})." if over else ".")
        )
    trend = A.kl_trend(A.column(train, A.KL_LOSS))
    if trend is not None:
        _, last, n = edge_means(A.column(train, A.KL_LOSS))
        items.append(
            f"KL loss: {trend.verdict}. Over steps {trend.first_step}–{trend.last_step} the fitted line "
            f"changes by {trend.change:+.3g}, {trend.change / abs(trend.mean) if trend.mean else 0:+.0%} of the "
            f"mean {trend.mean:.3g} (rising means more than +{A.KL_RISE_FRACTION:.0%}); mean of the last {n} "
            f"steps {num(last)}."
        )
    clip = A.clip_fraction(frame)
    clip_peak = A.argmax_step(clip)
    if clip_peak is not None:
        items.append(
            f"Clipped tokens: {pct(stab['clipfrac_mean'], 3)} on average (higher + lower), max "
            f"{pct(A.number(clip.loc[clip_peak]), 3)} at step {clip_peak}."
        )
    if stab["pg_loss_min"] is not None:
        items.append(f"pg_loss between {num(stab['pg_loss_min'])} and {num(stab['pg_loss_max'])}.")
    start, end, n = edge_means(A.column(train, "actor/entropy_loss"))
    if start is not None:
        items.append(f"Entropy (mean of the first and last {n} steps): {num(start)} → {num(end)}.")
    return Section("Stability", items)


def length_section(frame: pd.DataFrame, summary: dict) -> Section:
    first, final = summary["val"]["first"], summary["val"]["final"]
    items = []
    if first is not None and None not in (first["response_length_mean"], final["response_length_mean"]):
        items.append(
            f"Validation responses: {first['response_length_mean']:.0f} → "
            f"{final['response_length_mean']:.0f} tokens on average from step {first['step']} to step "
            f"{final['step']}; truncated at the length limit {pct(first['response_clip_ratio'])} → "
            f"{pct(final['response_clip_ratio'])}."
        )
    train = A.training_rows(frame)
    start, end, n = edge_means(A.column(train, "response_length/mean"))
    clip_start, clip_end, _ = edge_means(A.column(train, "response_length/clip_ratio"))
    if start is not None:
        items.append(
            f"Training responses (mean of the first and last {n} steps): {start:.0f} → {end:.0f} tokens; "
            f"truncated {pct(clip_start)} → {pct(clip_end)}."
        )
    return Section("Response length", items or ["No response lengths were logged."])


def efficiency_section(frame: pd.DataFrame, summary: dict, *, validation_in_step: bool, n_gpus: int | None) -> Section:
    eff = summary["efficiency"]
    normal, validated = A.step_split(frame)
    if eff["normal_step_s_mean"] is None:
        return Section("Efficiency", ["No step times were logged."])
    items = [f"Normal step: {eff['normal_step_s_mean']:.1f} s on average over {len(normal)} steps."]
    if eff["val_step_s_mean"] is not None:
        how = "validation inside the step" if validation_in_step else "step + separate validation job"
        items.append(
            f"Step with validation: {eff['val_step_s_mean']:.1f} s on average over {len(validated)} steps ({how}); "
            f"validation alone {num(eff['validation_s_mean'], 4)} s."
        )
    shares = {p: s / eff["normal_step_s_mean"] for p, s in eff["phase_s_mean"].items() if s is not None}
    if shares:
        rest = 1 - sum(shares.values())
        items.append(
            "Share of a normal step: "
            + ", ".join(f"{p} {share:.0%}" for p, share in shares.items())
            + f", everything else {rest:.0%}."
        )
    if eff["throughput_per_gpu_mean"] is not None:
        gpus = f" ({n_gpus} GPU{'s' if n_gpus != 1 else ''})" if n_gpus else ""
        items.append(f"Throughput: {eff['throughput_per_gpu_mean']:.1f} tokens/s per GPU on normal steps{gpus}.")
    if eff["peak_memory_allocated_gb"] is not None:
        reserved = eff["peak_memory_reserved_gb"]
        items.append(
            f"Peak GPU memory: {eff['peak_memory_allocated_gb']:.1f} GB allocated, "
            + ("reserved not logged." if reserved is None else f"{reserved:.1f} GB reserved.")
        )
    return Section("Efficiency", items)


def lora_section(lora: dict) -> Section:
    """What trained when the run trained LoRA adapters (a segment marker's `lora`)."""
    targets = lora["target_modules"] + (f", except modules matching {lora['exclude_modules']}" if lora["exclude_modules"] else "")
    return Section("LoRA", [
        f"LoRA adapters of rank {lora['rank']} (alpha {lora['alpha']:g}, scale {lora['alpha'] / lora['rank']:g}) on {targets}.",
        f"Trainable: {lora['trainable_params']:,} of {lora['total_params']:,} parameters "
        f"({pct(lora['trainable_fraction'], 2)}); the reference model is the base model (adapters off).",
    ])


def narrative(
    frame: pd.DataFrame, summary: dict, *, max_grad_norm: float, validation_in_step: bool, n_gpus: int | None
) -> list[Section]:
    """All sections of the written analysis, in report order."""
    return [
        validation_section(frame, summary),
        phases_section(frame, summary),
        stability_section(frame, summary, max_grad_norm=max_grad_norm),
        length_section(frame, summary),
        efficiency_section(frame, summary, validation_in_step=validation_in_step, n_gpus=n_gpus),
    ] + ([lora_section(summary["lora"])] if summary.get("lora") else [])

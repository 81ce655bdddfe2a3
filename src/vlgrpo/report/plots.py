"""Report figures: one PNG per figure, step on the x axis, validation steps marked.

Every figure in FIGURES is always written (a figure without data says so), so the set of report
files is fixed and Snakemake can declare them. Noisy per-step training series are drawn thin, with
a centred moving mean over SMOOTH_STEPS steps drawn thick on top.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from vlgrpo.report import analysis as A  # noqa: E402

SMOOTH_STEPS = 9
DPI = 110

# file name -> (title, caption group: the workflow/report/<group>.rst that describes it)
FIGURES: dict[str, tuple[str, str]] = {
    "val_rewards.png": ("Validation rewards", "rewards"),
    "train_rewards.png": ("Training rewards", "rewards"),
    "kl.png": ("KL: loss against the reference, and PPO KL", "stability"),
    "grad_norm.png": ("Gradient norm", "stability"),
    "clipfrac.png": ("Clipped token fractions", "stability"),
    "pg_loss.png": ("Policy-gradient loss", "stability"),
    "entropy.png": ("Entropy", "stability"),
    "response_length.png": ("Response length and truncation", "response_length"),
    "step_time.png": ("Step time breakdown", "efficiency"),
    "throughput.png": ("Throughput per GPU", "efficiency"),
    "memory.png": ("Peak GPU memory", "efficiency"),
}

WIDE_FIGURES = frozenset({"kl.png", "response_length.png"})

COLORS = {"overall": "#333333", "format": "#1f77b4", "accuracy": "#d62728"}
PHASE_COLORS = {
    "gen": "#4e79a7",
    "reward": "#bab0ac",
    "old": "#f28e2b",
    "ref": "#e15759",
    "adv": "#9c755f",
    "update_actor": "#59a14f",
    "save_checkpoint": "#76b7b2",
    "other": "#d4d4d4",
    "validation": "#b07aa1",
}
STYLE = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
}


@dataclass(frozen=True)
class FigureContext:
    """What the figures need besides the metric frame."""

    max_grad_norm: float
    validation_in_step: bool
    format_learned_step: int | None = None
    plateau_start_step: int | None = None
    n_gpus: int | None = None


def _axes(ncols: int = 1, title: str = "") -> tuple[plt.Figure, list[plt.Axes]]:
    """One row of axes; two-panel figures are drawn wide (WIDE_FIGURES span the page)."""
    fig, axes = plt.subplots(1, ncols, figsize=(8 if ncols == 1 else 13, 3.4), squeeze=False)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    for ax in axes[0]:
        ax.set_xlabel("step")
    return fig, list(axes[0])


def _no_data(ax: plt.Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"{what} not logged", ha="center", va="center", transform=ax.transAxes, color="#888")


def _train_line(ax: plt.Axes, series: pd.Series, label: str, color: str | None = None) -> bool:
    """Per-step values thin, their moving mean thick; False when nothing finite was logged."""
    values = A.finite(series)
    if values.empty:
        return False
    (line,) = ax.plot(values.index, values.to_numpy(), lw=0.8, alpha=0.35, color=color)
    smooth = A.smooth(values, SMOOTH_STEPS)
    ax.plot(smooth.index, smooth.to_numpy(), lw=1.8, color=line.get_color(), label=label)
    return True


def _val_points(ax: plt.Axes, series: pd.Series, label: str, color: str | None = None) -> bool:
    values = A.finite(series)
    if values.empty:
        return False
    ax.plot(values.index, values.to_numpy(), "o", ms=3.5, color=color, label=label, mec="white", mew=0.5)
    return True


def _mark_validation(ax: plt.Axes, frame: pd.DataFrame) -> None:
    """Ticks along the bottom of the axes at the validated steps."""
    steps = A.validation_rows(frame).index.to_numpy()
    if len(steps):
        ax.plot(steps, np.full(len(steps), 0.015), "|", ms=7, color=PHASE_COLORS["validation"],
                transform=ax.get_xaxis_transform(), label="validation steps")


def _legend(ax: plt.Axes, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def val_rewards(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["val_rewards.png"][0])
    val = A.validation_rows(frame)
    drawn = False
    for name, key in (("overall", A.VAL_OVERALL), ("format", A.VAL_FORMAT), ("accuracy", A.VAL_ACCURACY)):
        values = A.finite(A.column(val, key))
        if not values.empty:
            ax.plot(values.index, values.to_numpy(), "-o", ms=3.5, lw=1.2, color=COLORS[name], label=name)
            drawn = True
    if not drawn:
        _no_data(ax, "validation rewards")
    for step, text in ((ctx.format_learned_step, "format learned"), (ctx.plateau_start_step, "plateau")):
        if step is not None:
            ax.axvline(step, ls="--", lw=1, color="#555")
            ax.text(step, 1.02, f" {text} ({step})", transform=ax.get_xaxis_transform(), fontsize=8, va="bottom")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("mean reward")
    _legend(ax, loc="center right")
    return fig


def train_rewards(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["train_rewards.png"][0])
    train, val = A.training_rows(frame), A.validation_rows(frame)
    drawn = False
    for name in ("overall", "format", "accuracy"):
        drawn |= _train_line(ax, A.column(train, f"reward/{name}"), f"train {name}", COLORS[name])
        _val_points(ax, A.column(val, f"val/{name}_reward"), None, COLORS[name])
    if not drawn:
        _no_data(ax, "training rewards")
    ax.plot([], [], "o", ms=3.5, color="#777", label="validation (same colour)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("mean reward")
    _legend(ax, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return fig


def kl(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, axes = _axes(2, FIGURES["kl.png"][0])
    train = A.training_rows(frame)
    for ax, key, label in ((axes[0], A.KL_LOSS, "kl_loss"), (axes[1], "actor/ppo_kl", "ppo_kl")):
        if not _train_line(ax, A.column(train, key), label):
            _no_data(ax, label)
        if key == "actor/ppo_kl":
            ax.axhline(0, color="#888", lw=0.8)
        _mark_validation(ax, frame)
        ax.set_title(label)
        _legend(ax)
    return fig


def grad_norm(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["grad_norm.png"][0])
    values = A.column(A.training_rows(frame), A.GRAD_NORM)
    if _train_line(ax, values, "grad_norm (before clipping)"):
        over = A.steps_above(values, ctx.max_grad_norm)
        ax.plot(over, values.loc[over].to_numpy(), "o", ms=4, color="#d62728",
                label=f"{len(over)} steps above the threshold")
    else:
        _no_data(ax, "grad_norm")
    ax.axhline(ctx.max_grad_norm, ls="--", color="#d62728", lw=1, label=f"clip threshold {ctx.max_grad_norm:g}")
    _mark_validation(ax, frame)
    _legend(ax)
    return fig


def clipfrac(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["clipfrac.png"][0])
    train = A.training_rows(frame)
    drawn = False
    bounds = ((A.CLIPFRAC_HIGHER, "higher (ratio > 1 + ε_high)"), (A.CLIPFRAC_LOWER, "lower (ratio < 1 − ε_low)"))
    for key, label in bounds:
        drawn |= _train_line(ax, A.column(train, key) * 100, label)
    if not drawn:
        _no_data(ax, "clip fractions")
    ax.set_ylabel("% of response tokens")
    _mark_validation(ax, frame)
    _legend(ax)
    return fig


def _single(frame: pd.DataFrame, name: str, key: str, ylabel: str) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES[name][0])
    if not _train_line(ax, A.column(A.training_rows(frame), key), key.split("/")[-1]):
        _no_data(ax, key)
    ax.set_ylabel(ylabel)
    _mark_validation(ax, frame)
    _legend(ax)
    return fig


def pg_loss(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig = _single(frame, "pg_loss.png", A.PG_LOSS, "pg_loss")
    fig.axes[0].axhline(0, color="#888", lw=0.8)
    return fig


def entropy(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    return _single(frame, "entropy.png", "actor/entropy_loss", "mean token entropy (nats)")


def response_length(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, axes = _axes(2, FIGURES["response_length.png"][0])
    train, val = A.training_rows(frame), A.validation_rows(frame)
    for ax, name, scale, ylabel in ((axes[0], "mean", 1, "tokens"), (axes[1], "clip_ratio", 100, "% truncated")):
        drawn = _train_line(ax, A.column(train, f"response_length/{name}") * scale, "train", "#1f77b4")
        drawn |= _val_points(ax, A.column(val, f"val_response_length/{name}") * scale, "validation", "#d62728")
        if not drawn:
            _no_data(ax, f"response_length/{name}")
        ax.set_title("mean length" if name == "mean" else "clip ratio (hit the length limit)")
        ax.set_ylabel(ylabel)
        _legend(ax)
    return fig


def step_time(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    """Stacked phases per training step; their sum is the whole step, validation included."""
    fig, (ax,) = _axes(title=FIGURES["step_time.png"][0])
    train = A.training_rows(frame)
    if A.finite(A.column(train, A.STEP_TIME)).empty:
        _no_data(ax, A.STEP_TIME)
        return fig
    names = ("gen", "reward", "old", "ref", "adv", "update_actor", "save_checkpoint")
    parts = {p: A.column(train, f"timing_s/{p}").fillna(0) for p in names}
    validation = A.column(train, A.VALIDATION_TIME).fillna(0)
    inside = A.column(train, A.STEP_TIME).fillna(0) - sum(parts.values())
    if ctx.validation_in_step:
        inside -= validation
    parts["other"] = inside.clip(lower=0)
    parts["validation"] = validation
    steps = train.index.to_numpy()
    width = 0.9 * (np.diff(steps).min() if len(steps) > 1 else 1)
    bottom = np.zeros(len(steps))
    for name, values in parts.items():
        if values.to_numpy().any():
            ax.bar(steps, values.to_numpy(), width, bottom=bottom, color=PHASE_COLORS[name], label=name, lw=0)
            bottom += values.to_numpy()
    ax.set_ylabel("seconds")
    _legend(ax, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return fig


def throughput(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["throughput.png"][0])
    values = A.throughput_per_gpu(frame, ctx.n_gpus)
    normal, validated = A.step_split(frame)
    normal_values = A.finite(values.loc[values.index.isin(normal.index)])
    if normal_values.empty:
        _no_data(ax, "throughput")
        return fig
    ax.plot(normal_values.index, normal_values.to_numpy(), lw=1, label="normal steps")
    mean = normal_values.mean()
    ax.axhline(mean, ls="--", color="#555", lw=1, label=f"mean {mean:.0f}")
    label = "steps with validation" + (" (its time included)" if ctx.validation_in_step else "")
    _val_points(ax, values.loc[values.index.isin(validated.index)], label, "#d62728")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(bottom=0)
    _legend(ax)
    return fig


def memory(frame: pd.DataFrame, ctx: FigureContext) -> plt.Figure:
    fig, (ax,) = _axes(title=FIGURES["memory.png"][0])
    train = A.training_rows(frame)
    drawn = False
    for key, label in ((A.MEMORY_ALLOCATED, "max allocated"), (A.MEMORY_RESERVED, "max reserved")):
        values = A.finite(A.column(train, key))
        if not values.empty:
            ax.plot(values.index, values.to_numpy(), lw=1.2, label=f"{label} (peak {values.max():.1f} GB)")
            drawn = True
    if not drawn:
        _no_data(ax, "GPU memory")
    ax.set_ylabel("GB")
    ax.set_ylim(bottom=0)
    _mark_validation(ax, frame)
    _legend(ax)
    return fig


DRAW = {
    "val_rewards.png": val_rewards,
    "train_rewards.png": train_rewards,
    "kl.png": kl,
    "grad_norm.png": grad_norm,
    "clipfrac.png": clipfrac,
    "pg_loss.png": pg_loss,
    "entropy.png": entropy,
    "response_length.png": response_length,
    "step_time.png": step_time,
    "throughput.png": throughput,
    "memory.png": memory,
}


def render_figures(frame: pd.DataFrame, ctx: FigureContext) -> dict[str, bytes]:
    """Every figure of FIGURES as PNG bytes, keyed by file name (the caller writes and embeds them)."""
    pngs = {}
    with plt.rc_context(STYLE):
        for name, draw in DRAW.items():
            fig = draw(frame, ctx)
            fig.tight_layout()
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=DPI)
            plt.close(fig)
            pngs[name] = buffer.getvalue()
    return pngs

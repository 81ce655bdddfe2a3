"""Build the report folder: report.html (self-contained), summary.json and the figure PNGs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from vlgrpo import atomic
from vlgrpo.report import analysis as A
from vlgrpo.report.html import SampleColumn, render_html
from vlgrpo.report.narrative import Section, narrative
from vlgrpo.report.plots import FIGURES, WIDE_FIGURES, FigureContext, render_figures
from vlgrpo.report.records import Record, merge_records

REPORT_HTML = "report.html"
SUMMARY_JSON = "summary.json"
SAMPLE_LABELS = {"first": "start", "formatted": "first all well formatted", "final": "final"}


def sample_columns(frame) -> list[SampleColumn]:
    """The samples shown side by side; a step chosen for several reasons appears once."""
    by_step = A.samples_by_step(frame)
    labels: dict[int, list[str]] = {}
    for reason, step in A.sample_steps(frame).items():
        if step is not None:
            labels.setdefault(step, []).append(SAMPLE_LABELS[reason])
    return [SampleColumn(f"step {s} ({', '.join(why)})", s, by_step[s]) for s, why in sorted(labels.items())]


def build_report(
    records: Iterable[Record],
    out_dir: str | os.PathLike,
    *,
    title: str,
    max_grad_norm: float = 1.0,
    n_gpus: int | None = None,
    validation_in_step: bool = False,
    source: str = "",
    warnings: list[str] | None = None,
    lora: dict | None = None,
) -> dict:
    """Write report.html, summary.json and FIGURES into out_dir; return the summary.

    records: in launch/log order (see records.merge_records). max_grad_norm: the clip threshold
    the run used. n_gpus: GPUs behind perf/throughput; None infers it from perf/ metrics.
    validation_in_step: True when timing_s/step of a validated step already includes its
    validation (EasyR1), False when validation ran as a separate job (ours). warnings: about the
    run's inputs (the filter's), shown first and kept in summary["warnings"]. lora: the LoRA settings
    and parameter counts of a LoRA run (a segment marker's `lora`), stated in the report.
    """
    frame = merge_records(records)
    n_gpus = n_gpus or A.infer_n_gpus(frame)
    summary = A.summarize(frame, max_grad_norm=max_grad_norm, validation_in_step=validation_in_step, n_gpus=n_gpus)
    if lora:  # LoRA settings and the trainable fraction (lora: a segment marker's `lora`)
        summary["lora"] = lora
    context = FigureContext(
        max_grad_norm=max_grad_norm,
        validation_in_step=validation_in_step,
        format_learned_step=summary["phases"]["format_learned_step"],
        plateau_start_step=summary["phases"]["plateau_start_step"],
        n_gpus=n_gpus,
    )
    pngs = render_figures(frame, context)
    sections = narrative(
        frame, summary, max_grad_norm=max_grad_norm, validation_in_step=validation_in_step, n_gpus=n_gpus
    )
    if warnings:
        summary["warnings"] = list(warnings)
        sections.insert(0, Section("Warnings", list(warnings)))
    page = render_html(
        title=title,
        source=source,
        summary=summary,
        sections=sections,
        rules=A.RULES,
        figures={name: (FIGURES[name][0], png) for name, png in pngs.items()},
        wide_figures=WIDE_FIGURES,
        samples=sample_columns(frame),
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, png in pngs.items():
        atomic.write_bytes(out_dir / name, png)
    atomic.write_text(out_dir / SUMMARY_JSON, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    atomic.write_text(out_dir / REPORT_HTML, page)
    return summary

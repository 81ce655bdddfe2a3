"""The self-contained HTML page: key numbers, written analysis, figures (base64 PNG), samples, rules.

Every piece of text from the data (titles, problems, responses) is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass

from vlgrpo.report.analysis import FORMAT_LEARNED_THRESHOLD
from vlgrpo.report.narrative import Section, num, pct

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0; background: #fafafa; }
main { max-width: 1320px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
.source { color: #666; margin: 0 0 16px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; }
.card { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 12px; }
.card .label { color: #666; font-size: 12px; }
.card .value { font-size: 20px; font-weight: 600; }
.card .note { color: #888; font-size: 12px; }
.analysis { columns: 2 520px; column-gap: 36px; }
.analysis section { break-inside: avoid; padding-bottom: 10px; }
.analysis h3 { margin-top: 0; }
.analysis ul { margin: 0; padding-left: 20px; }
.analysis li { margin: 3px 0; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(600px, 1fr)); gap: 16px; }
figure { margin: 0; background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px; }
figure.wide { grid-column: 1 / -1; }
figure img { width: 100%; height: auto; display: block; }
figcaption { color: #666; font-size: 12px; margin-top: 4px; }
table.samples { border-collapse: collapse; width: 100%; table-layout: fixed; background: #fff; }
table.samples th, table.samples td {
  border: 1px solid #e3e3e3; padding: 6px 8px; vertical-align: top; text-align: left;
}
table.samples th { background: #f0f0f0; }
.text {
  white-space: pre-wrap; word-break: break-word; max-height: 260px; overflow: auto;
  font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace;
}
.score { display: inline-block; font-size: 12px; padding: 1px 6px; border-radius: 4px; margin-bottom: 4px; }
.correct { background: #d9f2dc; } .formatted { background: #fdecc8; } .wrong { background: #f8d4d4; }
.rules li { margin: 3px 0; }
pre.json { background: #fff; border: 1px solid #e3e3e3; padding: 10px; overflow: auto; font-size: 12px; }
"""


@dataclass(frozen=True)
class SampleColumn:
    """One step's logged generations: label (e.g. "step 0 (start)"), step, samples (dicts)."""

    label: str
    step: int
    samples: list[dict]


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def image_tag(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{esc(alt)}">'


def card(label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{esc(note)}</div>' if note else ""
    return (
        f'<div class="card"><div class="label">{esc(label)}</div>'
        f'<div class="value">{esc(value)}</div>{note_html}</div>'
    )


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def key_numbers(summary: dict) -> str:
    val, phases, stab, eff = summary["val"], summary["phases"], summary["stability"], summary["efficiency"]
    first, best, final = val["first"] or {}, val["best"] or {}, val["final"] or {}
    learned, plateau = phases["format_learned_step"], phases["plateau_start_step"]
    memory = eff["peak_memory_allocated_gb"]
    cards = [
        card("Validation accuracy", pct(final.get("accuracy")),
             f"from {pct(first['accuracy'])} at step {first['step']}" if first else ""),
        card("Best accuracy", pct(best.get("accuracy")), f"step {best['step']}" if best else ""),
        card("Validation format", pct(final.get("format")), f"from {pct(first.get('format'))}"),
        card("Format learned", "—" if learned is None else str(learned),
             f"first val format ≥ {FORMAT_LEARNED_THRESHOLD:.0%}"),
        card("Plateau from", "—" if plateau is None else str(plateau), "not reached" if plateau is None else "step"),
        card("Training steps", str(summary["train_steps"]), f"last step {summary['steps']}"),
        card("Non-finite steps", str(stab["nonfinite_steps"])),
        card("Grad norm > clip", str(stab["grad_norm_over_clip_steps"]), f"mean {num(stab['grad_norm_mean'])}"),
        card("KL loss trend", stab["kl_loss_trend"] or "n/a"),
        card("Normal step", fmt(eff["normal_step_s_mean"], ".1f", " s"),
             f"with validation {fmt(eff['val_step_s_mean'], '.1f', ' s')}"),
        card("Throughput / GPU", fmt(eff["throughput_per_gpu_mean"], ".0f", " tok/s")),
        card("Peak memory", fmt(memory, ".1f", " GB"), "allocated" if memory is not None else "not logged"),
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def analysis_html(sections: list[Section]) -> str:
    blocks = []
    for section in sections:
        items = "".join(f"<li>{esc(item)}</li>" for item in section.items)
        blocks.append(f"<section><h3>{esc(section.title)}</h3><ul>{items}</ul></section>")
    return '<div class="analysis">' + "".join(blocks) + "</div>"


def figures_html(figures: dict[str, tuple[str, bytes]], wide: frozenset[str]) -> str:
    blocks = [
        f'<figure class="{"wide" if name in wide else ""}">{image_tag(png, title)}'
        f"<figcaption>{esc(name)}</figcaption></figure>"
        for name, (title, png) in figures.items()
    ]
    return '<div class="figures">' + "".join(blocks) + "</div>"


def score_html(sample: dict) -> str:
    accuracy, format_score = float(sample.get("accuracy") or 0), float(sample.get("format") or 0)
    kind = "correct" if accuracy >= 1 else "formatted" if format_score >= 1 else "wrong"
    text = " · ".join(f"{key} {num(sample.get(key), 2)}" for key in ("overall", "format", "accuracy"))
    return f'<span class="score {kind}">{esc(text)}</span>'


def samples_html(columns: list[SampleColumn]) -> str:
    if not columns:
        return "<p>No validation generations were logged (EasyR1's file log does not hold them).</p>"
    by_index: dict = {}
    for column in columns:
        for sample in column.samples:
            by_index.setdefault(sample.get("index"), {})[column.step] = sample
    head = "<th>problem / ground truth</th>" + "".join(f"<th>{esc(c.label)}</th>" for c in columns)
    rows = []
    for index, per_step in by_index.items():
        some = next(iter(per_step.values()))
        problem = (
            f'<div class="text">{esc(some.get("problem", ""))}</div>'
            f'<p>ground truth: <b>{esc(some.get("ground_truth", ""))}</b> · item {esc(index)}</p>'
        )
        cells = []
        for column in columns:
            sample = per_step.get(column.step)
            cells.append(
                "<td>—</td>" if sample is None
                else f'<td>{score_html(sample)}<div class="text">{esc(sample.get("response", ""))}</div></td>'
            )
        rows.append(f"<tr><td>{problem}</td>{''.join(cells)}</tr>")
    return f'<table class="samples"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def render_html(
    *,
    title: str,
    source: str,
    summary: dict,
    sections: list[Section],
    rules: dict[str, str],
    figures: dict[str, tuple[str, bytes]],
    wide_figures: frozenset[str] = frozenset(),
    samples: list[SampleColumn],
) -> str:
    """The whole page as one string. figures: {file name: (title, PNG bytes)}; wide_figures span the page."""
    rules_html = "".join(f"<li>{esc(rule)}</li>" for rule in rules.values())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>{esc(title)}</h1>
<p class="source">{esc(source)}</p>
{key_numbers(summary)}
<h2>Analysis</h2>
{analysis_html(sections)}
<h2>Figures</h2>
{figures_html(figures, wide_figures)}
<h2>Validation samples</h2>
{samples_html(samples)}
<h2>Rules</h2>
<ul class="rules">{rules_html}</ul>
<h2>summary.json</h2>
<details><summary>show</summary><pre class="json">{esc(json.dumps(summary, indent=2))}</pre></details>
</main>
</body>
</html>
"""

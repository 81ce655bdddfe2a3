"""The report's reading, merging and analysis rules on synthetic metric series with known answers,
and the report built from a synthetic vlgrpo experiment folder."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from vlgrpo.config import validate, write_resolved
from vlgrpo.report import FIGURES, RecordError, build_report, main, merge_records, read_easyr1, read_experiment
from vlgrpo.report import analysis as A
from vlgrpo.tracking import append_record

REPO = Path(__file__).resolve().parents[1]


def series(values, steps=None) -> pd.Series:
    steps = range(0, 10 * len(values), 10) if steps is None else steps
    return pd.Series(values, index=list(steps), dtype=float)


def train_record(step: int, **metrics) -> dict:
    base = {
        "reward/overall": 0.5,
        "actor/pg_loss": 0.01,
        "actor/kl_loss": 0.01,
        "actor/ppo_kl": 0.0,
        "actor/entropy_loss": 0.4,
        "actor/grad_norm": 0.5,
        "timing_s/step": 10.0,
    }
    base.update({k.replace("__", "/"): v for k, v in metrics.items()})
    return {"step": step, **base}


# ---------------------------------------------------------------- phases


def test_format_learned_is_the_first_validation_at_or_above_95_percent():
    frame = merge_records(
        [{"step": s, "val/format_reward": f} for s, f in [(0, 0.0), (5, 0.6), (10, 0.949), (15, 0.95), (20, 0.99)]]
    )
    assert A.format_learned_step(frame) == 15
    assert A.format_learned_step(frame.loc[:10]) is None


def test_plateau_starts_where_a_linear_rise_levels_off():
    # rises 0.05 per validation up to step 60, then flat: the smoothed series stops rising at 60
    acc = series([0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.30, 0.30, 0.30, 0.30])
    assert A.plateau_start_step(acc) == 60


def test_plateau_ignores_noise_below_the_tolerance():
    rng = np.random.default_rng(0)
    flat = 0.4 + rng.uniform(-0.008, 0.008, size=12)
    acc = series(np.concatenate([np.linspace(0.0, 0.4, 6)[:-1], flat]))
    # the rise ends at step 50; the centred mean finds a knee this sharp at most one validation
    # late, and noise of ±0.008 must not postpone it further
    assert A.plateau_start_step(acc) in (50, 60)
    assert A.plateau_start_step(acc, tol=0.0) > 60  # without a tolerance the noise does


def test_no_plateau_while_still_rising_or_with_too_few_points():
    assert A.plateau_start_step(series(np.linspace(0, 0.5, 12))) is None
    assert A.plateau_start_step(series([0.3, 0.3])) is None
    assert A.plateau_start_step(series([0.3, 0.3, 0.3])) == 0  # flat from the start: plateau at once


def test_plateau_skips_nan_validations():
    acc = series([0, 0.1, 0.2, 0.3, np.nan, 0.3, 0.3, 0.3])
    assert A.plateau_start_step(acc) == A.plateau_start_step(acc.dropna()) == 50


# ---------------------------------------------------------------- stability


def test_kl_trend_rising_for_linear_growth_and_bounded_when_it_levels_off():
    steps = np.arange(1, 201)
    rising = A.kl_trend(pd.Series(1e-4 * steps, index=steps))
    assert rising.verdict == "rising"
    assert rising.first_step == 101 and rising.last_step == 200
    assert rising.change == pytest.approx(1e-4 * 99)
    saturating = A.kl_trend(pd.Series(0.05 * (1 - np.exp(-steps / 25)), index=steps))
    assert saturating.verdict == "bounded"
    noisy = np.random.default_rng(1).normal(0.05, 0.01, size=200)
    assert A.kl_trend(pd.Series(noisy, index=steps)).verdict == "bounded"
    assert A.kl_trend(pd.Series([0.1, 0.2, 0.3], index=[1, 2, 3])) is None


def test_grad_norm_spikes_strictly_above_the_clip_threshold_are_counted():
    grad = series([0.5] * 20, steps=range(1, 21))
    grad[[3, 7]] = [1.5, 4.0]
    grad[10] = 1.0  # at the threshold: not above
    grad[12] = np.nan
    assert A.steps_above(grad, 1.0) == [3, 7]
    frame = merge_records([train_record(s, actor__grad_norm=v) for s, v in grad.items()])
    stab = A.stability(frame, max_grad_norm=1.0)
    assert stab["grad_norm_over_clip_steps"] == 2
    assert stab["grad_norm_mean"] == pytest.approx(np.nanmean(grad.to_numpy()))
    assert A.stability(frame, max_grad_norm=0.4)["grad_norm_over_clip_steps"] == 19


def test_nonfinite_steps_found_by_nan_inf_and_skipped_updates_only():
    records = [
        {"step": 0, "val/accuracy_reward": 0.1},  # validation only: not a training step
        train_record(1),
        train_record(2, actor__pg_loss=math.nan),
        train_record(3, perf__throughput=math.inf),
        train_record(4, actor__nonfinite_skipped=1.0),
        train_record(5, actor__nonfinite_skipped=0.0),
        train_record(6, reward__overall=-math.inf),
    ]
    frame = merge_records(records)
    assert A.nonfinite_steps(frame) == [2, 3, 4, 6]
    assert A.summarize(frame)["stability"]["nonfinite_steps"] == 4
    # a metric the run never logs (kl_loss without a KL loss) is not a finding
    without_kl = merge_records([{k: v for k, v in train_record(s).items() if k != "actor/kl_loss"} for s in (1, 2)])
    assert A.nonfinite_steps(without_kl) == []


def test_clip_fraction_is_higher_plus_lower():
    frame = merge_records(
        [train_record(1, actor__pg_clipfrac_higher=0.01, actor__pg_clipfrac_lower=0.002),
         train_record(2, actor__pg_clipfrac_higher=0.03, actor__pg_clipfrac_lower=0.0)]
    )
    assert A.summarize(frame)["stability"]["clipfrac_mean"] == pytest.approx((0.012 + 0.03) / 2)


# ---------------------------------------------------------------- efficiency


def efficiency_records(validation_in_step: bool) -> list[dict]:
    records = [{"step": 0, "val/accuracy_reward": 0.0, "timing_s/validation": 30.0}]
    for step in range(1, 11):
        validated = step % 5 == 0
        timing = {"gen": 4.0, "old": 2.0, "ref": 1.0, "update_actor": 3.0}
        total = 10.0 + (30.0 if validated and validation_in_step else 0.0)
        records.append({
            "step": step,
            **{f"timing_s/{k}": v for k, v in timing.items()},
            "timing_s/step": total + step * 0.1,
            "perf/throughput": 100.0 + step,
            "perf/total_num_tokens": 1000.0,
            "perf/time_per_step": total,
            "perf/max_memory_allocated_gb": 10.0 + step,
            "perf/max_memory_reserved_gb": 20.0,
        })
        if validated:
            records.append({"step": step, "val/accuracy_reward": 0.1 * step, "timing_s/validation": 30.0})
    return records


@pytest.mark.parametrize("validation_in_step", [True, False])
def test_efficiency_splits_normal_and_validated_steps(validation_in_step):
    frame = merge_records(efficiency_records(validation_in_step))
    eff = A.efficiency(frame, validation_in_step=validation_in_step)
    normal = [s for s in range(1, 11) if s % 5]
    assert eff["normal_step_s_mean"] == pytest.approx(np.mean([10 + 0.1 * s for s in normal]))
    assert eff["val_step_s_mean"] == pytest.approx(np.mean([40 + 0.1 * s for s in (5, 10)]))
    assert eff["validation_s_mean"] == pytest.approx(30.0)
    assert eff["phase_s_mean"] == {"gen": 4.0, "old": 2.0, "ref": 1.0, "update_actor": 3.0}
    assert eff["throughput_per_gpu_mean"] == pytest.approx(np.mean([100 + s for s in normal]))
    assert eff["peak_memory_allocated_gb"] == 20.0 and eff["peak_memory_reserved_gb"] == 20.0


def test_gpu_count_is_inferred_from_tokens_time_and_throughput():
    frame = merge_records(
        [train_record(s, perf__total_num_tokens=8000.0, perf__time_per_step=10.0, perf__throughput=200.0)
         for s in (1, 2)]
    )
    assert A.infer_n_gpus(frame) == 4
    assert A.infer_n_gpus(merge_records([train_record(1)])) is None


# ---------------------------------------------------------------- records


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_easyr1_lines_are_flattened_and_later_launches_win_key_by_key(tmp_path):
    part1 = write_lines(tmp_path / "a.jsonl", [
        {"step": 0, "val": {"accuracy_reward": 0.1}},
        {"step": 5, "actor": {"pg_loss": 1.0}, "critic": {"score": {"mean": 0.2}}, "val": {"accuracy_reward": 0.2}},
        {"step": 6, "actor": {"pg_loss": 6.0}},
    ])
    part2 = write_lines(tmp_path / "b.jsonl", [
        {"step": 5, "val": {"accuracy_reward": 0.25}},  # re-validation after the resume
        {"step": 6, "actor": {"pg_loss": 6.5}},  # the step re-run after the resume
    ])
    records = read_easyr1([part1, part2])
    assert records[1] == {"step": 5, "actor/pg_loss": 1.0, "critic/score/mean": 0.2, "val/accuracy_reward": 0.2}
    frame = merge_records(records)
    assert list(frame.index) == [0, 5, 6]
    assert frame.loc[5, "actor/pg_loss"] == 1.0  # kept: the val-only line has no training keys
    assert frame.loc[5, "val/accuracy_reward"] == 0.25
    assert frame.loc[6, "actor/pg_loss"] == 6.5
    assert np.isnan(frame.loc[0, "actor/pg_loss"])


def test_a_truncated_last_line_is_skipped_but_bad_lines_elsewhere_are_errors(tmp_path):
    good = {"step": 1, "actor": {"pg_loss": 1.0}}
    path = write_lines(tmp_path / "log.jsonl", [good, '{"step": 2, "actor": {"pg_lo'])
    assert [r["step"] for r in read_easyr1([path])] == [1]
    path = write_lines(tmp_path / "log.jsonl", ['{"step": 2, "act', good])
    with pytest.raises(RecordError, match=r"log\.jsonl:1: not valid JSON"):
        read_easyr1([path])


@pytest.mark.parametrize(
    "line, message",
    [
        ({"actor": {"pg_loss": 1.0}}, "'step' must be a non-negative integer"),
        ({"step": -1}, "'step' must be a non-negative integer"),
        ({"step": 1, "actor": {"pg_loss": "high"}}, "metric 'actor/pg_loss' must be a number"),
        ({"step": 1, "samples": "none"}, "'samples' must be a list of objects"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_records_name_file_line_and_problem(tmp_path, line, message):
    path = write_lines(tmp_path / "log.jsonl", [line, {"step": 9}])
    with pytest.raises(RecordError, match=rf"log\.jsonl:1: .*{re.escape(message)}"):
        read_easyr1([path])


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(RecordError, match="metric file not found"):
        read_easyr1([tmp_path / "nope.jsonl"])
    with pytest.raises(RecordError, match="experiment folder not found"):
        read_experiment(tmp_path / "nope")
    with pytest.raises(RecordError, match="no records"):
        read_experiment(tmp_path)


# ---------------------------------------------------------------- a synthetic experiment folder

SAMPLE_TEXT = "<think>2 + 2 & more</think><script>alert(1)</script>"


def samples(step: int) -> list[dict]:
    # item 0 is well formatted from step 50 on, item 1 from step 100 on
    formatted = [step >= 50, step >= 100]
    return [
        {"index": i, "problem": f"problem {i} <b>", "ground_truth": str(i), "response": f"{SAMPLE_TEXT} @{step}",
         "overall": 0.5 * f, "format": float(f), "accuracy": 0.0}
        for i, f in enumerate(formatted)
    ]


def make_experiment(root: Path) -> Path:
    """results/<exp>/ as the tracker and evaluator write it, resumed once (steps 101-120 logged twice)."""
    exp = root / "exp"
    (exp / "val").mkdir(parents=True)
    lines = []
    for step in list(range(1, 121)) + list(range(101, 151)):
        resumed = len(lines) >= 120
        lines.append({
            **train_record(step, actor__grad_norm=2.0 if step in (30, 140) else 0.5,
                           actor__pg_loss=-1.0 if step == 110 and not resumed else 0.01),
            "perf/throughput": 50.0,
        })
    lines[-1]["actor/pg_loss"] = math.nan  # the tracker writes it as null
    for line in lines:
        append_record(exp / "metrics.jsonl", line)
    write_lines(exp / "val" / "step_000050.generations.jsonl", [{"index": 0, "response": "not a record"}])
    for step, (fmt, acc) in {0: (0.1, 0.0), 50: (0.9, 0.1), 100: (0.97, 0.3), 150: (0.99, 0.31)}.items():
        record = {"step": step, "val/format_reward": fmt, "val/accuracy_reward": acc,
                  "val/overall_reward": 0.5 * (fmt + acc), "val_response_length/mean": 100.0 - step / 10,
                  "val_response_length/clip_ratio": 0.1, "timing_s/validation": 20.0, "samples": samples(step)}
        (exp / "val" / f"step_{step:06d}.json").write_text(json.dumps(record))
    return exp


def test_read_experiment_orders_training_then_validation(tmp_path):
    records = read_experiment(make_experiment(tmp_path))
    assert len(records) == 170 + 4
    assert [r["step"] for r in records[-4:]] == [0, 50, 100, 150]
    frame = merge_records(records)
    assert len(A.training_rows(frame)) == 150
    assert frame.loc[110, "actor/pg_loss"] == 0.01  # the resumed launch's line is the last one


def test_build_report_writes_every_file_and_escapes_text(tmp_path):
    summary = build_report(read_experiment(make_experiment(tmp_path)), tmp_path / "report", title="exp <1>")
    out = tmp_path / "report"
    assert sorted(p.name for p in out.iterdir()) == sorted([*FIGURES, "report.html", "summary.json"])
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["steps"] == 150 and summary["train_steps"] == 150
    assert summary["val"]["first"]["step"] == 0 and summary["val"]["final"]["step"] == 150
    assert summary["val"]["best"] == {"step": 150, "accuracy": 0.31, "format": 0.99, "overall": 0.65,
                                      "response_length_mean": 85.0, "response_clip_ratio": 0.1}
    assert summary["phases"]["format_learned_step"] == 100
    assert summary["stability"]["grad_norm_over_clip_steps"] == 2
    assert summary["stability"]["pg_loss_min"] == 0.01  # the pre-resume outlier was overridden
    assert summary["stability"]["nonfinite_steps"] == 1  # step 150's null loss
    assert summary["efficiency"]["val_step_s_mean"] == pytest.approx(30.0)  # 10 s step + 20 s validation job
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(FIGURES)
    assert base64.b64decode(images[0]) == (out / "val_rewards.png").read_bytes()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<title>exp &lt;1&gt;</title>" in page
    # samples side by side: start, first all well formatted, final
    assert re.findall(r"<th>(step \d+ \([^<]*\))</th>", page) == [
        "step 0 (start)", "step 100 (first all well formatted)", "step 150 (final)"]
    assert "Format learning, steps 0–100" in page


def test_summary_has_the_interface_keys_and_nulls_without_data():
    summary = A.summarize(merge_records([{"step": 0, "val/accuracy_reward": 0.2}]))
    assert set(summary) == {"steps", "train_steps", "val", "phases", "stability", "efficiency"}
    assert set(summary["val"]) == {"first", "best", "final"}
    assert set(summary["val"]["first"]) == {"step", "accuracy", "format", "overall", "response_length_mean",
                                            "response_clip_ratio"}
    assert set(summary["stability"]) == {"nonfinite_steps", "grad_norm_mean", "grad_norm_over_clip_steps",
                                         "kl_loss_trend", "pg_loss_min", "pg_loss_max", "clipfrac_mean"}
    assert set(summary["efficiency"]) == {"normal_step_s_mean", "val_step_s_mean", "validation_s_mean",
                                          "phase_s_mean", "throughput_per_gpu_mean", "peak_memory_allocated_gb",
                                          "peak_memory_reserved_gb"}
    assert summary["steps"] is None and summary["train_steps"] == 0
    assert summary["stability"]["kl_loss_trend"] is None and summary["efficiency"]["normal_step_s_mean"] is None
    json.dumps(summary, allow_nan=False)


def test_cli_takes_title_and_clip_threshold_from_the_resolved_config(tmp_path, capsys):
    exp = make_experiment(tmp_path)
    cfg = validate(yaml.safe_load((REPO / "config.yaml").read_text()))
    cfg["experiment"] = "from_config"
    cfg["worker"]["actor"]["max_grad_norm"] = 0.4  # every step's grad norm (0.5 or 2.0) is above it
    write_resolved(cfg, exp / "config.resolved.yaml")
    assert main(["--experiment-dir", str(exp), "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["stability"]["grad_norm_over_clip_steps"] == 150
    assert "<h1>from_config</h1>" in (tmp_path / "r" / "report.html").read_text()
    assert "150 training steps" in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--experiment-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    assert "experiment folder not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--from-easyr1", "a.jsonl", "--config", "c.yaml", "--out", str(tmp_path)])
    assert "--config goes with --experiment-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "one of the arguments --experiment-dir --from-easyr1 is required" in capsys.readouterr().err


def test_every_figure_group_has_a_snakemake_caption():
    groups = {group for _title, group in FIGURES.values()} | {"report"}
    assert {p.stem for p in (REPO / "workflow" / "report").glob("*.rst")} >= groups

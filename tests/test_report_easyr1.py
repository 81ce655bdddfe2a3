"""The report built from the real EasyR1 run (two launches of one resumed run) through the CLI, checked
against numbers computed here directly from the raw JSONL, without the report's own readers."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from vlgrpo.report import FIGURES, main, merge_records, read_easyr1

RUN = Path(__file__).resolve().parents[2] / "shared" / "data" / "easyr1_geo3k_run"
LOGS = [RUN / "experiment_log_part1_steps_0_160.jsonl", RUN / "experiment_log_part2_steps_160_195.jsonl"]

pytestmark = pytest.mark.skipif(not all(p.is_file() for p in LOGS), reason=f"EasyR1 logs not found in {RUN}")


@pytest.fixture(scope="module")
def raw() -> dict:
    """Per step: the training line and the validation dict, later launches winning (plain json)."""
    train, val = {}, {}
    for path in LOGS:
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "actor" in entry:
                train[entry["step"]] = entry
            if "val" in entry:
                val[entry["step"]] = entry["val"]
    return {"train": train, "val": val}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("easyr1_report")
    assert main(["--from-easyr1", *map(str, LOGS), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def summary(report) -> dict:
    return json.loads((report / "summary.json").read_text())


def test_steps_and_validation_accuracy_match_the_raw_logs(summary, raw):
    val_steps = sorted(raw["val"])
    assert summary["train_steps"] == len(raw["train"]) == 195
    assert summary["steps"] == max(raw["train"]) == 195
    first, final = summary["val"]["first"], summary["val"]["final"]
    assert (first["step"], final["step"]) == (val_steps[0], val_steps[-1]) == (0, 195)
    assert first["accuracy"] == pytest.approx(raw["val"][0]["accuracy_reward"])
    assert final["accuracy"] == pytest.approx(raw["val"][195]["accuracy_reward"])
    best_step = max(val_steps, key=lambda s: (raw["val"][s]["accuracy_reward"], -s))
    assert summary["val"]["best"]["step"] == best_step
    assert summary["val"]["best"]["accuracy"] == pytest.approx(raw["val"][best_step]["accuracy_reward"])
    learned = next(s for s in val_steps if raw["val"][s]["format_reward"] >= 0.95)
    assert summary["phases"]["format_learned_step"] == learned == 20


def test_step_times_match_the_raw_logs(summary, raw):
    normal = [e["timing_s"]["step"] for s, e in raw["train"].items() if s not in raw["val"]]
    validated = [e["timing_s"]["step"] for s, e in raw["train"].items() if s in raw["val"]]
    assert len(normal) == 156 and len(validated) == 39
    eff = summary["efficiency"]
    assert eff["normal_step_s_mean"] == pytest.approx(statistics.mean(normal))
    assert eff["val_step_s_mean"] == pytest.approx(statistics.mean(validated))  # EasyR1: validation inside
    gen = [e["timing_s"]["gen"] for s, e in raw["train"].items() if s not in raw["val"]]
    assert eff["phase_s_mean"]["gen"] == pytest.approx(statistics.mean(gen))
    throughput = [e["perf"]["throughput"] for s, e in raw["train"].items() if s not in raw["val"]]
    assert eff["throughput_per_gpu_mean"] == pytest.approx(statistics.mean(throughput))
    assert eff["peak_memory_reserved_gb"] == max(e["perf"]["max_memory_reserved_gb"] for e in raw["train"].values())


def test_stability_matches_the_raw_logs(summary, raw):
    grad = [e["actor"]["grad_norm"] for e in raw["train"].values()]
    pg = [e["actor"]["pg_loss"] for e in raw["train"].values()]
    stab = summary["stability"]
    assert stab["nonfinite_steps"] == 0
    assert stab["grad_norm_mean"] == pytest.approx(statistics.mean(grad))
    assert stab["grad_norm_over_clip_steps"] == sum(g > 1.0 for g in grad) == 6
    assert (stab["pg_loss_min"], stab["pg_loss_max"]) == (pytest.approx(min(pg)), pytest.approx(max(pg)))
    assert stab["kl_loss_trend"] == "bounded"  # KL levels off near 0.05 (coef 0.01, low_var_kl)


def test_the_revalidation_of_step_160_keeps_its_training_metrics(raw):
    frame = merge_records(read_easyr1(LOGS))
    assert frame.loc[160, "actor/pg_loss"] == raw["train"][160]["actor"]["pg_loss"]
    assert frame.loc[160, "val/accuracy_reward"] == raw["val"][160]["accuracy_reward"]
    assert frame.loc[160, "timing_s/validation"] == raw["train"][160]["timing_s"]["validation"]


def test_report_files_and_written_analysis(report, summary):
    assert all((report / name).stat().st_size > 10_000 for name in FIGURES)
    page = (report / "report.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(FIGURES)
    assert "first ≥ 95% at step 20" in page
    assert f"Plateau from step {summary['phases']['plateau_start_step']}" in page
    assert "6 of 195 steps (3.1%) above the clip threshold 1" in page
    assert "No validation generations were logged" in page

"""scripts/bench_segments.py on the CPU demo: two segments through Snakemake, each validated in-process
and adopted by its evaluate job, every overhead part accounted for."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_segments", ROOT / "scripts" / "bench_segments.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_segment_whose_checkpoint_the_evaluate_job_validated_has_no_negative_part(tmp_path):
    """In-process validation failed after 12 s; the evaluate job then validated the checkpoint in 40 s and
    logged its own timing_s/validation at that step. The segment's parts come from its own marker."""
    exp = tmp_path / "exp"
    (exp / "segments").mkdir(parents=True)
    times = {"startup": 4.0, "build_model": 2.0, "load_checkpoint": 0.0, "train": 20.5, "save_checkpoint": 15.0, "validation": 12.0,
             "prune": 1.5}
    (exp / "segments" / "step_000002.json").write_text(json.dumps(
        {"timing_s": times, "validated_in_process": False, "job_start": 1000.0, "job_end": 1055.5}))
    records = [{"kind": "train", "step": 1, "timing_s/step": 10.0}, {"kind": "train", "step": 2, "timing_s/step": 10.0},
               {"kind": "train", "step": 2, **{f"timing_s/{k}": v for k, v in times.items()}},
               {"kind": "val", "step": 2, "timing_s/validation": 40.0, "timing_s/generation": 35.0}]
    (exp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    [row] = load_script().segment_table(exp, [2], 2, [990.0])

    parts = row["overhead_parts_s"]
    assert all(v >= 0 for v in parts.values()), parts
    assert parts["validation_other"] == 12.0 and parts["job_other"] == pytest.approx(0.5) and parts["scheduling_gap"] == 10.0
    assert parts["prune"] == 1.5
    assert sum(v for k, v in parts.items() if k != "scheduling_gap") + row["steps_s"] == pytest.approx(row["job_s"])


@pytest.mark.slow
def test_bench_segments_on_the_cpu(tmp_path):
    bench = load_script()
    out = tmp_path / "bench.json"
    result = bench.main(["--cpu", "--segments", "2", "--steps", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text())["segments"] == result["segments"]
    assert [s["end_step"] for s in result["segments"]] == [2, 4]
    assert result["adopted_validations"] == [True, True]
    for segment in result["segments"]:
        assert segment["validated_in_process"] and segment["validation_generation_s"] > 0 and segment["steps_s"] > 0
        parts = segment["overhead_parts_s"]
        assert parts["startup"] > 0 and parts["save_checkpoint"] > 0 and parts["scheduling_gap"] > 0
        assert segment["overhead_s"] == pytest.approx(sum(parts.values()))
        # The parts and the measured work add up to the job's wall time.
        inside = sum(v for k, v in parts.items() if k != "scheduling_gap")
        assert inside + segment["steps_s"] + segment["validation_generation_s"] == pytest.approx(segment["job_s"], rel=1e-6)
    assert result["segments"][1]["overhead_parts_s"]["load_checkpoint"] > 0
    # Only the run's last segment prunes after its save; the first pruned behind its training.
    assert result["segments"][0]["overhead_parts_s"]["prune"] == 0 < result["segments"][1]["overhead_parts_s"]["prune"]

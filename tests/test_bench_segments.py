"""scripts/bench_segments.py on the CPU demo: two segments through Snakemake, each validated in-process
and adopted by its evaluate job, every overhead part accounted for."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_segments_on_the_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_segments", ROOT / "scripts" / "bench_segments.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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

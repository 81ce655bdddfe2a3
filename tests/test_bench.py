"""The CPU benchmark on the tiny demo model: the production step, optimized and plain, and its JSON."""

import json

import pytest
import yaml

from conftest import ROOT
from vlgrpo import bench


def test_cpu_benchmark_writes_the_table_json(demo_base, tmp_path, capsys):
    cfg = yaml.safe_load((ROOT / "configs" / "bench_cpu.yaml").read_text())
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["model"]["path"] = demo_base["model"]["path"]
    cfg["data"]["train"], cfg["data"]["val"] = demo_base["data"]["train"], demo_base["data"]["val"]
    path = tmp_path / "bench_cpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "bench.json"

    result = bench.main(["--config", str(path), "--plain", str(ROOT / "configs" / "plain.yaml"), "--out", str(out), "--warmup", "1", "--steps", "2", "--profile"])

    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    for key in ("device", "step_s", "phase_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_allocated_gb",
                "peak_memory_reserved_gb", "plain_step_s", "speedup", "eval", "greedy_vs_hf"):
        assert key in saved, key
    assert saved["device"].startswith("cpu") and saved["weights"] == "loaded"
    assert saved["steps"] == [2, 3] and saved["plain"]["steps"] == [2]  # the plain path sees the first measured prompts
    phases = saved["phase_s"]
    assert set(phases) >= {"gen", "old", "ref", "update_actor"}
    assert all(v > 0 for k, v in phases.items() if k != "adv")
    assert sum(phases.values()) <= saved["step_s"] * 1.05
    assert saved["response_length_mean"] == 32  # ignore_eos: every response is max_response_length long
    assert saved["tokens_per_step"] > 8 * 4 * 32  # 8 prompts x 4 samples x 32 response tokens + prompts
    assert saved["tokens_per_s_per_gpu"] == pytest.approx(saved["tokens_per_step"] / saved["step_s"])
    assert 0 < saved["mfu"] < 1 and saved["peak_source"] == "measured matmul"
    assert saved["peak_memory_allocated_gb"] is None  # tracked on CUDA devices only
    assert saved["speedup"] == pytest.approx(saved["plain_step_s"] / saved["step_s"])
    assert saved["greedy_vs_hf"]["identical_rows"] == saved["greedy_vs_hf"]["rows"]  # float32: same tokens
    assert saved["eval"]["items"] == 16 and saved["eval"]["eval_s"] >= saved["eval"]["generate_s"] > 0
    assert "speed-up" in capsys.readouterr().out
    # --profile: the last measured step's phases, each with its wall time, beside the JSON
    profile = {line.split()[0]: float(line.split()[1]) for line in out.with_suffix(".profile.txt").read_text().splitlines()[1:7]}
    assert set(profile) == {"gen", "old", "ref", "reward", "adv", "update_actor"}
    assert 0 < profile["update_actor"] <= saved["steps_s"][-1]

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
    # --profile: one more step, not among the measured ones, its phases with their wall times beside the JSON
    profile = {line.split()[0]: float(line.split()[1]) for line in out.with_suffix(".profile.txt").read_text().splitlines()[1:7]}
    assert set(profile) == {"gen", "old", "ref", "reward", "adv", "update_actor"}
    assert saved["profiled_step"]["step"] == 4
    assert 0 < profile["update_actor"] <= saved["profiled_step"]["step_s"]
    # and a second validation: the static engine's prefill and decode
    eval_profile = {line.split()[0]: float(line.split()[1]) for line in out.with_suffix(".eval.profile.txt").read_text().splitlines()[1:4]}
    assert set(eval_profile) == {"prefill", "vision", "decode"}
    assert 0 < eval_profile["prefill"] + eval_profile["decode"] <= saved["eval"]["generate_s"] * 2


def test_the_profile_summary_puts_each_kernel_in_the_phase_that_launched_it():
    """A kernel launched at the end of `old` and run during `ref` counts for `old`; busy = kernel / wall."""
    events = [
        {"cat": "user_annotation", "name": "old", "ts": 0.0, "dur": 1e6},
        {"cat": "user_annotation", "name": "ref", "ts": 1e6, "dur": 2e6},
        {"cat": "user_annotation", "name": "encode", "ts": 1e6, "dur": 1e5},  # not a phase
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9e5, "dur": 5.0, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "gemm", "ts": 1.1e6, "dur": 5e5, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.5e6, "dur": 5.0, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "softmax", "ts": 1.6e6, "dur": 2.5e5, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.7e6, "dur": 5.0, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "gemm", "ts": 1.8e6, "dur": 2.5e5, "args": {"correlation": 3}},
    ]
    events += [  # the operators around the launches: each kernel counts for the innermost on its thread
        {"cat": "cpu_op", "name": "aten::linear", "ts": 8e5, "dur": 2e5, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 9e5 - 1, "dur": 10.0, "tid": 1},
        {"cat": "cpu_op", "name": "aten::softmax", "ts": 1.5e6 - 1, "dur": 0.5, "tid": 1},  # ended before the launch
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.5e6 - 9, "dur": 1.0, "tid": 2},  # another thread's
        {"cat": "cpu_op", "name": "aten::_softmax", "ts": 1.5e6 - 5, "dur": 20.0, "tid": 1},
    ]
    for e in events[3:]:
        e.setdefault("tid", 1)
    lines = bench.profile_summary(events).splitlines()
    rows = {line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:]] for line in lines[1:3]}
    assert rows["old"] == [1.0, 0.5, 50.0, 1.0, 1e6]  # wall s, gpu s, busy %, kernels, us per launch
    assert rows["ref"] == [2.0, 0.5, 25.0, 2.0, 1e6]
    assert "encode" not in rows
    ref_kernels = lines[lines.index("ref: costliest kernels (s)") + 1: lines.index("ref: costliest operators (s)") - 1]
    assert [line.split() for line in ref_kernels] == [["0.250", "softmax"], ["0.250", "gemm"]]  # ties in launch order
    assert [line.split() for line in lines[lines.index("ref: costliest operators (s)") + 1:]] == [
        ["0.250", "aten::_softmax"], ["0.250", "(no", "operator)"]]
    old_ops = lines[lines.index("old: costliest operators (s)") + 1]
    assert old_ops.split() == ["0.500", "aten::mm"]  # within aten::linear, the innermost


def test_a_nested_phase_takes_its_kernels_from_the_outer_one_and_sums_its_ranges():
    """Two `vision` ranges within `prefill`: vision's kernels are not prefill's; its walls add up."""
    events = [{"cat": "user_annotation", "name": "prefill", "ts": 0.0, "dur": 1e6}]
    for i, start in enumerate((1e5, 5e5)):
        events += [
            {"cat": "user_annotation", "name": "vision", "ts": start, "dur": 1e5},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": start + 10, "dur": 5.0, "args": {"correlation": i}},
            {"cat": "kernel", "name": "conv", "ts": start + 20, "dur": 5e4, "args": {"correlation": i}},
        ]
    events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9e5, "dur": 5.0, "args": {"correlation": 9}},
               {"cat": "kernel", "name": "gemm", "ts": 9e5, "dur": 1e5, "args": {"correlation": 9}}]
    lines = bench.profile_summary(events, ("prefill", "vision")).splitlines()
    rows = {line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:]] for line in lines[1:3]}
    assert rows["prefill"][:2] == [1.0, 0.1] and rows["vision"][:2] == [0.2, 0.1]
    assert lines[3] == "" and lines.count("vision: costliest kernels (s)") == 1

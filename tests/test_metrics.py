"""Metrics as EasyR1 logs them: the pure functions against hand-computed values, and the key set of a
real segment + validation of the demo against the keys of the seed EasyR1 run's logs."""

import json
import math

import pytest
import torch
from transformers import AutoConfig

from conftest import SHARED, make_experiment, needs_shared
from vlgrpo import config, evaluate, metrics, paths
from vlgrpo.tracking import read_metrics, read_records
from vlgrpo.trainer import run_segment

SEED_LOGS = sorted((SHARED / "easyr1_geo3k_run").glob("experiment_log_*.jsonl"))
VAL_GROUPS = ("val/", "val_prompt_length/", "val_response_length/")


def seed_keys() -> tuple[set, set]:
    """Metric keys of the seed run's training records and of its validation-only records; the
    validated steps' records (both kinds in one) add timing_s/validation to the validation keys."""
    train, val = set(), set()
    for record in (r for path in SEED_LOGS for r in read_records(path)):
        keys = set(record) - {"step"}
        val |= {k for k in keys if k.startswith(VAL_GROUPS)}
        train |= {k for k in keys if not k.startswith(VAL_GROUPS)}
    train.discard("timing_s/validation")
    return train, val | {"timing_s/validation"}


def test_data_and_length_metrics():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    advantages = torch.tensor([1.0, -1.0, 0.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])  # the third response is empty
    out = metrics.data_metrics(scores, scores, advantages, mask)
    assert out["critic/score/mean"] == out["critic/rewards/mean"] == 0.5
    # Over valid tokens: 1, 1, -1, 2, 2, 2.
    assert out["critic/advantages/mean"] == out["critic/returns/mean"] == pytest.approx(7 / 6)
    assert (out["critic/advantages/min"], out["critic/advantages/max"]) == (-1.0, 2.0)
    lengths = metrics.length_metrics("response_length", torch.tensor([3, 1, 0, 3]), 3)
    assert lengths == {"response_length/mean": 1.75, "response_length/max": 3.0, "response_length/min": 0.0,
                       "response_length/clip_ratio": 0.5}


def test_seqlen_balance_as_easyr1_reports_it():
    seqlens = [10, 20, 30, 40]
    one = metrics.seqlen_metrics(seqlens)
    assert one == {"global_seqlen/min": 100, "global_seqlen/max": 100, "global_seqlen/minmax_diff": 0,
                   "global_seqlen/balanced_min": 100, "global_seqlen/balanced_max": 100, "global_seqlen/mean": 100.0}
    two = metrics.seqlen_metrics(seqlens, partitions=[[0, 3], [1, 2]], world=2)
    assert (two["global_seqlen/min"], two["global_seqlen/max"], two["global_seqlen/minmax_diff"]) == (30, 70, 40)
    assert (two["global_seqlen/balanced_min"], two["global_seqlen/balanced_max"], two["global_seqlen/mean"]) == (50, 50, 50.0)


@needs_shared("easyr1_geo3k_run")
def test_timing_per_token_and_throughput_match_the_seed_logs():
    """Step 1 of the seed run: its per-token times and throughput follow from its own timings."""
    step1 = read_records(SEED_LOGS[0])[1]
    timing = {k.split("/")[1]: v for k, v in step1.items() if k.startswith("timing_s/")}
    response_tokens = round(step1["response_length/mean"] * 128)  # 32 prompts x 4 samples
    total = step1["perf/total_num_tokens"]
    out = metrics.timing_metrics(timing, response_tokens, total)
    for key, value in step1.items():
        if key.startswith("timing_per_token_ms/"):
            assert out[key] == pytest.approx(value, rel=1e-9), key
    assert "timing_per_token_ms/step" not in out
    perf = metrics.throughput_metrics(total, step1["timing_s/step"], world=4)  # the seed run's 4 GPUs
    assert perf["perf/throughput"] == pytest.approx(step1["perf/throughput"], rel=1e-9)
    assert step1["global_seqlen/mean"] == total / 4


@needs_shared("qwen2_5_vl_3b")
def test_mfu_of_the_3b_model():
    text = AutoConfig.from_pretrained(SHARED / "qwen2_5_vl_3b").get_text_config()
    flops = metrics.actor_flops(text, [1000])
    # 3.09e9 dense parameters (36 layers, embedding and LM head counted twice as EasyR1 does) x 6 x 1000 tokens, plus attention.
    dense = ((2048 * 11008 * 3 + 2048 * (2048 + 2 * 256 + 2048)) * 36 + 151936 * 2048 * 2)
    assert flops == 6 * dense * 1000 + 12 * 1000**2 * 128 * 16 * 36
    assert metrics.mfu(flops, 1.0, 1, 989.0, 1) == pytest.approx(flops / 989e12)
    assert metrics.mfu(flops, 1.0, 1, None, 1) == 0.0  # CPU or an unlisted GPU, as EasyR1 logs it
    assert metrics.peak_tflops(torch.device("cpu")) is None


@pytest.fixture(scope="module")
def demo_run(demo_base, tmp_path_factory):
    """A real segment of 2 steps (with its checkpoint save) and the validation of step 2 and the baseline."""
    cfg = make_experiment(demo_base, tmp_path_factory.mktemp("metrics"),
                          {"trainer": {"max_steps": 2, "save_freq": 2, "val_freq": 2}})
    exp = config.experiment_dir(cfg)
    run_segment(cfg, 2, paths.path(paths.MARKER, exp, step=2))
    for step in (0, 2):
        evaluate.main(paths.path(paths.RESOLVED, exp), step)
    return cfg, paths.path(paths.METRICS, exp)


@pytest.mark.slow
@needs_shared("easyr1_geo3k_run")
def test_every_seed_key_is_logged_with_its_kind(demo_run):
    cfg, path = demo_run
    train_keys, val_keys = seed_keys()
    assert len(train_keys | val_keys) == 72  # 73 with "step"
    records = read_records(path)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 2]  # step 2's segment timings come after the save
    for record in train[:2]:
        missing = train_keys - {"timing_s/save_checkpoint"} - set(record)
        assert not missing, (record["step"], sorted(missing))
    phases = {f"timing_s/{k}" for k in ("startup", "build_model", "load_checkpoint", "train", "save_checkpoint")}
    assert phases <= train[-1].keys() and all(k.startswith("timing_s/") for k in train[-1].keys() - {"step", "kind"})
    assert [r["step"] for r in val] == [0, 2]
    for record in val:
        assert val_keys <= set(record), sorted(val_keys - set(record))
    merged = {r["step"]: r for r in read_metrics(path)}
    assert train_keys | val_keys <= set(merged[2])  # the validated step reads as EasyR1's one record
    step2 = merged[2]
    assert step2["val/accuracy_reward"] == json.loads(paths.path(paths.VAL, config.experiment_dir(cfg), step=2).read_text())["val/accuracy_reward"]


@pytest.mark.slow
def test_logged_values_mean_what_easyr1_means(demo_run):
    cfg, path = demo_run
    step = {r["step"]: r for r in read_metrics(path)}[2]  # a validated step, saved after
    n = cfg["worker"]["rollout"]["n"] * cfg["worker"]["rollout"]["batch_size"]
    total = step["perf/total_num_tokens"]
    assert total == pytest.approx(n * (step["prompt_length/mean"] + step["response_length/mean"]))
    assert step["global_seqlen/mean"] == step["global_seqlen/min"] == step["global_seqlen/balanced_max"] == total  # one process
    assert step["perf/throughput"] == pytest.approx(total / step["timing_s/step"])  # one device: this process
    assert step["critic/rewards/mean"] == step["critic/score/mean"] == pytest.approx(step["reward/overall"])
    assert step["critic/returns/mean"] == step["critic/advantages/mean"]
    assert step["timing_per_token_ms/gen"] == pytest.approx(step["timing_s/gen"] * 1000 / (n * step["response_length/mean"]))
    assert step["timing_per_token_ms/update_actor"] == pytest.approx(step["timing_s/update_actor"] * 1000 / total)
    assert step["perf/mfu_actor"] == 0.0  # a CPU has no listed peak
    assert 0 < step["perf/max_memory_allocated_gb"] == step["perf/max_memory_reserved_gb"]  # the process's peak RSS
    assert step["perf/max_memory_allocated_gb"] >= step["perf/cpu_memory_rss_gb"] > 0
    assert step["timing_s/save_checkpoint"] > 0 and step["timing_s/validation"] > 0
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in step.values())

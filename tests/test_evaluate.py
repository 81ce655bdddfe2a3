"""Validation of a step: metrics with EasyR1 names, every response scored, fixed logged items."""

import json

import pytest

from conftest import make_experiment
from vlgrpo import config, paths
from vlgrpo.evaluate import evaluate, logged_items, model_path_for
from vlgrpo.rewards import r1v


def test_baseline_evaluation_writes_scored_generations(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"val_generations_to_log": 4}})
    record = evaluate(cfg, 0)
    exp = config.experiment_dir(cfg)
    assert json.loads(paths.path(paths.VAL, exp, step=0).read_text()) == record
    lines = [json.loads(l) for l in paths.path(paths.GENERATIONS, exp, step=0).read_text().splitlines()]
    n_val = json.loads(paths.path(paths.STATS, exp, split="val").read_text())["rows_kept"]
    assert len(lines) == n_val  # greedy, n = 1 in the demo config
    for line in lines:  # every response carries the score the grader gives it
        assert {k: line[k] for k in ("overall", "format", "accuracy")} == r1v(line["response"], line["ground_truth"])
    assert record["val/accuracy_reward"] == pytest.approx(sum(l["accuracy"] for l in lines) / len(lines))
    assert record["val/overall_reward"] == record["val/reward_score"]
    assert record["val_response_length/max"] <= cfg["data"]["max_response_length"]
    assert record["val_response_length/clip_ratio"] == pytest.approx(
        sum(l["length"] == cfg["data"]["max_response_length"] for l in lines) / len(lines))
    assert record["val/tokens_per_s"] > 0
    parts = [record[f"timing_s/{k}"] for k in ("encode", "generation", "scoring")]
    assert all(t > 0 for t in parts) and sum(parts) <= record["timing_s/validation"]
    # The logged items are a fixed, seeded choice: the same at every step.
    assert [s["index"] for s in record["samples"]] == [lines[i]["index"] for i in logged_items(cfg["seed"], n_val, 4)]
    assert logged_items(1, 100, 8) == logged_items(1, 100, 8) != logged_items(2, 100, 8)


def test_sampled_validation_with_n_gives_pass_at_n(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path,
                          {"worker": {"rollout": {"val_override_config": {"temperature": 1.0, "top_p": 1.0, "n": 3}}}})
    record = evaluate(cfg, 0)
    lines = [json.loads(l) for l in paths.path(paths.GENERATIONS, config.experiment_dir(cfg), step=0).read_text().splitlines()]
    assert {l["sample"] for l in lines} == {0, 1, 2}
    by_item = {}
    for l in lines:
        by_item.setdefault(l["index"], []).append(l["accuracy"])
    assert record["val/pass@3"] == pytest.approx(sum(max(a) for a in by_item.values()) / len(by_item))
    assert record["val/pass@3"] >= record["val/accuracy_reward"]
    # Same seed, same numbers.
    assert evaluate(cfg, 0)["val/accuracy_reward"] == record["val/accuracy_reward"]


def test_missing_checkpoint_weights_are_a_clear_error(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path)
    with pytest.raises(FileNotFoundError, match="no model weights for step 5"):
        model_path_for(cfg, 5)


def test_top_k_one_samples_the_greedy_responses_and_val_takes_the_rollouts_top_k(demo_base, tmp_path):
    """val_override_config.top_k unset (null) takes worker.rollout.top_k, as EasyR1 overrides only the keys given."""
    greedy = make_experiment(demo_base, tmp_path / "greedy", {"worker": {"rollout": {"val_override_config": {"temperature": 0}}}})
    top1 = make_experiment(demo_base, tmp_path / "top1", {"worker": {"rollout": {
        "top_k": 1, "val_override_config": {"temperature": 1.0, "top_p": 1.0}}}})
    evaluate(greedy, 0)
    evaluate(top1, 0)

    def responses(cfg):
        return [json.loads(l)["response"] for l in paths.path(paths.GENERATIONS, config.experiment_dir(cfg), step=0).read_text().splitlines()]

    assert responses(top1) == responses(greedy)


REWARD_WITHOUT_FORMAT = '''
REWARD_TYPE = "batch"


def compute_score(reward_inputs, bonus):
    return [{"overall": float(r["ground_truth"] in r["response"]) + bonus, "accuracy": float(r["ground_truth"] in r["response"]),
             "length": float(r["response_length"])} for r in reward_inputs]
'''


def test_a_reward_without_format_logs_its_own_keys(demo_base, tmp_path):
    """EasyR1's dapo.py-style results (no `format`) with reward_function_kwargs: val/<key>_reward for each key."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_WITHOUT_FORMAT)
    cfg = make_experiment(demo_base, tmp_path, {"worker": {"reward": {
        "reward_function": f"{reward}:compute_score", "reward_function_kwargs": {"bonus": 0.5}}}})
    record = evaluate(cfg, 0)
    lines = [json.loads(l) for l in paths.path(paths.GENERATIONS, config.experiment_dir(cfg), step=0).read_text().splitlines()]
    assert "val/format_reward" not in record
    assert record["val/length_reward"] == pytest.approx(sum(l["length"] for l in lines) / len(lines))
    assert record["val/overall_reward"] == pytest.approx(record["val/accuracy_reward"] + 0.5) == record["val/reward_score"]
    assert record["val/pass@1"] == pytest.approx(record["val/accuracy_reward"])

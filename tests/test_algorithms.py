"""EasyR1's algorithm menu in the trainer on the tiny demo: config keys and refusals, KL in the reward
with its adaptive controller, DAPO's online filtering (deterministic, resumable), and 20-step runs
of every loss type and advantage estimator."""

import math

import pytest
import torch

from conftest import make_experiment
from vlgrpo import config, estimators, grpo, paths
from vlgrpo.rollout import SamplingParams
from vlgrpo.tracking import read_metrics
from vlgrpo.trainer import GRPOTrainer, run_segment

SMALL = {"rollout": {"n": 4, "batch_size": 2}, "actor": {"global_batch_size": 2}}

# Prompts with an even number of triangles (the answer is their angle sum, 180 per triangle) score 1
# on every sample (an all-equal group, mean 1); the others score the parity of the response's length
# (mixed groups, now and then all-equal ones).
PARITY_REWARD = '''
def compute(response, ground_truth):
    if int(ground_truth) // 180 % 2 == 0:
        return {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
    hit = float(len(response) % 2)
    return {"overall": hit, "format": 1.0, "accuracy": hit}
'''


def experiment(demo_base, folder, algorithm=None, actor=None, **groups):
    worker = {"rollout": {**demo_base["worker"]["rollout"], **SMALL["rollout"]},
              "actor": {**demo_base["worker"]["actor"], **SMALL["actor"], **(actor or {})}}
    worker.update(groups.pop("worker", {}))
    overrides = {"worker": worker, "algorithm": {**demo_base["algorithm"], **(algorithm or {})}, **groups}
    return make_experiment(demo_base, folder, overrides)


def test_easyr1_keys_and_refusals(demo_base):
    for bad, match in (({"algorithm": {"kl_type": "low_var_kl"}}, "kl_penalty: low_var_kl"),
                       ({"algorithm": {"adv_estimator": "gae"}}, "critic"),
                       ({"algorithm": {"kl_penalty": "full"}}, "vocabulary")):
        with pytest.raises(config.ConfigError, match=match):
            config.validate(config.deep_merge(demo_base, bad))
    cfg = config.validate(config.deep_merge(demo_base, {"algorithm": {"kl_type": "adaptive"}}))
    assert (cfg["algorithm"]["kl_type"], cfg["algorithm"]["kl_horizon"], cfg["algorithm"]["kl_target"]) == ("adaptive", 10000.0, 0.1)


def test_reference_model_only_when_kl_is_used(demo_base, tmp_path):
    built = {}
    for name, algorithm in (("off", {"disable_kl": True}), ("reward", {"use_kl_loss": False})):
        t = GRPOTrainer(experiment(demo_base, tmp_path / name, algorithm))
        t.load(0)
        built[name] = t.ref is not None
    assert built == {"off": False, "reward": True}


def test_kl_in_the_reward_and_the_adaptive_controller(demo_base, tmp_path, monkeypatch):
    """use_kl_loss false: each token's reward is its score minus kl_coef x KL of the rollout policy from
    the reference; reward/overall is the score before it, critic/rewards after it; no KL loss. The
    adaptive controller moves kl_coef from step to step as EasyR1's does for the logged KL sequence."""
    algorithm = {"use_kl_loss": False, "kl_penalty": "kl", "kl_coef": 0.05, "kl_type": "adaptive",
                 "kl_target": 1e-4, "kl_horizon": 50.0}
    cfg = experiment(demo_base, tmp_path, algorithm)
    seen = []
    real = estimators.kl_in_reward

    def spy(token_scores, old_logp, ref_logp, mask, kl_coef, kind):
        out = real(token_scores, old_logp, ref_logp, mask, kl_coef, kind)
        seen.append((token_scores, old_logp, ref_logp, mask, kl_coef, kind, out))
        return out

    monkeypatch.setattr(estimators, "kl_in_reward", spy)
    t = GRPOTrainer(cfg)
    t.load(0)
    records = [t.step(s) for s in (1, 2, 3)]
    for record, (scores, old, ref, mask, coef, kind, (rewards, current)) in zip(records, seen):
        assert kind == "kl" and coef == record["actor/kl_coef"]
        penalty = grpo.kl_penalty(old, ref, "kl") * mask
        assert torch.allclose(rewards, scores - coef * penalty, atol=1e-7)
        assert scores.sum(-1).mean().item() == pytest.approx(record["reward/overall"], abs=1e-6)
        assert (rewards * mask).sum(-1).mean().item() == pytest.approx(record["critic/rewards/mean"], abs=1e-6)
        assert record["actor/kl_penalty"] == current
        assert "actor/kl_loss" not in record
    assert records[0]["actor/kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert records[2]["actor/kl_penalty"] > 0
    assert records[2]["critic/rewards/mean"] < records[2]["critic/score/mean"]  # KL > 0 costs reward
    rows = 2 * 4
    coef = 0.05
    for before, after in zip(records, records[1:]):
        error = min(max(before["actor/kl_penalty"] / 1e-4 - 1.0, -0.2), 0.2)
        coef = coef * (1.0 + error * rows / 50.0)
        assert after["actor/kl_coef"] == pytest.approx(coef, rel=1e-12)
    assert records[1]["actor/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 50))  # KL 0 < target: down by the clip
    error = min(max(records[2]["actor/kl_penalty"] / 1e-4 - 1.0, -0.2), 0.2)
    assert t.kl_coef == pytest.approx(coef * (1.0 + error * rows / 50.0), rel=1e-12)  # step 4's, checkpointed with step 3


def parity_reward(demo_base, folder) -> dict:
    """worker.reward with PARITY_REWARD written into `folder`."""
    reward = folder / "parity.py"
    folder.mkdir(parents=True, exist_ok=True)
    reward.write_text(PARITY_REWARD)
    return {**demo_base["worker"]["reward"], "reward_function": f"{reward}:compute"}


def filtering_experiment(demo_base, folder, algorithm=None, **trainer):
    filtering = {"online_filtering": True, "filter_key": "overall", "filter_low": 0.01, "filter_high": 0.99}
    return experiment(
        demo_base, folder, {**filtering, **(algorithm or {})},
        worker={"reward": parity_reward(demo_base, folder)},
        data={**demo_base["data"], "mini_rollout_batch_size": 2},
        trainer={**demo_base["trainer"], "max_steps": 100, "val_freq": 100, **trainer},
    )


def test_online_filtering_keeps_only_groups_inside_the_band(demo_base, tmp_path):
    cfg = filtering_experiment(demo_base, tmp_path)
    t = GRPOTrainer(cfg)
    t.load(0)
    params = SamplingParams(1.0, 1.0, cfg["data"]["max_response_length"])
    even = sum(int(r["answer"]) // 180 % 2 == 0 for r in t.rows)
    assert 0 < even < len(t.rows)  # both kinds of prompt exist
    for step in (1, 2):
        # tries are a pure function of (seed, step, try), never repeat a prompt within a step
        tried = [t.try_indices(step, k) for k in (1, 2, 3)]
        assert tried == [t.try_indices(step, k) for k in (1, 2, 3)]
        flat = [i for part in tried for i in part]
        assert len(set(flat)) == len(flat) == 6 and tried[0] == t.batch_indices(step, 2)
        rows, prompts, out, grading, _, info = t.make_batch(step, params)
        scores, _ = grading.result()
        means = torch.tensor([s["overall"] for s in scores]).view(-1, 4).mean(1)
        assert len(rows) == 2 and len(prompts) == 8 and out.responses.shape[0] == 8
        assert all(0.01 < m < 0.99 for m in means.tolist())
        assert all(int(r["answer"]) // 180 % 2 for r in rows)  # no all-equal (even-count) group was kept
        tried_rows = [t.rows[i] for k in range(1, info["batch/num_try_make_batch"] + 1) for i in t.try_indices(step, k)]
        kept = {r["index"] for r in rows}
        assert [r["index"] for r in rows] == [r["index"] for r in tried_rows if r["index"] in kept]  # in the order tried
        assert info["batch/num_prompts_tried"] == 2 * info["batch/num_try_make_batch"] >= 2
        # the kept rows' prompts are the ones the responses were generated for
        assert prompts.prompt_ids.tolist() == [p for p in range(2) for _ in range(4)]
    record = t.step(3)
    assert record["batch/num_try_make_batch"] >= 1 and "reward/overall" in record


def test_online_filtering_stops_after_max_try_make_batch(demo_base, tmp_path):
    cfg = filtering_experiment(demo_base, tmp_path, max_try_make_batch=1)
    cfg["algorithm"]["filter_low"] = 2.0  # nothing can pass
    t = GRPOTrainer(cfg)
    t.load(0)
    with pytest.raises(Exception, match="max_try_make_batch=1"):
        t.make_batch(1, SamplingParams(1.0, 1.0, cfg["data"]["max_response_length"]))


@pytest.mark.slow
def test_online_filtering_resumes_bitwise(demo_base, tmp_path):
    """4 steps straight == 2 + 2 in two segments: the same tries, metrics and weights (with KL in the
    reward under the adaptive controller, whose coefficient the checkpoint carries)."""
    kl = {"use_kl_loss": False, "kl_type": "adaptive", "kl_target": 1e-4, "kl_horizon": 50.0}
    straight = filtering_experiment(demo_base, tmp_path / "straight", kl, save_freq=4)
    halves = filtering_experiment(demo_base, tmp_path / "halves", kl, save_freq=2)
    run_segment(straight, 4, tmp_path / "straight.json")
    run_segment(halves, 2, tmp_path / "h2.json")
    run_segment(halves, 4, tmp_path / "h4.json")

    def steps(cfg):
        return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}
                for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(cfg)))]

    a, b = steps(straight), steps(halves)
    assert [r["step"] for r in a] == [1, 2, 3, 4] and a == b
    assert all(r["batch/num_try_make_batch"] >= 1 for r in a)
    assert len({r["actor/kl_coef"] for r in a}) == 4  # the coefficient moved every step, across the resume too
    from test_resume import weights
    wa, wb = weights(straight, 4), weights(halves, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# One 20-step run per option: each loss type and each estimator appears once, paired to keep it cheap.
# Expected: EasyR1's metrics for the pair.
RUNS = {
    "default+grpo": ({}, {}, ["actor/pg_clipfrac_higher", "actor/pg_clipfrac_lower", "actor/kl_loss"]),
    "gspo+rloo": ({"loss_type": "gspo"}, {"adv_estimator": "rloo"}, ["actor/pg_clipfrac_higher", "actor/pg_clipfrac_lower"]),
    "gspo_token+grpo_passk": ({"loss_type": "gspo_token"}, {"adv_estimator": "grpo_passk"}, ["actor/pg_clipfrac_higher"]),
    "cispo+reinforce_plus_plus": ({"loss_type": "cispo"},
                                  {"adv_estimator": "reinforce_plus_plus", "use_kl_loss": False, "kl_penalty": "kl", "kl_coef": 1e-3},
                                  ["actor/kl_penalty", "actor/kl_coef"]),
    "sapo+remax": ({"loss_type": "sapo"}, {"adv_estimator": "remax", "disable_kl": True}, []),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_each_loss_and_estimator_trains_20_steps(demo_base, tmp_path, name):
    actor, algorithm, expected = RUNS[name]
    # The parity reward: the test-size demo model scores 0 on r1v throughout, so every group would be
    # all-equal and every estimator's advantage 0, as in EasyR1 (a KL penalty in the reward aside).
    cfg = experiment(demo_base, tmp_path, algorithm, actor, trainer={**demo_base["trainer"], "max_steps": 20},
                     worker={"reward": parity_reward(demo_base, tmp_path)})
    t = GRPOTrainer(cfg)
    t.load(0)
    records = [t.step(s) for s in range(1, 21)]
    common = ["actor/pg_loss", "actor/ppo_kl", "actor/entropy_loss", "actor/grad_norm", "reward/overall",
              "critic/advantages/mean", "critic/returns/mean", "critic/rewards/mean", "critic/score/mean"]
    for record in records:
        for key in common + expected:
            assert key in record, (name, key)
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, (int, float))), name
        assert record["actor/nonfinite_skipped"] == 0
    if actor.get("loss_type") in ("cispo", "sapo"):
        assert "actor/pg_clipfrac_higher" not in records[0]  # EasyR1 logs none for these
    if algorithm.get("disable_kl"):
        assert t.ref is None and not any(k.startswith(("actor/kl_", "actor/kl_penalty")) for k in records[0])
    assert any(r["critic/advantages/max"] != 0 for r in records)  # it learned from something

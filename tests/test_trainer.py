"""The GRPO step on the tiny demo model: log-prob consistency, update direction, micro-batch exactness."""


import pytest
import torch

from conftest import make_experiment
from vlgrpo import grpo
from vlgrpo.batch import PromptBatch
from vlgrpo.data.prompts import encode_prompts, render_prompt
from vlgrpo.policy import response_logprobs
from vlgrpo.rollout import SamplingParams
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.trainer import GRPOTrainer


@pytest.fixture(scope="module")
def trainer(demo_base, tmp_path_factory):
    cfg = make_experiment(demo_base, tmp_path_factory.mktemp("trainer"))
    t = GRPOTrainer(cfg)
    t.load(0)
    return t


def varied_prompts(trainer, count=4):
    """Prompts of different lengths (extra words in the problem), each with its image."""
    rows = []
    for i, row in enumerate(trainer.rows[:count]):
        problem = row["problem"] + " Look closely." * (3 * i)
        rows.append({**row, "problem": problem, "prompt": render_prompt(trainer.processor, problem, "r1v")})
    enc = encode_prompts(trainer.processor, rows)
    batch = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows])
    assert len(set(batch.attention_mask.sum(-1).tolist())) == count  # really different lengths
    return rows, batch


def test_generation_logprobs_equal_training_forward(trainer):
    """Left padding, mask, mrope positions and mm_token_type_ids agree between generate and forward."""
    _, prompts = varied_prompts(trainer)
    prompts = prompts.repeat_interleave(2)
    keys = torch.tensor([sample_key(1, 1, i) for i in range(len(prompts))])
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24)
    # As in Qwen2.5-VL-3B's generation_config.json: must not leak into rollout sampling.
    trainer.policy.generation_config.repetition_penalty = 1.05
    out = trainer.engine.generate(prompts, keys, params, batch_size=len(prompts))
    trainer.policy.generation_config.repetition_penalty = 1.0
    forward = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0)
    mask = out.response_mask.bool()
    assert mask.sum() > 20
    assert torch.allclose(forward[mask], out.logp[mask], atol=1e-5), (forward - out.logp).abs().max()
    # Each row alone (no padding at all) gives the same log-probs: padding is invisible.
    for row in (0, 7):
        alone = response_logprobs(trainer.policy, prompts.select([row]), out.responses[[row]], out.response_mask[[row]], 1.0)
        assert torch.allclose(alone[0][mask[row]], out.logp[row][mask[row]], atol=1e-5)


def test_samples_do_not_depend_on_their_batch(trainer):
    _, prompts = varied_prompts(trainer)
    keys = torch.tensor([sample_key(1, 3, i) for i in range(len(prompts))])
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16)
    together = trainer.engine.generate(prompts, keys, params, batch_size=len(prompts))
    apart = trainer.engine.generate(prompts, keys, params, batch_size=1)
    assert together.texts == apart.texts
    assert torch.equal(together.responses, apart.responses)


def _group_rollout(trainer, n=4):
    """One prompt, n samples (as the trainer makes them)."""
    rows = trainer.rows[:1]
    prompts = PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [1]).repeat_interleave(n)
    keys = torch.tensor([sample_key(5, 1, rows[0]["index"], j) for j in range(n)])
    out = trainer.engine.generate(prompts, keys, SamplingParams(1.0, 1.0, 12), batch_size=n)
    return prompts, out


def test_update_raises_the_rewarded_sample(demo_base, tmp_path):
    cfg = make_experiment(
        demo_base,
        tmp_path,
        {"worker": {"rollout": {"n": 4, "batch_size": 1}, "actor": {"global_batch_size": 1, "optim": {"lr": 1e-3}}}},
    )
    t = GRPOTrainer(cfg)
    t.load(0)
    prompts, out = _group_rollout(t)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    advantages = grpo.grpo_advantages(scores, 4)
    old = t._logprobs(t.policy, prompts, out.responses, out.response_mask, 4)
    for step in (1, 2, 3):
        t.update_actor(step, prompts, out, old, old, advantages)
    new = t._logprobs(t.policy, prompts, out.responses, out.response_mask, 4)
    seq_old, seq_new = old.sum(-1), new.sum(-1)
    assert seq_new[0] > seq_old[0] + 0.05
    assert (seq_new[1:] < seq_old[1:]).all()


def test_micro_batch_size_does_not_change_loss_or_gradient(demo_base, tmp_path):
    """Accumulating micro-batches of 1 or of 4 gives the mini-batch token-mean loss and its gradient."""
    grads, losses = {}, {}
    for micro in (1, 4):
        cfg = make_experiment(
            demo_base,
            tmp_path / str(micro),
            {"worker": {"rollout": {"n": 4, "batch_size": 1},
                        "actor": {"global_batch_size": 1, "micro_batch_size_per_device_for_update": micro,
                                  "max_grad_norm": 1e9}}},  # compare unclipped gradients
        )
        t = GRPOTrainer(cfg)
        t.load(0)
        prompts, out = _group_rollout(t)
        advantages = grpo.grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), 4)
        old = t._logprobs(t.policy, prompts, out.responses, out.response_mask, 4) + 0.01  # ratio != 1
        ref = old - 0.02
        captured = []
        t.optimizer.step = lambda: captured.append({n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None})
        metrics = t.update_actor(1, prompts, out, old, ref, advantages)
        grads[micro], losses[micro] = captured[0], metrics

        # Direct computation on the same tensors, one forward over the whole mini-batch.
        t.policy.zero_grad(set_to_none=True)
        logp = response_logprobs(t.policy, prompts, out.responses, out.response_mask, 1.0)
        mask = out.response_mask.float()
        actor = cfg["worker"]["actor"]
        pg, _ = grpo.policy_loss(logp, old, advantages, mask, actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_dual"])
        kl = grpo.aggregate(grpo.kl_penalty(logp, ref, "low_var_kl"), mask)
        (pg + cfg["algorithm"]["kl_coef"] * kl).backward()
        direct = {n: p.grad for n, p in t.policy.named_parameters() if p.grad is not None}
        assert metrics["actor/pg_loss"] == pytest.approx(pg.item(), abs=1e-6)
        assert metrics["actor/kl_loss"] == pytest.approx(kl.item(), abs=1e-6)
        for name, g in direct.items():
            assert torch.allclose(captured[0][name], g, atol=1e-6, rtol=1e-4), name
    for name in grads[1]:
        assert torch.allclose(grads[1][name], grads[4][name], atol=1e-6, rtol=1e-4), name
    assert losses[1]["actor/pg_loss"] == pytest.approx(losses[4]["actor/pg_loss"], abs=1e-6)


def test_a_step_logs_easyr1_metrics(trainer):
    record = trainer.step(1)
    for key in ("reward/overall", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/grad_norm",
                "actor/pg_clipfrac_higher", "actor/entropy_loss", "critic/advantages/mean",
                "response_length/clip_ratio", "timing_s/gen", "timing_s/update_actor", "perf/throughput",
                "critic/zero_adv_group_frac", "actor/nonfinite_skipped"):
        assert key in record, key
    n = trainer.cfg["worker"]["rollout"]["n"]
    assert 0 <= record["reward/format"] <= 1
    assert record["prompt_length/min"] > 16  # 16 image tokens and the text
    assert record["perf/total_num_tokens"] == pytest.approx(
        trainer.batch_size * n * (record["prompt_length/mean"] + record["response_length/mean"])
    )
    # Data order and sampling are pure functions of the step.
    assert trainer.batch_indices(1) == trainer.batch_indices(1)
    assert trainer.batch_indices(1) != trainer.batch_indices(2)
    epoch = [i for s in range(1, trainer.steps_per_epoch + 1) for i in trainer.batch_indices(s)]
    assert len(set(epoch)) == len(epoch)  # an epoch never repeats a row


def test_freeze_vision_tower_trains_the_language_model_only(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path, {"model": {**demo_base["model"], "freeze_vision_tower": True}})
    t = GRPOTrainer(cfg)
    t.load(0)
    before = {name: p.detach().clone() for name, p in t.policy.named_parameters()}
    t.step(1)
    changed = {name for name, p in t.policy.named_parameters() if not torch.equal(p, before[name])}
    assert changed and not any(".visual." in name for name in changed)
    assert any(".language_model." in name for name in changed)
    trained = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in trained for p in t.policy.model.visual.parameters())

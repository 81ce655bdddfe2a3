"""LoRA through peft (worker.actor.model.lora) on the tiny demo model, float32, CPU."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from conftest import make_experiment
from vlgrpo import config, evaluate, lora, models, paths
from vlgrpo.attention import PREFIX_ROWS_ATTENTION
from vlgrpo.checkpoint import CheckpointStore
from vlgrpo.policy import load_model, response_logprobs
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.trainer import GRPOTrainer, run_segment

CPU = torch.device("cpu")
# rank 8 on every linear layer (vision tower included); a large lr so one step moves the adapters
LORA = {"worker": {"actor": {"model": {"lora": {"rank": 8, "alpha": 16}}, "optim": {"lr": 1e-2}}}}


def lora_cfg(demo_base, root, extra=None):
    return make_experiment(demo_base, root, config.deep_merge(LORA, extra or {}))


@pytest.fixture(scope="module")
def stepped(demo_base, tmp_path_factory):
    """A LoRA trainer before and after one GRPO step: (trainer, parameters before the step)."""
    trainer = GRPOTrainer(lora_cfg(demo_base, tmp_path_factory.mktemp("lora")))
    trainer.load(0)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.step(1)
    assert push_down(trainer, 2)["actor/nonfinite_skipped"] == 0
    return trainer, before


def push_down(trainer, step):
    """An update that pushes sampled responses down, so the adapters move whatever a step's rewards were
    (B starts at 0 and moves only with non-zero advantages; the test-size demo's groups often all score 0).
    Old and ref log-probs as GRPOTrainer.step computes them (ref: the policy with its adapters off)."""
    group = image_prompts(trainer, 2).repeat_interleave(4)
    out = trainer.engine.generate(group, torch.arange(8), SamplingParams(1.0, 1.0, 24), len(group))
    old = trainer._logprobs(trainer.policy, group, out.responses, out.response_mask, 8)
    with lora.adapters_disabled(trainer.ref):
        ref = trainer._logprobs(trainer.ref, group, out.responses, out.response_mask, 8)
    return trainer.update_actor(step, group, out, old, ref, torch.full((8,), -1.0))


def base_model(cfg):
    return load_model(cfg["model"]["path"], config.for_device(cfg, CPU)["model"], CPU, trainable=False)


def image_prompts(trainer, rows=4):
    from vlgrpo.batch import PromptBatch
    from vlgrpo.data.prompts import encode_prompts

    rows = trainer.rows[:rows]
    return PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [len(r["images"]) for r in rows],
                                      [r["images"] for r in rows])


@pytest.fixture(scope="module")
def sampled(stepped):
    """Prompts and responses sampled once by the policy (adapters on), to score under several models."""
    trainer, _ = stepped
    prompts = image_prompts(trainer)
    keys = torch.tensor([sample_key(1, 9, i) for i in range(len(prompts))])
    return prompts, trainer.engine.generate(prompts, keys, SamplingParams(1.0, 1.0, 16), batch_size=len(prompts))


def logprobs(model, sampled):
    prompts, out = sampled
    with torch.no_grad():
        return response_logprobs(model, prompts, out.responses, out.response_mask, 1.0)


def test_the_old_lora_rank_key_is_refused_naming_the_new_one(demo_base):
    with pytest.raises(config.ConfigError, match=r"worker\.actor\.model\.lora\.rank"):
        config.validate(config.deep_merge(demo_base, {"worker": {"actor": {"lora_rank": 8}}}))
    assert config.validate(demo_base)["worker"]["actor"]["model"]["lora"] == {
        "rank": 0, "alpha": 64, "target_modules": "all-linear", "exclude_modules": None}


def test_only_the_adapters_train_and_hold_optimizer_state(stepped):
    trainer, before = stepped
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert trainable == {n for n in before if lora.is_adapter(n)}  # vision tower adapters too (not frozen here)
    names = {id(p): n for n, p in trainer.policy.named_parameters()}
    assert {names[id(p)] for p in trainer.optimizer.state} == trainable
    after = dict(trainer.policy.named_parameters())
    changed = {n for n, t in before.items() if not torch.equal(after[n].detach(), t)}
    assert changed and changed <= trainable
    assert any(n.endswith("lora_B.default.weight") for n in changed)  # B starts at 0: the adapters now do something
    assert trainer.ref is trainer.policy  # no second copy of the weights
    assert trainer.lora_info["trainable_params"] == sum(before[n].numel() for n in trainable)
    assert 0 < trainer.lora_info["trainable_fraction"] < 0.2


def test_the_reference_log_probs_are_the_base_models(stepped, sampled):
    trainer, _ = stepped
    base = base_model(trainer.cfg)
    with lora.adapters_disabled(trainer.policy):
        ref = logprobs(trainer.policy, sampled)
    assert torch.equal(ref, logprobs(base, sampled))
    assert not torch.allclose(logprobs(trainer.policy, sampled), ref)  # with the adapters on it differs
    # switching back leaves the trainable flags as they were (peft's switch sets them)
    assert {n for n, p in trainer.policy.named_parameters() if p.requires_grad} == \
        {n for n, _ in trainer.policy.named_parameters() if lora.is_adapter(n)}


@pytest.mark.parametrize("engine", ["static"])
def test_each_engine_gives_the_hf_engines_greedy_tokens_with_adapters_active(stepped, engine):
    trainer, _ = stepped
    prompts = image_prompts(trainer)
    keys, params = torch.arange(len(prompts)), SamplingParams(0.0, 1.0, 24)
    hf = trainer.engine.generate(prompts, keys, params, batch_size=len(prompts))
    fast = make_engine(engine, trainer.policy, trainer.processor)
    other = fast.generate(prompts, keys, params, batch_size=len(prompts))
    assert torch.equal(other.responses, hf.responses) and other.texts == hf.texts
    attention = models.text_model(trainer.policy).layers[0].self_attn
    assert type(attention.q_proj) is not torch.nn.Linear and fast._decoder.qkv is None  # LoRA layers: called, not stacked
    assert (other.logp - hf.logp).abs().max() < 1e-5
    with lora.adapters_disabled(trainer.policy):  # the adapters are active: without them the log-probs differ
        plain = trainer.engine.generate(prompts, keys, params, batch_size=len(prompts))
    assert not torch.allclose(plain.logp, hf.logp)


def test_the_checkpoint_is_a_peft_adapter_folder_and_the_merged_export_computes_the_same(stepped, sampled, tmp_path):
    trainer, _ = stepped
    folder = trainer.save(1, "run").result()
    model_dir = folder / "model"
    tensors = load_file(model_dir / "adapter_model.safetensors")
    assert tensors and all(k.startswith("base_model.model.") and ".lora_" in k for k in tensors)
    assert not list(model_dir.glob("model*.safetensors"))  # no base weights
    weights = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    base_bytes = sum(p.numel() * p.element_size() for n, p in trainer.policy.named_parameters() if not lora.is_adapter(n))
    assert weights < base_bytes / 2  # adapters and their optimizer state only
    recorded = json.loads((model_dir / "base_model.json").read_text())
    assert recorded["path"] == trainer.cfg["model"]["path"] and "config.json" in recorded["files"]
    # peft loads it onto the base model and computes what the policy computes
    peft_model = PeftModel.from_pretrained(base_model(trainer.cfg), str(model_dir))
    assert torch.equal(logprobs(peft_model.get_base_model(), sampled), logprobs(trainer.policy, sampled))
    # validation loads base + adapters
    loaded = lora.load_with_adapters(model_dir, config.for_device(trainer.cfg, CPU)["model"], CPU)
    assert torch.equal(logprobs(loaded, sampled), logprobs(trainer.policy, sampled))
    # the merged export: a plain from_pretrained folder, the same log-probs up to float32 rounding
    out = lora.export_merged(config.for_device(trainer.cfg, CPU)["model"], model_dir, tmp_path / "merged", trainer.processor)
    merged = load_model(out, config.for_device(trainer.cfg, CPU)["model"], CPU, trainable=False)
    assert not lora.has_adapters(merged)
    assert (logprobs(merged, sampled) - logprobs(trainer.policy, sampled)).abs().max() < 1e-4


def test_adapters_of_another_base_model_are_refused_by_name(stepped, tmp_path):
    import shutil

    trainer, _ = stepped
    model_dir = trainer.store.model_dir(1) if trainer.store.latest() else trainer.save(1, "run").result() / "model"
    other = tmp_path / "other_base"
    shutil.copytree(trainer.cfg["model"]["path"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_theta", 10000) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(config.ConfigError, match="trained on the base model .*config.json"):
        lora.check_base(model_dir, str(other))
    lora.check_base(model_dir, trainer.cfg["model"]["path"])  # its own base passes


def test_gradient_checkpointing_and_a_frozen_vision_tower_work_with_lora(demo_base, tmp_path):
    cfg = lora_cfg(demo_base, tmp_path, {"model": {"gradient_checkpointing": True, "freeze_vision_tower": True},
                                         "worker": {"actor": {"prefix_sharing": True}}})  # packed update rows, as on a GPU
    trainer = GRPOTrainer(cfg)
    trainer.load(0)
    attention = models.text_model(trainer.policy).layers[0].self_attn.config._attn_implementation
    assert trainer.update_forward.packed and attention == PREFIX_ROWS_ATTENTION
    visual = {n for n, _ in trainer.policy.model.visual.named_parameters(prefix="model.visual")}
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and not trainable & visual and all(lora.is_adapter(n) for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.step(1)  # the whole step runs checkpointed (its rewards may all be 0: no gradient then)
    record = push_down(trainer, 2)
    changed = {n for n, p in trainer.policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= trainable and record["actor/grad_norm"] > 0
    assert any(n.endswith("lora_B.default.weight") for n in changed)


@pytest.mark.slow
def test_two_lora_segments_resume_bitwise_and_validate_base_plus_adapters(demo_base, tmp_path):
    """4 steps straight == 2 + 2 with a checkpoint between (bitwise adapters and optimizer state, same
    metrics); validation of the checkpoint loads base + adapters; the final step is exported merged."""
    from test_resume import deterministic

    from vlgrpo.tracking import read_metrics

    runs = {}
    for name, ends in (("straight", [4]), ("halves", [2, 4])):
        cfg = lora_cfg(demo_base, tmp_path / name, {"trainer": {"max_steps": 4, "save_freq": 4 // len(ends), "val_freq": 4}})
        for end in ends:
            run_segment(cfg, end, paths.path(paths.MARKER, config.experiment_dir(cfg), step=end))
        runs[name] = cfg
    stores = {k: CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(c))) for k, c in runs.items()}
    files = {k: {f.relative_to(s.path(4)): load_file(f) for f in s.path(4).rglob("*.safetensors")} for k, s in stores.items()}
    assert files["straight"].keys() == files["halves"].keys()
    for f, tensors in files["straight"].items():
        for name, t in tensors.items():
            if name != "rng/torch":
                assert torch.equal(files["halves"][f][name], t), (f, name)
    metrics = {k: [deterministic(r) for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(c)))]
               for k, c in runs.items()}
    assert metrics["halves"] == metrics["straight"] and len(metrics["straight"]) == 4
    marker = json.loads(paths.path(paths.MARKER, config.experiment_dir(runs["halves"]), step=4).read_text())
    assert marker["lora"]["rank"] == 8 and 0 < marker["lora"]["trainable_fraction"] < 1
    assert "export_merged" in marker["timing_s"]  # the final step
    assert (paths.path(paths.MERGED, config.experiment_dir(runs["halves"]), step=4) / "config.json").is_file()
    assert not paths.path(paths.MERGED, config.experiment_dir(runs["halves"]), step=2).exists()
    # the evaluate job's own validation of step 4 (base + adapters) equals the segment's in-process one
    cfg = runs["halves"]
    in_process = json.loads(paths.path(paths.VAL_IN_PROCESS, config.experiment_dir(cfg), step=4).read_text())
    fresh = evaluate.evaluate(cfg, 4)
    assert fresh["val/overall_reward"] == in_process["val/overall_reward"]
    assert fresh["samples"] == in_process["samples"]


def test_the_adapters_initial_weights_are_a_function_of_the_seed(demo_base, tmp_path):
    """Every rank (and a single process) draws the same A whatever it drew before; torch's RNG is left as it was."""
    cfg = lora_cfg(demo_base, tmp_path)
    first = lora.add_adapters(base_model(cfg), cfg)
    torch.rand(7)  # another history of the global RNG
    state = torch.get_rng_state()
    second = lora.add_adapters(base_model(cfg), cfg)
    assert torch.equal(state, torch.get_rng_state())
    a, b = lora.adapter_tensors(first), lora.adapter_tensors(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_A.weight") and a[k].abs().max() > 0 for k in a)
    other = lora.add_adapters(base_model(cfg), config.deep_merge(cfg, {"seed": cfg["seed"] + 1}))
    assert not all(torch.equal(a[k], v) for k, v in lora.adapter_tensors(other).items())

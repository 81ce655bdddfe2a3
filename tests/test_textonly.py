"""Text-only causal LMs (qwen3, qwen2, qwen3_moe, llama; tiny random models on Qwen3-4B-Instruct-2507's
tokenizer and chat template, float32, CPU) on math rows: prompts rendered as EasyR1 renders them, image
rows refused by name, log-probs of generation equal to training's and the fast paths equal to the plain
ones where the family runs them, LoRA, two GRPO steps with a checkpoint, a bitwise resume and validation."""

import json
import logging
import os
import subprocess

import pytest
import torch
import yaml

import families
from conftest import ROOT, SHARED
from vlgrpo import bench, config, lora, models, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.data.filtering import filter_split, load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.data.sources import load_processor
from vlgrpo.errors import DataError
from vlgrpo.policy import response_logprobs
from vlgrpo.rollout import SamplingParams
from vlgrpo.tracking import read_metrics
from vlgrpo.trainer import GRPOTrainer, run_segment

pytestmark = pytest.mark.skipif(not (SHARED / "qwen3_4b").exists(), reason="shared data absent: qwen3_4b")

TEXT = ["qwen3", "qwen2", "qwen3_moe", "llama"]
PROBLEMS = [("What is 3 + 4?", "7"), ("Compute 12 * 12.", "144"), ("What is the square root of 81?", "9"),
            ("A box holds 5 apples. How many apples do 3 boxes hold?", "15"), ("Solve for x: 2x + 6 = 10.", "2"),
            ("What is 100 - 37?", "63")]
# EasyR1's math format prompt (examples/format_prompt/math.jinja) and Qwen3-4B-Instruct-2507's chat template
MATH_SUFFIX = (" You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE "
               "put in \\boxed{}.")
EXPERIMENT = {  # small steps: 2 prompts x 2 samples, 8 response tokens
    "seed": 1,
    "data": {"format_prompt": "math", "max_prompt_length": 256, "max_response_length": 8},
    "algorithm": {"use_kl_loss": True, "kl_coef": 1.0e-2},
    "worker": {"actor": {"global_batch_size": 2}, "rollout": {"n": 2, "batch_size": 2},
               "reward": {"reward_function": "math"}},
    "trainer": {"device": "cpu", "n_gpus_per_node": 0, "max_steps": 2, "save_freq": 2, "val_freq": 2,
                "val_before_train": False, "logger": ["file"]},
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_experiment(root, model_folder, extra=None) -> dict:
    """A validated experiment on `model_folder` whose splits are jsonl math rows (written under `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(root / "train.jsonl", [{"problem": p, "answer": a} for p, a in PROBLEMS])
    val = write_jsonl(root / "val.jsonl", [{"problem": p, "answer": a} for p, a in PROBLEMS[:3]])
    base = config.load(ROOT / "config.yaml", overrides={"results_dir": str(root / "results"), "experiment": "text",
                                                        "model": {"path": str(model_folder)},
                                                        "data": {"train": str(train), "val": str(val)}})
    return config.validate(config.deep_merge(config.deep_merge(base, EXPERIMENT), extra or {}))


def filtered(cfg) -> dict:
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split), workers=1)
    config.write_resolved(cfg, paths.path(paths.RESOLVED, exp))
    return cfg


@pytest.fixture(scope="module", params=TEXT)
def text_trainer(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    cfg = filtered(text_experiment(root, families.build(request.param, root / "model")))
    t = GRPOTrainer(cfg)
    t.load(0)
    return request.param, t


def test_a_text_family_passes_validation_and_its_processor_is_its_tokenizer(tmp_path):
    folder = families.build("qwen3", tmp_path / "model", weights=False)
    cfg = text_experiment(tmp_path, folder)  # no refusal at parse time
    assert models.family_of(cfg["model"]["path"]).model_type == "qwen3"
    tokenizer = load_processor(str(folder))
    assert models.tokenizer(tokenizer) is tokenizer and not models.takes_images(tokenizer)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|endoftext|>"
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": None}))  # as Llama's tokenizers
    assert load_processor(str(folder)).pad_token == "<|im_end|>"  # EasyR1's get_tokenizer: the EOS token


def test_prompts_are_rendered_and_tokenized_as_easyr1_renders_text_rows(tmp_path):
    """EasyR1 (verl/utils/dataset.py) for a dataset without an image column: one user turn of the
    formatted problem as a string, the tokenizer's chat template with the generation prompt, then the
    tokenizer without special tokens; the length filter counts those tokens."""
    cfg = filtered(text_experiment(tmp_path, families.build("qwen3", tmp_path / "model", weights=False)))
    rows = load_filtered(paths.path(paths.FILTERED, config.experiment_dir(cfg), split="train"))
    tokenizer = load_processor(cfg["model"]["path"])
    problem = PROBLEMS[0][0]
    assert rows[0]["prompt"] == f"<|im_start|>user\n{problem}{MATH_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    easyr1 = tokenizer.apply_chat_template([{"role": "user", "content": problem + MATH_SUFFIX}], add_generation_prompt=True)
    easyr1 = easyr1 if isinstance(easyr1, list) else easyr1["input_ids"]  # transformers 5 returns a BatchEncoding
    enc = encode_prompts(tokenizer, rows[:2])
    assert enc["input_ids"][0][enc["attention_mask"][0].bool()].tolist() == easyr1
    assert enc["attention_mask"][0, 0] == 1 or enc["attention_mask"][1, 0] == 1  # left padding: the longest starts at 0
    assert [r["images"] for r in rows] == [[]] * len(PROBLEMS)
    stats = json.loads(paths.path(paths.STATS, config.experiment_dir(cfg), split="train").read_text())
    assert stats["prompt_length"]["min"] == min(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows)
    prompts = PromptBatch.from_processor(enc, [0, 0], vision=False)
    assert prompts.image_grid_thw is None and set(prompts.model_inputs()) == {"input_ids", "attention_mask"}


def test_image_rows_given_to_a_text_model_are_dropped_by_name(tmp_path):
    cfg = text_experiment(tmp_path, families.build("qwen3", tmp_path / "model", weights=False))
    rows = [{"problem": p, "answer": a, "images": []} for p, a in PROBLEMS]
    rows += [{"problem": "<image>What is the angle?", "answer": "30", "images": ["angle.png"]},
             {"problem": "<video>How many?", "answer": "3", "images": []}]
    cfg["data"]["train"] = str(write_jsonl(tmp_path / "mixed.jsonl", rows))
    exp = config.experiment_dir(cfg)
    stats = filter_split(cfg, "train", paths.path(paths.FILTERED, exp, split="train"), paths.path(paths.STATS, exp, split="train"))
    assert stats["dropped"]["text_only_model"] == 2 and stats["dropped_rows"]["text_only_model"] == [6, 7]
    assert stats["kinds"]["image"] == {"kept": 0, "dropped": {"text_only_model": 1}}
    assert stats["kinds"]["text"]["kept"] == len(PROBLEMS)
    kept = load_filtered(paths.path(paths.FILTERED, exp, split="train"))
    assert kept[0]["prompt"].startswith("<|im_start|>user\nWhat is 3 + 4?")  # string content even beside an image column
    only_images = write_jsonl(tmp_path / "images.jsonl", rows[-2:-1] * 4)
    cfg["data"]["train"] = str(only_images)
    with pytest.raises(DataError, match="top drop reasons: text_only_model 4"):
        filter_split(cfg, "train", tmp_path / "x.parquet", tmp_path / "x.json")
    tokenizer = load_processor(cfg["model"]["path"])
    from PIL import Image

    with pytest.raises(DataError, match="text-only model"):  # never encoded as text behind the filter's back
        encode_prompts(tokenizer, [{"prompt": "x", "images": [Image.new("RGB", (28, 28))]}])


def test_auto_turns_off_what_a_text_family_cannot_run(caplog):
    demo = config.load(ROOT / "config.yaml")
    with caplog.at_level(logging.INFO, logger="vlgrpo.models"):
        qwen3 = config.for_device(demo, "cuda", models.family("qwen3"))
        moe = config.for_device(demo, "cuda", models.family("qwen3_moe"))
    assert qwen3["worker"]["rollout"]["engine"] == "static" and qwen3["worker"]["actor"]["prefix_sharing"] is True
    assert qwen3["model"]["fused_rms_norm"] is True and qwen3["model"]["packed_vision_attention"] is False
    assert moe["worker"]["rollout"]["engine"] == "hf" and moe["worker"]["actor"]["prefix_sharing"] is True
    assert "model.packed_vision_attention off for Qwen3 (text) (qwen3): a text-only model has no vision tower" in caplog.text
    assert "worker.rollout.engine: hf for Qwen3-MoE (text) (qwen3_moe): the static decode step" in caplog.text


def _prompts(trainer, n=2):
    rows = trainer.rows[:3]  # different lengths: left padding differs
    enc = encode_prompts(trainer.processor, rows)
    assert len(set(enc["attention_mask"].sum(-1).tolist())) == 3
    return PromptBatch.from_processor(enc, [0] * 3, vision=False).repeat_interleave(n)


def test_generation_logprobs_equal_training_and_fast_paths_equal_plain(text_trainer):
    """Also: every text family but the MoE one runs the static engine, every one prefix sharing; a row's
    positions start at its first real token, so a row alone gives the log-probs it gets beside others."""
    model_type, trainer = text_trainer
    family = models.family(model_type)
    assert family.serves("worker.actor.prefix_sharing")
    assert family.serves("worker.rollout.engine") == (model_type != "qwen3_moe")
    prompts = _prompts(trainer)
    out, plain = families.check_logprobs_and_engines(trainer, model_type, prompts)
    mask = out.response_mask.bool()
    with torch.no_grad():
        single = response_logprobs(trainer.policy, prompts.select([4, 5]), out.responses[4:], out.response_mask[4:], 1.0)
    assert torch.allclose(single[mask[4:]], plain[4:][mask[4:]], atol=1e-5)


def test_lora_on_a_text_model_trains_the_adapters_only(tmp_path):
    extra = {"worker": {"actor": {"model": {"lora": {"rank": 4, "alpha": 8}}, "optim": {"lr": 1e-2}}}}
    cfg = filtered(text_experiment(tmp_path, families.build("qwen3", tmp_path / "model"), extra))
    trainer = GRPOTrainer(cfg)
    trainer.load(0)
    assert trainer.ref is trainer.policy and lora.has_adapters(trainer.policy)
    trainable = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    prompts = _prompts(trainer)
    out = trainer.engine.generate(prompts, torch.arange(len(prompts)), SamplingParams(1.0, 1.0, 8), len(prompts))
    old = trainer._logprobs(trainer.policy, prompts, out.responses, out.response_mask, 8)
    with lora.adapters_disabled(trainer.ref):
        ref = trainer._logprobs(trainer.ref, prompts, out.responses, out.response_mask, 8)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    record = trainer.update_actor(1, prompts, out, old, ref, torch.tensor([1.0, -1.0] * 3))
    assert record["actor/nonfinite_skipped"] == 0
    moved = {n for n, p in trainer.policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(lora.is_adapter(n) for n in moved)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TEXT)
def test_two_steps_checkpoint_bitwise_resume_and_validation(model_type, tmp_path):
    folder = families.build(model_type, tmp_path / "model")
    straight = filtered(text_experiment(tmp_path / "straight", folder))
    run_segment(straight, 2, paths.path(paths.MARKER, config.experiment_dir(straight), step=2))
    halves = filtered(text_experiment(tmp_path / "halves", folder, {"trainer": {"save_freq": 1}}))
    for end in (1, 2):  # a checkpoint at step 1, then a resume from it
        run_segment(halves, end, paths.path(paths.MARKER, config.experiment_dir(halves), step=end))
    records = [[families.deterministic(r) for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(c)))]
               for c in (straight, halves)]
    assert [r["step"] for r in records[0]] == [1, 2] and records[1] == records[0]
    assert {"actor/pg_loss", "actor/kl_loss", "reward/overall", "response_length/mean"} <= set(records[0][0])
    a, b = families.checkpoint_weights(straight, 2), families.checkpoint_weights(halves, 2)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model_type
    validated = json.loads(paths.path(paths.VAL_IN_PROCESS, config.experiment_dir(straight), step=2).read_text())
    assert validated["step"] == 2 and 0 <= validated["val/accuracy_reward"] <= 1


def test_bench_runs_a_text_model_on_the_cpu(tmp_path):
    """configs/bench_qwen3_4b.yaml's settings at toy size: random weights of the tiny qwen3, math rows."""
    folder = families.build("qwen3", tmp_path / "model", weights=False)
    cfg = yaml.safe_load((ROOT / "configs" / "bench_qwen3_4b.yaml").read_text())
    cfg = config.deep_merge(cfg, {
        "results_dir": str(tmp_path / "results"), "model": {"path": str(folder), "dtype": "float32"},
        "data": {"train": str(write_jsonl(tmp_path / "train.jsonl", [{"problem": p, "answer": a} for p, a in PROBLEMS * 2])),
                 "val": str(write_jsonl(tmp_path / "val.jsonl", [{"problem": p, "answer": a} for p, a in PROBLEMS[:2]])),
                 "max_response_length": 8},
        "worker": {"actor": {"global_batch_size": 2, "micro_batch_size_per_device_for_update": 4,
                             "micro_batch_size_per_device_for_experience": 8, "prefix_sharing": True},
                   "rollout": {"batch_size": 4, "n": 2, "engine": "static"}},
        "trainer": {"device": "cpu", "n_gpus_per_node": 0}})
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "bench.json"
    result = bench.main(["--config", str(path), "--out", str(out), "--warmup", "0", "--steps", "1", "--plain-steps", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model_type"] == "qwen3" and result["weights"] == "random"
    assert result["response_length_mean"] == 8 and result["tokens_per_step"] > 4 * 2 * 8
    assert 0 < result["mfu"] and result["rollout"]["engine"] == "static"
    assert result["greedy_vs_hf"]["identical_rows"] == result["greedy_vs_hf"]["rows"]
    assert result["eval"]["items"] == 2


@pytest.mark.parametrize("name,values", [
    ("qwen3_4b_math.yaml", {"experiment": "qwen3_4b_math_grpo", "data.max_response_length": 4096,
                            "worker.actor.model.lora.rank": 0, "worker.actor.optim.lr": 1e-6, "trainer.n_gpus_per_node": 8}),
    ("qwen3_4b_math_lora.yaml", {"experiment": "qwen3_4b_math_grpo_lora", "data.max_response_length": 2048,
                                 "worker.actor.model.lora.rank": 64, "worker.actor.model.lora.alpha": 64,
                                 "worker.actor.optim.lr": 1e-5, "trainer.n_gpus_per_node": 1}),
])
def test_the_qwen3_4b_math_recipes_are_easyr1s(name, values):
    """examples/config.yaml with examples/qwen3_4b_math_grpo.sh / qwen3_4b_math_grpo_lora.sh on top."""
    cfg = config.load(ROOT / "configs" / name)
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) and v else flat.__setitem__(prefix + k, v)

    walk(cfg)
    easyr1 = {"model.path": "Qwen/Qwen3-4B", "data.train": "hiyouga/math12k@train", "data.val": "hiyouga/math12k@test",
              "data.format_prompt": "math", "data.max_prompt_length": 2048, "worker.rollout.batch_size": 512,
              "worker.rollout.n": 5, "worker.actor.global_batch_size": 128, "algorithm.kl_coef": 1e-2,
              "algorithm.kl_penalty": "low_var_kl", "worker.reward.reward_function": "math", "seed": 1,
              "model.gradient_checkpointing": True, "worker.rollout.val_override_config.temperature": 0.6}
    assert {k: flat[k] for k in {**easyr1, **values}} == {**easyr1, **values}
    cuda = config.for_device(cfg, "cuda", models.family("qwen3"))
    assert cuda["worker"]["rollout"]["engine"] == "static" and cuda["model"]["fused_rms_norm"] is True


@pytest.mark.slow
def test_the_workflow_runs_a_text_model_to_its_report(tmp_path):
    """Filter, train in two segments with validation, report: Snakemake on the tiny qwen3 and math rows."""
    cfg = text_experiment(tmp_path, families.build("qwen3", tmp_path / "model"),
                          {"trainer": {"max_steps": 4, "retries": 0}})
    recipe = {k: cfg[k] for k in ("experiment", "seed", "model", "data", "algorithm", "worker", "trainer")}
    (tmp_path / "text.yaml").write_text(yaml.safe_dump(recipe))
    run = subprocess.run(["snakemake", "--cores", "2", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path / "work"),
                          "--configfile", str(tmp_path / "text.yaml")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stderr[-3000:]
    exp = tmp_path / "work" / "results" / "text"
    summary = json.loads((exp / "report" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val"]["final"]["step"] == 4
    assert [r["step"] for r in read_metrics(exp / "metrics.jsonl") if "actor/pg_loss" in r] == [1, 2, 3, 4]
    stats = json.loads((exp / "data" / "train.stats.json").read_text())
    assert stats["kinds"]["text"]["kept"] == len(PROBLEMS) and stats["image_tokens"]["max"] == 0

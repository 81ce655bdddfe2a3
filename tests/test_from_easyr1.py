"""vlgrpo from-easyr1: EasyR1 configs and script overrides become recipes with EasyR1's meanings; every
key is mapped or listed; the converted example scripts run through `snakemake -n`; the docs table is
the mapping."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlgrpo import config
from vlgrpo.from_easyr1 import RULES, convert, parse_override, render

ROOT = Path(__file__).resolve().parents[1]
CONVERTED = sorted((ROOT / "configs" / "easyr1").glob("*.yaml")) + [ROOT / "configs" / "easyr1_geo3k_default.yaml"]

# A small EasyR1 config in the layout of its examples/config.yaml (values chosen for the test).
EASYR1 = {
    "data": {"train_files": "hiyouga/geometry3k@train", "val_files": "hiyouga/geometry3k@test", "prompt_key": "problem",
             "format_prompt": "./examples/format_prompt/math.jinja", "rollout_batch_size": 64, "seed": 3},
    "algorithm": {"adv_estimator": "grpo", "kl_penalty": "low_var_kl", "kl_coef": 1.0e-2},
    "worker": {
        "actor": {"global_batch_size": 16, "model": {"model_path": "Qwen/Qwen2.5-VL-3B-Instruct", "lora": {"rank": 0}},
                  "optim": {"lr": 1.0e-6, "strategy": "adamw", "lr_warmup_ratio": 0.1}, "fsdp": {"torch_dtype": None}},
        "rollout": {"n": 4, "temperature": 0.9, "top_p": 0.99, "tensor_parallel_size": 2, "val_override_config": {"n": 2}},
        "reward": {"reward_function": "./examples/reward_function/math.py:compute_score"},
    },
    "trainer": {"experiment_name": "qwen/geo3k grpo", "logger": ["file", "wandb"], "save_freq": 5, "val_freq": 5, "save_limit": 3,
                "n_gpus_per_node": 2},
}


def flat(node, prefix=""):
    return {k: v for key, value in node.items()
            for k, v in (flat(value, f"{prefix}{key}.").items() if isinstance(value, dict) and value else [(prefix + key, value)])}


def test_values_take_easyr1_meanings_and_defaults():
    recipe, entries = convert(EASYR1, ["worker.actor.clip_ratio_low=3e-4", "trainer.logger=['console','tensorboard']",
                                       "algorithm.disable_kl=True", "worker.rollout.top_k=50", "config=examples/config.yaml"])
    got = flat(recipe)
    assert got["experiment"] == "qwen_geo3k_grpo" and got["seed"] == 3 and got["model.path"] == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert (got["data.format_prompt"], got["worker.reward.reward_function"]) == ("math", "math")  # EasyR1's files = the built-ins
    assert got["worker.rollout.batch_size"] == 64 and got["worker.actor.global_batch_size"] == 16
    assert got["worker.actor.clip_ratio_low"] == 3e-4 and isinstance(got["worker.actor.clip_ratio_low"], float)
    assert got["trainer.logger"] == ["console", "tensorboard"] and got["algorithm.disable_kl"] is True
    assert got["trainer.keep_checkpoints"] == 3 and got["model.dtype"] == "bfloat16"  # mp_param_dtype bf16 (EasyR1 default)
    # Keys the config leaves out take EasyR1's defaults, not vlgrpo's (clip_ratio_high 0.3 in both; use_kl_loss differs)
    assert got["algorithm.use_kl_loss"] is False and got["trainer.total_epochs"] == 15 and got["worker.rollout.top_k"] == 50
    # Validation sampling: the keys given override, the others are the rollout's (top_k null: the rollout's)
    assert (got["worker.rollout.val_override_config.temperature"], got["worker.rollout.val_override_config.top_p"],
            got["worker.rollout.val_override_config.top_k"], got["worker.rollout.val_override_config.n"]) == (0.9, 0.99, None, 2)
    assert got["worker.rollout.cuda_graph"] is True  # enforce_eager false
    assert not [e for e in entries if e.problem]
    by_key = {e.key: e for e in entries}
    assert by_key["worker.rollout.tensor_parallel_size"].status == "no effect here"
    assert by_key["data.shuffle"].status == "mapped" and by_key["data.shuffle"].source == "EasyR1 default"
    assert by_key["worker.actor.clip_ratio_low"].source == "override" and by_key["data.seed"].source == "config"
    assert set(by_key) >= {k for k in RULES if not k.endswith("*")}  # every EasyR1 key has its entry


def test_video_keys_map_through():
    recipe, entries = convert(EASYR1, ["data.video_key=clips", "data.video_fps=1.5", "data.image_dir=/data/media"])
    got = flat(recipe)
    assert (got["data.video_key"], got["data.video_fps"], got["data.image_dir"]) == ("clips", 1.5, "/data/media")
    assert not [e for e in entries if e.problem]
    defaults = flat(convert(EASYR1, [])[0])
    assert (defaults["data.video_key"], defaults["data.video_fps"]) == ("videos", 2.0)  # EasyR1's defaults
    config.validate(config.deep_merge(recipe, {"model": {"path": "m"}}))


def test_values_vlgrpo_cannot_honour_are_listed_with_the_reason():
    cfg = copy.deepcopy(EASYR1)
    recipe, entries = convert(cfg, ["worker.actor.model.lora.rank=64", "worker.actor.fsdp.torch_dtype=bf16",
                                    "trainer.val_freq=-1", "worker.rollout.val_override_config.min_p=0.1",
                                    "worker.actor.optim.lr_warmup_steps=10"])
    problems = {e.key: e.problem for e in entries if e.problem}
    assert set(problems) == {"worker.actor.fsdp.torch_dtype", "trainer.val_freq", "worker.rollout.val_override_config.min_p"}
    assert recipe["worker"]["actor"]["model"]["lora"]["rank"] == 64  # LoRA maps to peft adapters
    assert "bf16 with adamw (torch AdamW on bf16 weights) is not reproduced" in problems["worker.actor.fsdp.torch_dtype"]
    assert "val_freq" not in recipe["trainer"]
    # lr_warmup_steps wins over the ratio, as in EasyR1 (vlgrpo refuses both set)
    assert recipe["worker"]["actor"]["optim"]["lr_warmup_steps"] == 10 and recipe["worker"]["actor"]["optim"]["lr_warmup_ratio"] == 0.0
    with pytest.raises(config.ConfigError, match=r"'worker.actor.clip_ratio_hgih' is not an EasyR1 config key; did you mean "
                                                 r"worker.actor.clip_ratio_high"):
        convert(cfg, ["worker.actor.clip_ratio_hgih=0.28"])
    assert parse_override("a.b=['console','swanlab']") == ("a.b", ["console", "swanlab"])
    assert parse_override("a.b=1.0e-3") == ("a.b", 1e-3) and parse_override("a.b=True") == ("a.b", True)


def test_the_written_recipe_reads_back_and_names_every_key(tmp_path):
    recipe, entries = convert(EASYR1, ["worker.actor.ulysses_size=2"])
    text = render(recipe, entries, ["a header"])
    assert yaml.safe_load(text) == recipe
    lines = text.splitlines()
    assert lines[0] == "# a header"
    assert "  path: Qwen/Qwen2.5-VL-3B-Instruct  # worker.actor.model.model_path" in lines
    assert "  format_prompt: math  # data.format_prompt: ./examples/format_prompt/math.jinja" in lines
    assert "    batch_size: 64  # data.rollout_batch_size" in lines
    unsupported = lines.index("# NOT SUPPORTED: vlgrpo cannot honour these values (the run differs from EasyR1's here):")
    assert lines[unsupported + 1].startswith("#   worker.actor.ulysses_size: 2  (override; not supported: sequence parallelism")
    listed = {line.split(":")[0].strip("# ") for line in lines if line.startswith("#   ")}
    named = {line.split("#")[1].split()[0].rstrip(":") for line in lines if not line.startswith("#") and "#" in line}
    assert listed | named == {e.key for e in entries}  # every EasyR1 key appears once, as a value or a comment
    assert not listed & named


def test_the_command_writes_the_recipe_and_prints_what_is_not_supported(tmp_path):
    source = tmp_path / "config.yaml"
    source.write_text(yaml.safe_dump(EASYR1))
    out = tmp_path / "recipes" / "r.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-m", "vlgrpo.cli", "from-easyr1", str(source), "worker.actor.ulysses_size=4",
                          "--out", str(out)], capture_output=True, text=True, env=env)
    assert "not supported: worker.actor.ulysses_size=4 (override): sequence parallelism is not implemented" in run.stdout
    assert out.is_file() and yaml.safe_load(out.read_text())["experiment"] == "qwen_geo3k_grpo"
    assert run.returncode == 0, run.stderr  # the recipe validates
    bad = subprocess.run([sys.executable, "-m", "vlgrpo.cli", "from-easyr1", str(tmp_path / "none.yaml"), "--out", str(out)],
                         capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "config file not found" in bad.stderr


def test_the_docs_table_is_the_mapping():
    import importlib.util

    spec = importlib.util.spec_from_file_location("easyr1_table", ROOT / "scripts" / "easyr1_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "from-easyr1.md").read_text()
    assert module.with_table(page) == page, "docs/from-easyr1.md is out of date: python scripts/easyr1_table.py"
    for key in RULES:
        assert f"| `{key}` |" in page


@pytest.mark.slow
@pytest.mark.parametrize("path", CONVERTED, ids=lambda p: p.stem)
def test_every_converted_example_script_passes_a_dry_run(path, tmp_path):
    """Each converted EasyR1 geo3k script validates and `snakemake -n` plans its run."""
    recipe = yaml.safe_load(path.read_text())
    config.validate(recipe)
    planned = tmp_path / "recipe.yaml"
    planned.write_text(yaml.safe_dump(recipe))
    run = subprocess.run(["snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path / "work"), "-n",
                          "--cores", "1", "--configfile", str(planned)],
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "filter_data" in run.stdout and f"results/{recipe['experiment']}/data/train.parquet" in run.stdout  # segments follow the filtered size

import os
from pathlib import Path

import pytest
import yaml

from vlgrpo import config
from vlgrpo.cli import parse_assignment

ROOT = Path(__file__).resolve().parents[1]


def flat(d, prefix=""):
    """{'a.b': value} for every leaf of a nested dict."""
    out = {}
    for k, v in d.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def test_embedded_default_validates_and_fills_defaults():
    cfg = config.load(ROOT / "config.yaml")
    assert cfg["worker"]["actor"]["clip_ratio_dual"] == 3.0  # from the schema
    assert cfg["trainer"]["val_before_train"] is True


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b_geo3k.yaml", "easyr1_geo3k_default.yaml"])
def test_recipes_set_every_key_of_the_default(name):
    """Snakemake merges --configfile over config.yaml: a recipe must set every key the default sets
    (but the demo block), or a demo value would leak into it."""
    default = yaml.safe_load((ROOT / "config.yaml").read_text())
    recipe = yaml.safe_load((ROOT / "configs" / name).read_text())
    missing = {k for k in flat(default) if not k.startswith("demo.")} - set(flat(recipe))
    assert not missing
    config.load(ROOT / "config.yaml", ROOT / "configs" / name)


def test_seed_recipe_values():
    cfg = config.load(ROOT / "config.yaml", ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml")
    actor, rollout = cfg["worker"]["actor"], cfg["worker"]["rollout"]
    assert (rollout["batch_size"], rollout["n"], actor["global_batch_size"]) == (32, 4, 16)
    assert (cfg["data"]["max_response_length"], cfg["data"]["max_pixels"], cfg["data"]["min_pixels"]) == (512, 524288, 262144)
    assert (actor["optim"]["lr"], cfg["algorithm"]["kl_coef"], cfg["algorithm"]["kl_type"]) == (1e-6, 1e-2, "low_var_kl")
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_dual"]) == (0.2, 0.3, 3.0)
    assert (cfg["trainer"]["max_steps"], cfg["trainer"]["save_freq"], cfg["trainer"]["val_freq"]) == (195, 5, 5)
    assert rollout["val_override_config"] == {"temperature": 0.6, "top_p": 0.95, "n": 1}


def test_speed_overlay_is_the_benchmarked_switches_and_leaves_the_recipe_alone():
    speed = flat(yaml.safe_load((ROOT / "configs" / "speed_h200.yaml").read_text()))
    bench = flat(config.load(ROOT / "configs" / "bench_h200.yaml"))
    assert {k: bench[k] for k in speed} == speed  # what the H200 benchmark measured
    recipe = [ROOT / "config.yaml", ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml"]
    plain, fast = flat(config.load(*recipe)), flat(config.load(*recipe, ROOT / "configs" / "speed_h200.yaml"))
    assert {k for k in plain if plain[k] != fast[k]} <= set(speed)
    assert fast["worker.rollout.engine"] == "static" and fast["worker.actor.optim.lr"] == 1e-6


@pytest.mark.parametrize(
    "override, message",
    [
        ({"data": {"max_pixel": 5}}, "allowed keys: answer_key"),
        ({"worker": {"rollout": {"engine": "sglang"}}}, "'worker.rollout.engine' is 'sglang'; allowed values: 'hf'"),
        ({"worker": {"rollout": {"n": 1}}}, "'worker.rollout.n'"),
        ({"seed": "one"}, "'seed'"),
        ({"data": {"min_pixels": 600000}}, "'data.min_pixels' (600000) > 'data.max_pixels'"),
        ({"worker": {"rollout": {"batch_size": 10}}}, "multiple of 'worker.actor.global_batch_size'"),
        ({"worker": {"actor": {"optim": {"lr_warmup_steps": 2, "lr_warmup_ratio": 0.1}}}}, "are both set; set one"),
    ],
)
def test_bad_values_fail_naming_the_key(override, message):
    with pytest.raises(config.ConfigError) as e:
        config.load(ROOT / "config.yaml", overrides=override)
    assert message in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(config.ConfigError, match="config file not found"):
        config.load(tmp_path / "nope.yaml")


def test_snakemake_command_line_strings_are_read_as_yaml():
    """snakemake --config trainer='{max_steps: 400}' delivers nested values as strings."""
    cfg = config.load(ROOT / "config.yaml", overrides={"trainer": {"max_steps": "400", "val_before_train": "false"}})
    assert cfg["trainer"]["max_steps"] == 400 and cfg["trainer"]["val_before_train"] is False
    assert cfg["trainer"]["save_freq"] == config.load(ROOT / "config.yaml")["trainer"]["save_freq"]
    assert config.load(ROOT / "config.yaml", overrides={"experiment": "123"})["experiment"] == "123"
    with pytest.raises(config.ConfigError, match="'trainer.max_steps'"):
        config.load(ROOT / "config.yaml", overrides={"trainer": {"max_steps": "many"}})


def test_command_line_assignments():
    assert parse_assignment("worker.rollout.n=8") == {"worker": {"rollout": {"n": 8}}}
    assert parse_assignment("trainer.max_steps=null") == {"trainer": {"max_steps": None}}
    with pytest.raises(config.ConfigError, match="key=value"):
        parse_assignment("seed")


def test_resolved_config_round_trip(tmp_path):
    cfg = config.load(ROOT / "config.yaml")
    config.write_resolved(cfg, tmp_path / "c.yaml")
    assert config.read_resolved(tmp_path / "c.yaml") == cfg
    assert config.config_hash(cfg) == config.config_hash(config.read_resolved(tmp_path / "c.yaml"))


def test_hash_ignores_options_at_their_default():
    """A newer schema that adds an option (at its default) must not invalidate checkpoints or rerun jobs."""
    cfg = config.load(ROOT / "config.yaml")
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert config.config_hash(cfg) == config.config_hash(raw)  # defaults filled or not: same hash
    changed = config.deep_merge(cfg, {"worker": {"actor": {"clip_ratio_high": 0.28}}})
    assert config.config_hash(changed) != config.config_hash(cfg)
    part = {"data": {"min_pixels": cfg["data"]["min_pixels"]}}
    assert config.config_hash(part) != config.config_hash({"data": {"min_pixels": 1}})


def test_cli_turns_on_expandable_cuda_segments_unless_the_user_set_the_allocator(monkeypatch):
    from vlgrpo import cli

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["resolve", "--help"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(SystemExit):
        cli.main(["resolve", "--help"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"

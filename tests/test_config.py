import os
from pathlib import Path

import pytest
import yaml

from vlgrpo import config
from vlgrpo.policy import ForwardOptions

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


MINIMAL = {"experiment": "mine", "model": {"path": "/m"}, "data": {"train": "/t.parquet", "val": "/v.parquet"}}


def test_a_minimal_recipe_takes_the_schema_defaults():
    """Every group has a default, so a recipe needs only its name, model and data."""
    cfg = flat(config.validate(MINIMAL))
    schema = config.load_schema()
    for key, value in cfg.items():
        node = schema
        for part in key.split("."):
            node = node["properties"][part]
        assert value == node.get("default", value), key
    assert cfg["worker.actor.optim.lr"] == 1e-6 and cfg["trainer.device"] == "auto" and cfg["worker.rollout.n"] == 4


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b_geo3k.yaml", "bench_h200.yaml", "bench_cpu.yaml"])  # EasyR1's: test_from_easyr1.py
def test_configs_stand_on_their_own(name):
    config.load(ROOT / "configs" / name)


def test_seed_recipe_values():
    cfg = config.load(ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml")
    actor, rollout = cfg["worker"]["actor"], cfg["worker"]["rollout"]
    assert (rollout["batch_size"], rollout["n"], actor["global_batch_size"]) == (32, 4, 16)
    assert (cfg["data"]["max_response_length"], cfg["data"]["max_pixels"], cfg["data"]["min_pixels"]) == (512, 524288, 262144)
    assert (actor["optim"]["lr"], cfg["algorithm"]["kl_coef"], cfg["algorithm"]["kl_penalty"]) == (1e-6, 1e-2, "low_var_kl")
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_dual"]) == (0.2, 0.3, 3.0)
    assert (cfg["trainer"]["max_steps"], cfg["trainer"]["save_freq"], cfg["trainer"]["val_freq"]) == (195, 5, 5)
    assert rollout["val_override_config"] == {"temperature": 0.6, "top_p": 0.95, "top_k": None, "n": 1}


AUTO = {  # what each fast path is on CUDA
    "model.packed_vision_attention": True, "model.fused_rms_norm": True, "model.aligned_vision_mlp": True,
    "model.fused_vision_rope": True,
    "model.cudnn_attention": False, "worker.actor.dynamic_batching": True, "worker.actor.prefix_sharing": True,
    "worker.actor.logprobs_chunk_size": 4096, "worker.actor.old_logprobs_from_update": True,
    "worker.rollout.engine": "static",
}


def test_fast_paths_are_on_for_cuda_only_and_the_seed_recipe_runs_as_benchmarked():
    recipe = config.load(ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml")
    assert {k for k, v in flat(recipe).items() if v == "auto"} == set(AUTO)
    cuda, cpu = flat(config.for_device(recipe, "cuda")), flat(config.for_device(recipe, "cpu"))
    assert {k: cuda[k] for k in AUTO} == AUTO
    plain = flat(config.load(ROOT / "configs" / "plain.yaml", overrides=MINIMAL))
    assert {k: cpu[k] for k in AUTO} == {k: plain[k] for k in AUTO}  # off a GPU: the plain path
    bench = flat(config.for_device(config.load(ROOT / "configs" / "bench_h200.yaml"), "cuda"))
    timed = [k for k in bench if k != "model.path" and k.startswith(("model.", "worker.actor.micro", "worker.actor.dynamic", "worker.actor.prefix",
                                                "worker.actor.logprobs", "worker.actor.old", "worker.rollout.engine",
                                                "worker.rollout.cuda_graph"))]
    assert {k: cuda[k] for k in timed} == {k: bench[k] for k in timed}  # what the H200 benchmark measured
    # with gradient checkpointing the update shares prefixes in packed rows (a 4-D mask: not with flash_attention_2)
    checkpointed = config.for_device(config.validate(config.deep_merge(MINIMAL, {"model": {"gradient_checkpointing": True}})), "cuda")
    assert checkpointed["worker"]["actor"]["prefix_sharing"] is True
    assert ForwardOptions.from_config(checkpointed) == ForwardOptions(True, checkpointed["worker"]["actor"]["logprobs_chunk_size"])
    assert ForwardOptions.from_config(checkpointed, update=True).packed
    checkpointed["model"]["attn_implementation"] = "flash_attention_2"
    assert not ForwardOptions.from_config(checkpointed, update=True).prefix_sharing
    assert ForwardOptions.from_config(checkpointed).prefix_sharing
    # the plain overlay turns every fast path off, also on CUDA
    both = flat(config.for_device(config.load(ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml", ROOT / "configs" / "plain.yaml"), "cuda"))
    assert {k: both[k] for k in AUTO} == {k: plain[k] for k in AUTO}


def test_an_auto_switch_at_its_plain_value_hashes_as_auto():
    """Runs from before the switches became `auto` (off by default) resume on a CPU: same hash."""
    cfg = config.validate(MINIMAL)
    assert config.config_hash(config.for_device(cfg, "cpu")) == config.config_hash(cfg)
    assert config.config_hash(config.for_device(cfg, "cuda")) != config.config_hash(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"trainer": {"n_gpus_per_node": 4}, "worker": {"rollout": {"engine": "vllm"}}}, "'worker.rollout.engine' vllm with 4 processes"),
        ({"trainer": {"nnodes": 2}}, "'trainer.nnodes' 2 needs 'trainer.rdzv_endpoint'"),
    ],
)
def test_keys_not_implemented_yet_are_refused_by_name(override, message):
    with pytest.raises(config.ConfigError) as e:
        config.validate(config.deep_merge(MINIMAL, override))
    assert message in str(e.value)


def test_many_processes_are_accepted():
    cfg = config.validate(config.deep_merge(MINIMAL, {"trainer": {"n_gpus_per_node": 8, "nnodes": 2, "rdzv_endpoint": "node1:29400"}}))
    assert config.processes(cfg) == 16
    assert config.processes(config.validate(config.deep_merge(MINIMAL, {"trainer": {"n_gpus_per_node": 0}}))) == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ({"data": {"max_pixel": 5}}, "allowed keys: answer_key"),
        ({"worker": {"rollout": {"engine": "sglang"}}}, "'worker.rollout.engine' is 'sglang'; allowed values: 'auto', 'hf'"),
        ({"model": {"fused_rms_norm": "maybe"}}, "'model.fused_rms_norm' is 'maybe'; allowed values: 'auto', True, False"),
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
    switches = config.load(ROOT / "config.yaml", overrides={"model": {"fused_rms_norm": "false"}, "worker": {"actor": {
        "logprobs_chunk_size": "64", "prefix_sharing": "auto"}}})
    assert switches["model"]["fused_rms_norm"] is False and switches["worker"]["actor"]["logprobs_chunk_size"] == 64
    assert switches["worker"]["actor"]["prefix_sharing"] == "auto"
    with pytest.raises(config.ConfigError, match="'trainer.max_steps'"):
        config.load(ROOT / "config.yaml", overrides={"trainer": {"max_steps": "many"}})


def test_command_line_assignments():
    assert config.parse_assignment("worker.rollout.n=8") == {"worker": {"rollout": {"n": 8}}}
    assert config.parse_assignment("trainer.max_steps=null") == {"trainer": {"max_steps": None}}
    with pytest.raises(config.ConfigError, match="key=value"):
        config.parse_assignment("seed")


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

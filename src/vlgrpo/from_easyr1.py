"""`vlgrpo from-easyr1`: an EasyR1 config (its examples/config.yaml) plus a launch script's dotted
overrides (examples/*.sh) -> a vlgrpo recipe.

    vlgrpo from-easyr1 examples/config.yaml data.train_files=hiyouga/geometry3k@train ... --out RECIPE.yaml

RULES is the one mapping: every key of EasyR1's config dataclasses (verl/trainer/config.py,
verl/workers/*/config.py) with EasyR1's default for it and what vlgrpo does with it, one of
  mapped         a vlgrpo key with EasyR1's meaning (the value converted where the spelling differs);
  built in       no key: vlgrpo always behaves as EasyR1 with the values in `same`; other values are
                 not supported;
  no effect      a runtime or memory knob of EasyR1's stack (Ray, vLLM, FSDP1) that changes no result;
  not supported  a feature vlgrpo does not have; fine only with the values in `same`.
A value is taken from the overrides, else the config file, else EasyR1's default, so the recipe
carries EasyR1's experiment even where vlgrpo's defaults differ. Every value goes into the recipe or
into its comments: the recipe lists, as comments, each key that has no vlgrpo key, and the console
lists the ones whose value vlgrpo cannot honour. docs/from-easyr1.md is generated from RULES
(`python scripts/easyr1_table.py`; tests/test_from_easyr1.py checks that the page matches).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from vlgrpo import config as config_lib

MAPPED, BUILT_IN, NO_EFFECT, NOT_SUPPORTED = "mapped", "built in", "no effect", "not supported"
ANY = object()  # `same` for a key any value of which vlgrpo honours


class Unsupported(Exception):
    """A value of a mapped key that vlgrpo cannot honour; the message says why."""


@dataclass(frozen=True)
class Rule:
    """What vlgrpo does with one EasyR1 key.

    default: EasyR1's dataclass default, or a function of the other EasyR1 values (flat dict).
    kind: MAPPED, BUILT_IN, NO_EFFECT or NOT_SUPPORTED. target: the vlgrpo key (MAPPED only).
    convert(value, values) -> the vlgrpo value (MAPPED; raises Unsupported). same: the values vlgrpo
    reproduces (BUILT_IN, NOT_SUPPORTED), or a function(value, values) -> bool. note: the difference, or why.
    """

    default: Any
    kind: str
    target: str | None = None
    note: str = ""
    convert: Callable[[Any, dict], Any] | None = None
    same: Any = ()

    def honours(self, value, values: dict) -> bool:
        if self.kind in (MAPPED, NO_EFFECT) or self.same is ANY:
            return True
        return self.same(value, values) if callable(self.same) else value in self.same


def mapped(default, target, note="", convert=None) -> Rule:
    return Rule(default, MAPPED, target, note, convert)


def built_in(default, note, same=ANY) -> Rule:
    return Rule(default, BUILT_IN, None, note, None, same)


def no_effect(default, note) -> Rule:
    return Rule(default, NO_EFFECT, None, note)


def unsupported(default, note, same=()) -> Rule:
    return Rule(default, NOT_SUPPORTED, None, note, None, same)


def _template(value, values):
    """EasyR1's examples/format_prompt/{math,r1v}.jinja are vlgrpo's built-in templates, token for token."""
    if value is None:
        raise Unsupported("EasyR1 then sends the bare question; vlgrpo always applies a template")
    name = PurePosixPath(str(value)).name
    return name.removesuffix(".jinja") if name in ("math.jinja", "r1v.jinja") else value


def _reward(value, values):
    """EasyR1's examples/reward_function/{math,r1v}.py:compute_score are vlgrpo's built-ins."""
    if value is None:
        raise Unsupported("EasyR1 needs one too")
    path, _, name = str(value).rpartition(":") if not str(value).endswith(".py") else (value, ":", "main")
    stem = PurePosixPath(path).name
    return stem.removesuffix(".py") if stem in ("math.py", "r1v.py") and name == "compute_score" else value


def _dtype(value, values):
    return {"bf16": "bfloat16", "fp32": "float32"}[_check(value, ("bf16", "fp32"), "bf16 or fp32")]


def _check(value, allowed, what):
    if value not in allowed:
        raise Unsupported(f"{value!r}: vlgrpo takes {what}")
    return value


def _positive(what):
    def convert(value, values):
        if value is None or value < 1:
            raise Unsupported(f"{value!r} ({what}): vlgrpo has no such setting; every segment ends with a checkpoint "
                              "and validation follows trainer.val_freq")
        return value
    return convert


def _experiment(value, values):
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(value)).lstrip("_.-")
    return name or "easyr1"


def _torch_dtype_same(value, values):
    """fp32 parameters (null or fp32) are vlgrpo's fp32 master weights under adamw; bf16 parameters with
    adamw_bf16 are vlgrpo's adamw_bf16 on bf16 weights."""
    strategy = values.get("worker.actor.optim.strategy", "adamw")
    return value in (None, "fp32") or (value == "bf16" and strategy == "adamw_bf16")


def _warmup_ratio(value, values):
    # EasyR1 takes lr_warmup_steps where set and ignores the ratio; vlgrpo refuses both set.
    return 0.0 if values.get("worker.actor.optim.lr_warmup_steps") is not None else value


def _rollouts(key):
    """val_override_config.<key>'s default: EasyR1 overrides only the keys given, else validation samples as the rollout."""
    return lambda values: values[f"worker.rollout.{key}"]


_VLLM_ONLY = ("a vLLM setting; the recipe leaves worker.rollout.engine at auto (the static engine on CUDA, "
              "the same tokens as hf); with engine vllm set worker.rollout.{} yourself")
_NO_CRITIC = "no critic model: adv_estimator gae (the only user of a critic) is not implemented"
_REF = "the reference model is made like the policy (its dtype, FSDP2 sharding with several processes)"

RULES: dict[str, Rule] = {
    # --- data -------------------------------------------------------------------------------
    "data.train_files": mapped("", "data.train", "hub id@split or local parquet, as EasyR1"),
    "data.val_files": mapped("", "data.val"),
    "data.prompt_key": mapped("prompt", "data.prompt_key"),
    "data.answer_key": mapped("answer", "data.answer_key"),
    "data.image_key": mapped("images", "data.image_key"),
    "data.video_key": mapped("videos", "data.video_key"),
    "data.image_dir": mapped(None, "data.image_dir", "image and video paths are read relative to it"),
    "data.video_fps": mapped(2.0, "data.video_fps", "frames a second sampled by qwen-vl-utils"),
    "data.max_prompt_length": mapped(512, "data.max_prompt_length"),
    "data.max_response_length": mapped(512, "data.max_response_length"),
    "data.rollout_batch_size": mapped(512, "worker.rollout.batch_size", "prompts per training step"),
    "data.mini_rollout_batch_size": mapped(None, "data.mini_rollout_batch_size", "DAPO online filtering"),
    "data.val_batch_size": mapped(-1, "data.val_batch_size", "sequences per generate call; -1 all at once"),
    "data.format_prompt": mapped(None, "data.format_prompt",
                                 "EasyR1's math.jinja and r1v.jinja are the built-in templates math and r1v; "
                                 "another file is used by its path", _template),
    "data.override_chat_template": mapped(None, "data.override_chat_template"),
    "data.shuffle": mapped(True, "data.shuffle", "each epoch's order is a pure function of (seed, epoch)"),
    "data.seed": mapped(1, "seed", "one seed for data order and sampling"),
    "data.min_pixels": mapped(262144, "data.min_pixels"),
    "data.max_pixels": mapped(4194304, "data.max_pixels"),
    "data.filter_overlong_prompts": mapped(True, "data.filter_overlong_prompts"),
    "data.filter_overlong_prompts_workers": no_effect(16, "filtering is its own job (rule filter_data), run once"),
    # --- algorithm ----------------------------------------------------------------------------
    "algorithm.gamma": mapped(1.0, "algorithm.gamma", "reinforce_plus_plus's discount"),
    "algorithm.lam": unsupported(1.0, "GAE's lambda; adv_estimator gae is not implemented", ANY),
    "algorithm.adv_estimator": mapped("grpo", "algorithm.adv_estimator", "gae is refused"),
    "algorithm.disable_kl": mapped(False, "algorithm.disable_kl"),
    "algorithm.use_kl_loss": mapped(False, "algorithm.use_kl_loss", "false puts the KL penalty into the reward"),
    "algorithm.kl_penalty": mapped("kl", "algorithm.kl_penalty", "the KL estimator"),
    "algorithm.kl_coef": mapped(1e-3, "algorithm.kl_coef"),
    "algorithm.kl_type": mapped("fixed", "algorithm.kl_type", "the KL-in-reward controller, fixed or adaptive"),
    "algorithm.kl_horizon": mapped(10000.0, "algorithm.kl_horizon"),
    "algorithm.kl_target": mapped(0.1, "algorithm.kl_target"),
    "algorithm.online_filtering": mapped(False, "algorithm.online_filtering", "DAPO dynamic sampling"),
    "algorithm.filter_key": mapped("overall", "algorithm.filter_key"),
    "algorithm.filter_low": mapped(0.01, "algorithm.filter_low"),
    "algorithm.filter_high": mapped(0.99, "algorithm.filter_high"),
    # --- worker -------------------------------------------------------------------------------
    "worker.hybrid_engine": built_in(True, "rollout and training share the process and the weights", (True,)),
    "worker.actor.strategy": built_in("fsdp", "several processes shard with FSDP2", ("fsdp",)),
    "worker.actor.global_batch_size": mapped(256, "worker.actor.global_batch_size", "prompts per mini-batch (x rollout.n samples)"),
    "worker.actor.micro_batch_size_per_device_for_update": mapped(4, "worker.actor.micro_batch_size_per_device_for_update"),
    "worker.actor.micro_batch_size_per_device_for_experience": mapped(16, "worker.actor.micro_batch_size_per_device_for_experience"),
    "worker.actor.max_grad_norm": mapped(1.0, "worker.actor.max_grad_norm"),
    "worker.actor.clip_ratio_low": mapped(0.2, "worker.actor.clip_ratio_low"),
    "worker.actor.clip_ratio_high": mapped(0.3, "worker.actor.clip_ratio_high"),
    "worker.actor.clip_ratio_dual": mapped(3.0, "worker.actor.clip_ratio_dual"),
    "worker.actor.loss_avg_mode": mapped("token", "worker.actor.loss_avg_mode"),
    "worker.actor.loss_type": mapped("default", "worker.actor.loss_type", "default, gspo, gspo_token, cispo, sapo"),
    "worker.actor.ppo_epochs": mapped(1, "worker.actor.ppo_epochs"),
    "worker.actor.padding_free": no_effect(True, "vlgrpo's micro-batches are padded and masked: the same log-probs"),
    "worker.actor.dynamic_batching": mapped(True, "worker.actor.dynamic_batching", "same result either way; vlgrpo's default auto is on for CUDA"),
    "worker.actor.ulysses_size": unsupported(1, "sequence parallelism is not implemented", (1,)),
    "worker.actor.use_torch_compile": no_effect(True, "no torch.compile; vlgrpo's fast paths (fused RMSNorm, chunked log-probs) instead"),
    "worker.actor.tau_positive": mapped(1.0, "worker.actor.tau_positive", "sapo"),
    "worker.actor.tau_negative": mapped(1.05, "worker.actor.tau_negative", "sapo"),
    "worker.actor.model.model_path": mapped(None, "model.path"),
    "worker.actor.model.tokenizer_path": unsupported(None, "the processor is read from model.path", (None,)),
    "worker.actor.model.override_config": unsupported({}, "the model's config is used as saved", ({},)),
    "worker.actor.model.enable_gradient_checkpointing": mapped(True, "model.gradient_checkpointing"),
    "worker.actor.model.trust_remote_code": mapped(True, "model.trust_remote_code"),
    "worker.actor.model.freeze_vision_tower": mapped(False, "model.freeze_vision_tower"),
    "worker.actor.model.lora.rank": mapped(0, "worker.actor.model.lora.rank"),
    "worker.actor.model.lora.alpha": mapped(64, "worker.actor.model.lora.alpha"),
    "worker.actor.model.lora.target_modules": mapped("all-linear", "worker.actor.model.lora.target_modules"),
    "worker.actor.model.lora.exclude_modules": mapped(None, "worker.actor.model.lora.exclude_modules"),
    "worker.actor.optim.lr": mapped(1e-6, "worker.actor.optim.lr"),
    "worker.actor.optim.betas": mapped([0.9, 0.999], "worker.actor.optim.betas", convert=lambda v, _: list(v)),
    "worker.actor.optim.weight_decay": mapped(1e-2, "worker.actor.optim.weight_decay"),
    "worker.actor.optim.strategy": mapped("adamw", "worker.actor.optim.strategy",
                                          "adamw: fp32 master weights and moments; adamw_bf16: AnyPrecisionAdamW with Kahan "
                                          "summation (optim.py says where vlgrpo differs)",
                                          lambda v, _: _check(v, ("adamw", "adamw_bf16"), "adamw or adamw_bf16")),
    "worker.actor.optim.lr_warmup_ratio": mapped(0.0, "worker.actor.optim.lr_warmup_ratio",
                                                 "0 where lr_warmup_steps is set (EasyR1 then ignores the ratio)", _warmup_ratio),
    "worker.actor.optim.lr_warmup_steps": mapped(None, "worker.actor.optim.lr_warmup_steps"),
    "worker.actor.optim.min_lr_ratio": mapped(None, "worker.actor.optim.min_lr_ratio"),
    "worker.actor.optim.lr_scheduler_type": mapped("constant", "worker.actor.optim.lr_scheduler_type",
                                                   convert=lambda v, _: _check(v, ("constant", "cosine"), "constant or cosine")),
    "worker.actor.fsdp.enable_full_shard": built_in(True, "FSDP2 shards fully", (True,)),
    "worker.actor.fsdp.enable_cpu_offload": mapped(False, "trainer.fsdp_cpu_offload", "FSDP2's CPUOffloadPolicy"),
    "worker.actor.fsdp.enable_rank0_init": no_effect(True, "every rank loads the weights and keeps its shard"),
    "worker.actor.fsdp.use_orig_params": no_effect(False, "an FSDP1 setting; vlgrpo uses FSDP2"),
    "worker.actor.fsdp.torch_dtype": built_in(
        None, "EasyR1's parameter dtype: null or fp32 is vlgrpo's adamw (fp32 master weights, the model computes in "
              "mp_param_dtype); bf16 with adamw_bf16 is vlgrpo's adamw_bf16 on bf16 weights. bf16 with adamw (torch AdamW "
              "on bf16 weights) is not reproduced: vlgrpo keeps fp32 master weights", _torch_dtype_same),
    "worker.actor.fsdp.fsdp_size": unsupported(-1, "hybrid sharding: vlgrpo shards over all processes", (-1,)),
    "worker.actor.fsdp.mp_param_dtype": mapped("bf16", "model.dtype", "the dtype the model computes in", _dtype),
    "worker.actor.fsdp.mp_reduce_dtype": built_in("fp32", "gradients are reduced in fp32", ("fp32",)),
    "worker.actor.fsdp.mp_buffer_dtype": no_effect("fp32", "buffers keep the dtype the model loads them in"),
    "worker.actor.offload.offload_params": no_effect(False, "memory only: vlgrpo keeps the policy on its device "
                                                            "(trainer.fsdp_cpu_offload offloads shards throughout)"),
    "worker.actor.offload.offload_optimizer": no_effect(False, "memory only (see offload_params)"),
    "worker.ref.strategy": built_in("fsdp", _REF, ("fsdp",)),
    "worker.ref.fsdp.*": no_effect(None, _REF),
    "worker.ref.offload.*": no_effect(None, _REF),
    "worker.critic.*": unsupported(None, _NO_CRITIC, ANY),
    "worker.reward.reward_function": mapped(None, "worker.reward.reward_function",
                                            "EasyR1's math.py and r1v.py compute_score are the built-ins math and r1v; another "
                                            "file is loaded by its path (a file alone: its main), relative to the working directory",
                                            _reward),
    "worker.reward.reward_function_kwargs": mapped({}, "worker.reward.reward_function_kwargs"),
    "worker.reward.skip_special_tokens": mapped(True, "worker.reward.skip_special_tokens"),
    "worker.reward.num_cpus": no_effect(1, "grading runs in up to 8 processes on spare cores"),
    "worker.rollout.name": built_in("vllm", "EasyR1 always uses vLLM; the recipe leaves worker.rollout.engine at auto "
                                            "(static on CUDA); worker.rollout.engine: vllm is vlgrpo's vLLM engine", ("vllm",)),
    "worker.rollout.n": mapped(1, "worker.rollout.n"),
    "worker.rollout.temperature": mapped(1.0, "worker.rollout.temperature"),
    "worker.rollout.top_p": mapped(1.0, "worker.rollout.top_p"),
    "worker.rollout.top_k": mapped(-1, "worker.rollout.top_k"),
    "worker.rollout.seed": no_effect(1, "vLLM's sampling seed; vlgrpo keys every sample by the one seed (data.seed), "
                                        "step, prompt and sample, in random streams that are not vLLM's anyway"),
    "worker.rollout.limit_images": no_effect(0, _VLLM_ONLY.format("limit_images")),
    "worker.rollout.dtype": built_in("bf16", "rollouts run in the model's dtype (model.dtype)",
                                     lambda v, values: v == values.get("worker.actor.fsdp.mp_param_dtype", "bf16")),
    "worker.rollout.gpu_memory_utilization": no_effect(0.6, _VLLM_ONLY.format("gpu_memory_utilization")),
    "worker.rollout.ignore_eos": mapped(False, "worker.rollout.ignore_eos"),
    "worker.rollout.enforce_eager": mapped(False, "worker.rollout.cuda_graph", "negated: the static engine's decode step in a "
                                                                                "CUDA graph", lambda v, _: not v),
    "worker.rollout.enable_chunked_prefill": no_effect(False, _VLLM_ONLY.format("enable_chunked_prefill")),
    "worker.rollout.tensor_parallel_size": no_effect(2, "rollouts are data parallel: each process generates its share of "
                                                        "the prompts; worker.rollout.tensor_parallel_size is the vllm engine's"),
    "worker.rollout.max_model_len": no_effect(None, _VLLM_ONLY.format("max_model_len")),
    "worker.rollout.max_num_batched_tokens": no_effect(8192, _VLLM_ONLY.format("max_num_batched_tokens")),
    "worker.rollout.disable_log_stats": no_effect(True, "vLLM's logging"),
    "worker.rollout.disable_tqdm": no_effect(False, "progress bars"),
    "worker.rollout.val_override_config.temperature": mapped(_rollouts("temperature"), "worker.rollout.val_override_config.temperature",
                                                             "unset: the rollout's, as EasyR1"),
    "worker.rollout.val_override_config.top_p": mapped(_rollouts("top_p"), "worker.rollout.val_override_config.top_p",
                                                       "unset: the rollout's, as EasyR1"),
    "worker.rollout.val_override_config.top_k": mapped(None, "worker.rollout.val_override_config.top_k",
                                                       "unset (null): the rollout's, as EasyR1"),
    "worker.rollout.val_override_config.n": mapped(1, "worker.rollout.val_override_config.n"),
    "worker.rollout.val_override_config.*": unsupported(None, "validation sampling takes temperature, top_p, top_k and n"),
    # --- trainer ------------------------------------------------------------------------------
    "trainer.total_epochs": mapped(15, "trainer.total_epochs"),
    "trainer.max_steps": mapped(None, "trainer.max_steps", "the total steps where set, as EasyR1"),
    "trainer.project_name": mapped("easy_r1", "trainer.project_name"),
    "trainer.experiment_name": mapped("demo", "experiment", "outputs go to results/<experiment>/", _experiment),
    "trainer.logger": mapped(["console", "wandb"], "trainer.logger", "EasyR1's names; metrics.jsonl is always written",
                             lambda v, _: [v] if isinstance(v, str) else list(v)),
    "trainer.nnodes": mapped(1, "trainer.nnodes", "above 1 also needs trainer.rdzv_endpoint"),
    "trainer.n_gpus_per_node": mapped(8, "trainer.n_gpus_per_node"),
    "trainer.max_try_make_batch": mapped(20, "trainer.max_try_make_batch"),
    "trainer.critic_warmup": unsupported(0, _NO_CRITIC, (0,)),
    "trainer.val_freq": mapped(-1, "trainer.val_freq", "-1 (no validation) is not supported", _positive("no validation")),
    "trainer.val_before_train": mapped(True, "trainer.val_before_train"),
    "trainer.val_only": unsupported(False, "validate alone with the snakemake target "
                                           "results/<experiment>/val/step_000000.json", (False,)),
    "trainer.val_generations_to_log": mapped(0, "trainer.val_generations_to_log"),
    "trainer.save_freq": mapped(-1, "trainer.save_freq", "steps per segment; -1 (no saving) is not supported",
                                _positive("no checkpoints")),
    "trainer.save_limit": mapped(-1, "trainer.keep_checkpoints", "-1 (keep all) is not supported",
                                 _positive("keep every checkpoint")),
    "trainer.save_model_only": unsupported(False, "checkpoints always hold the optimizer state "
                                                  "(trainer.keep_validated_weights keeps weights of validated steps)", (False,)),
    "trainer.save_checkpoint_path": unsupported(None, "checkpoints live in results/<experiment>/checkpoints", (None,)),
    "trainer.load_checkpoint_path": unsupported(None, "a run resumes from its own store; no other start point", (None,)),
    "trainer.ray_timeline": no_effect(None, "no Ray"),
    "trainer.find_last_checkpoint": built_in(True, "a run always resumes from its last checkpoint", (True,)),
}

# Keys set on the command line of EasyR1's launcher that are not config keys.
LAUNCHER_KEYS = {"config": "the config file, given as CONFIG.yaml"}


def rule_for(key: str) -> tuple[str, Rule] | None:
    """(the RULES key, its rule) for an EasyR1 dotted key: its own, else a `prefix.*` one."""
    if key in RULES:
        return key, RULES[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        star = ".".join(parts[:i]) + ".*"
        if star in RULES:
            return star, RULES[star]
    return None


# Dict-valued keys: their values are kept whole, not flattened into sub-keys.
_DICT_KEYS = {"worker.reward.reward_function_kwargs", "worker.actor.model.override_config"}


def flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and name not in _DICT_KEYS:
            out.update(flatten(value, name))  # an empty group sets nothing
        else:
            out[name] = value
    return out


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' as EasyR1's launcher (OmegaConf.from_cli) reads it: YAML, and 3e-4 is a float."""
    if "=" not in text:
        raise config_lib.ConfigError(f"an override is key=value, got {text!r}")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str) and _FLOAT.match(value):
        value = float(value)
    return key.strip(), value


@dataclass
class Entry:
    """One EasyR1 key's fate in a conversion."""

    key: str
    value: Any
    source: str  # "config", "override" or "EasyR1 default"
    rule_key: str
    rule: Rule
    target: str | None = None
    converted: Any = None
    problem: str = ""  # why vlgrpo cannot honour this value ("" when it can)

    @property
    def status(self) -> str:
        if self.problem:
            return NOT_SUPPORTED
        return {MAPPED: "mapped", BUILT_IN: "same behaviour built in", NO_EFFECT: "no effect here",
                NOT_SUPPORTED: "unused here"}[self.rule.kind]


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, [k for k in RULES if not k.endswith("*")], n=3)
    return f"{key!r} is not an EasyR1 config key" + (f"; did you mean {', '.join(close)}?" if close else "")


def convert(easyr1_config: dict, overrides: list[str]) -> tuple[dict, list[Entry]]:
    """(the vlgrpo recipe, one Entry per EasyR1 key) for an EasyR1 config and its dotted overrides."""
    given = {k: (v, "config") for k, v in flatten(easyr1_config or {}).items()}
    for text in overrides:
        key, value = parse_override(text)
        if key in LAUNCHER_KEYS:
            continue
        given.update({k: (v, "override") for k, v in (flatten(value, key) if isinstance(value, dict) and key not in _DICT_KEYS
                                                      else {key: value}).items()})
    unknown = [k for k in given if rule_for(k) is None]
    if unknown:
        raise config_lib.ConfigError("; ".join(_unknown(k) for k in unknown))
    values = {k: v for k, (v, _) in given.items()}
    for key, rule in RULES.items():  # EasyR1's defaults for the keys neither sets
        if not key.endswith("*") and key not in values and not callable(rule.default):
            values[key] = rule.default
    for key, rule in RULES.items():  # defaults that follow other keys (val_override_config)
        if not key.endswith("*") and key not in values:
            values[key] = rule.default(values)
    entries, recipe = [], {}
    for key, value in values.items():
        rule_key, rule = rule_for(key)
        entry = Entry(key, value, given[key][1] if key in given else "EasyR1 default", rule_key, rule)
        if rule.kind == MAPPED:
            try:
                entry.converted = rule.convert(value, values) if rule.convert else value
                entry.target = rule.target
                _set(recipe, rule.target, entry.converted)
            except Unsupported as why:
                entry.problem = str(why)
        elif not rule.honours(value, values):
            entry.problem = rule.note
        entries.append(entry)
    return recipe, entries


def _set(tree: dict, dotted: str, value) -> None:
    node = tree
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


def _ordered(node: dict, schema: dict) -> list[str]:
    """node's keys in the schema's order; keys the schema lacks after them, as they come."""
    known = list(schema.get("properties", {}))
    return sorted(node, key=lambda k: known.index(k) if k in known else len(known))


def render(recipe: dict, entries: list[Entry], header: list[str]) -> str:
    """The recipe as YAML whose every line names its EasyR1 key; the keys without a vlgrpo key follow as comments."""
    by_target = {e.target: e for e in entries if e.target}
    lines = [f"# {line}" if line else "#" for line in header]

    dict_targets = {RULES[k].target for k in _DICT_KEYS if RULES[k].kind == MAPPED}

    def walk(node: dict, schema: dict, prefix: str, indent: str) -> None:
        for key in _ordered(node, schema):
            name = f"{prefix}.{key}" if prefix else key
            value = node[key]
            if isinstance(value, dict) and name not in dict_targets:
                lines.append(f"{indent}{key}:")
                walk(value, schema.get("properties", {}).get(key, {}), name, indent + "  ")
                continue
            entry = by_target[name]
            note = f"{entry.key}" + ("" if entry.source == "config" else f" ({entry.source})")
            if entry.converted != entry.value:
                note += f": {_scalar(entry.value)}"
            lines.append(f"{indent}{key}: {_scalar(value)}  # {note}")

    walk(recipe, config_lib.load_schema(), "", "")
    for title, pick in [("NOT SUPPORTED: vlgrpo cannot honour these values (the run differs from EasyR1's here)",
                         lambda e: e.problem),
                        ("Without a vlgrpo key (same behaviour, or no effect on results)",
                         lambda e: not e.problem and e.rule.kind != MAPPED)]:
        chosen = [e for e in entries if pick(e)]
        if chosen:
            lines += ["", f"# {title}:"]
            lines += [f"#   {e.key}: {_scalar(e.value)}  ({e.source}; {e.status}: {e.problem or e.rule.note})" for e in chosen]
    return "\n".join(lines) + "\n"


TABLE_START = "<!-- the table below is made from vlgrpo.from_easyr1.RULES by scripts/easyr1_table.py; do not edit -->"
TABLE_END = "<!-- end of the generated table -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """docs/from-easyr1.md's table: every EasyR1 key, its default, what vlgrpo does with it, the notes."""
    rows = ["| EasyR1 key | EasyR1 default | vlgrpo | notes |", "| --- | --- | --- | --- |"]
    for key, rule in RULES.items():
        default = "" if key.endswith("*") else "unset: the rollout's" if callable(rule.default) else f"`{_scalar(rule.default)}`"
        vlgrpo = f"`{rule.target}`" if rule.kind == MAPPED else rule.kind
        rows.append(f"| `{key}` | {_cell(default)} | {vlgrpo} | {_cell(rule.note)} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vlgrpo from-easyr1", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="EasyR1 config file (its examples/config.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="a launch script's dotted overrides")
    parser.add_argument("--out", required=True, help="the vlgrpo recipe to write")
    args = parser.parse_args(argv)
    path = Path(args.config)
    if not path.is_file():
        sys.exit(f"vlgrpo from-easyr1: config file not found: {path}")
    try:
        recipe, entries = convert(yaml.safe_load(path.read_text()), args.overrides)
    except config_lib.ConfigError as e:
        sys.exit(f"vlgrpo from-easyr1: {e}")
    command = " ".join(["vlgrpo from-easyr1", str(path), *args.overrides, "--out", args.out])
    header = [f"Made by: {command}", "Each value names the EasyR1 key it comes from (docs/from-easyr1.md).", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render(recipe, entries, header))
    problems = [e for e in entries if e.problem]
    print(f"wrote {args.out}: {sum(e.target is not None for e in entries)} EasyR1 keys mapped, "
          f"{sum(not e.problem and e.rule.kind != MAPPED for e in entries)} without a vlgrpo key (same behaviour or no effect), "
          f"{len(problems)} not supported")
    for e in problems:
        print(f"  not supported: {e.key}={_scalar(e.value)} ({e.source}): {e.problem}")
    try:
        config_lib.validate(recipe)
    except config_lib.ConfigError as e:
        print(f"vlgrpo from-easyr1: {args.out} does not validate with this vlgrpo:\n{e}", file=sys.stderr)
        return 1
    return 0

"""Load, validate and resolve experiment configs.

The JSON schema (config.schema.yaml, also at workflow/schemas/) is the one place where defaults
live: validation fills every missing key with its default, so code reads the resolved config and
never re-declares a hyperparameter.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from vlgrpo import atomic
from vlgrpo.errors import VlgrpoError

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
# The config groups that change what training computes (not max_steps, logging, retention): the
# training hash of a checkpoint and the rerun key of every job that depends on training.
TRAIN_KEYS = ("seed", "model", "data", "algorithm", "worker")


class ConfigError(VlgrpoError, ValueError):
    """A config that does not match the schema; the message names the key and what is allowed."""


NO_CUDA = ("trainer.device is 'cuda' but no CUDA device is visible here; use a GPU node, or set "
           "trainer.device: cpu (or auto: CUDA where there is a GPU)")


def _with_defaults(validator_class):
    """Extend a jsonschema validator so that it fills in `default` values of missing properties."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft7Validator)


@functools.lru_cache(maxsize=1)
def _parsed_schema() -> dict:
    # libyaml's parser where PyYAML has it: the pure-Python one takes a quarter second per read of the
    # schema, and every job validates its config (at least twice) before it starts work.
    return yaml.load(SCHEMA_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_schema() -> dict:
    """The schema (a copy: callers may change it)."""
    return copy.deepcopy(_parsed_schema())


def _describe(error: jsonschema.ValidationError) -> str:
    key = ".".join(str(p) for p in error.absolute_path) or "<top level>"
    schema = error.schema
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        return f"{error.message} at '{key}'; allowed keys: {', '.join(allowed)}"
    if error.validator == "required":  # one line naming the missing key, not the object's whole description
        missing = [k for k in error.validator_value if isinstance(error.instance, dict) and k not in error.instance]
        props = schema.get("properties", {})
        named = [f"'{key}.{k}'" if error.absolute_path else f"'{k}'" for k in missing]
        hints = [props.get(k, {}).get("description", "").split(";")[0].strip() for k in missing]
        return f"missing required key {', '.join(named)}" + "".join(f" ({h})" for h in hints if h)
    if error.validator == "enum":
        return f"'{key}' is {error.instance!r}; allowed values: {', '.join(map(repr, schema['enum']))}"
    what = schema.get("description", "")
    return f"'{key}': {error.message}" + (f" ({what})" if what else "")


def expand_dotted(cfg: dict) -> dict:
    """Turn top-level keys like "trainer.max_steps" (vlgrpo resolve --set trainer.max_steps=400) into
    nested ones, overriding what the nested dicts hold."""
    out = {k: v for k, v in cfg.items() if "." not in k}
    for key, value in cfg.items():
        if "." in key:
            nested: dict = {}
            node = nested
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
            out = deep_merge(out, nested)
    return out


def parse_assignment(text: str) -> dict:
    """'a.b.c=value' (--set on the command line) -> {'a': {'b': {'c': value}}}, the value read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    return expand_dotted({key: yaml.safe_load(value)})


def parse_assignments(items: list[str]) -> dict:
    """Several --set assignments as one nested override, later ones winning."""
    out: dict = {}
    for item in items:
        out = deep_merge(out, parse_assignment(item))
    return out


def _types(schema: dict) -> set:
    declared = schema.get("type", [])
    types = set(declared if isinstance(declared, list) else [declared])
    types |= {type(v).__name__ for v in schema.get("enum", [])}
    return types


def _coerce_strings(node, schema: dict):
    """Read string leaves as YAML where the schema wants no string: snakemake --config
    trainer='{max_steps: 400}' delivers nested values as strings."""
    if isinstance(node, dict):
        props = schema.get("properties", {})
        return {k: _coerce_strings(v, props[k]) if k in props else v for k, v in node.items()}
    if isinstance(node, str) and (not (_types(schema) & {"string", "str"}) or ("x-auto" in schema and node != "auto")):
        try:
            return yaml.safe_load(node)
        except yaml.YAMLError:
            return node
    return node


# Keys an older vlgrpo had under another name: refused with the key that replaced them.
RENAMED = {("worker", "actor", "lora_rank"): "worker.actor.model.lora.rank"}


def _refuse_renamed(cfg: dict) -> None:
    for path, new in RENAMED.items():
        node = cfg
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"'{'.'.join(path)}' is no longer a key: set '{new}' instead (0 = full fine-tuning)")


def validate(cfg: dict) -> dict:
    """Return a deep copy of `cfg` with defaults filled in; raise ConfigError naming every bad key."""
    _refuse_renamed(cfg)
    cfg = _coerce_strings(copy.deepcopy(cfg), load_schema())
    _refuse_old_kl_type(cfg)
    errors = sorted(_Validator(load_schema()).iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(e) for e in errors))
    # Cross-key rules the schema cannot express.
    data, rollout = cfg["data"], cfg["worker"]["rollout"]
    if data["min_pixels"] > data["max_pixels"]:
        raise ConfigError(f"'data.min_pixels' ({data['min_pixels']}) > 'data.max_pixels' ({data['max_pixels']})")
    actor = cfg["worker"]["actor"]
    if rollout["batch_size"] % actor["global_batch_size"]:
        raise ConfigError(
            f"'worker.rollout.batch_size' ({rollout['batch_size']}) must be a multiple of "
            f"'worker.actor.global_batch_size' ({actor['global_batch_size']})"
        )
    optim = actor["optim"]
    if optim["lr_warmup_steps"] is not None and optim["lr_warmup_ratio"]:
        raise ConfigError(
            f"'worker.actor.optim.lr_warmup_steps' ({optim['lr_warmup_steps']}) and 'lr_warmup_ratio' "
            f"({optim['lr_warmup_ratio']}) are both set; set one"
        )
    for refuse in _UNSUPPORTED:
        refuse(cfg)
    from vlgrpo.tracking import LOGGER_INSTALL, missing_loggers

    if missing := missing_loggers(cfg["trainer"]["logger"]):
        raise ConfigError(f"'trainer.logger' {missing}: not installed here; {LOGGER_INSTALL}, swanlab: pip install swanlab")
    return cfg


# Keys EasyR1 users know that this version cannot honour yet: each refused by its own check, to be
# deleted by the change that implements it.
def _refuse_unsupported_multi_process(cfg: dict) -> None:
    trainer, rollout = cfg["trainer"], cfg["worker"]["rollout"]
    if processes(cfg) > 1 and rollout["engine"] == "vllm":
        raise ConfigError(
            f"'worker.rollout.engine' vllm with {processes(cfg)} processes ('trainer.n_gpus_per_node' x 'trainer.nnodes'): "
            "the vLLM engine runs in one process for now; use engine hf or static"
        )
    if trainer["nnodes"] > 1 and not trainer["rdzv_endpoint"]:
        raise ConfigError(f"'trainer.nnodes' {trainer['nnodes']} needs 'trainer.rdzv_endpoint' (host:port where the nodes meet)")


def _refuse_old_kl_type(cfg: dict) -> None:
    """vlgrpo's kl_type used to name the KL estimator; EasyR1's kl_type is the coefficient's controller."""
    kl_type = (cfg.get("algorithm") or {}).get("kl_type")
    if kl_type in ("low_var_kl", "kl", "abs", "mse", "full"):
        raise ConfigError(
            f"'algorithm.kl_type' is {kl_type!r}, a KL estimator: set 'algorithm.kl_penalty: {kl_type}' instead. "
            "'algorithm.kl_type' is EasyR1's KL controller (fixed or adaptive)"
        )


def _refuse_unsupported_algorithms(cfg: dict) -> None:
    algorithm = cfg["algorithm"]
    if algorithm["adv_estimator"] == "gae":
        raise ConfigError(
            "'algorithm.adv_estimator' gae needs a critic (value) model, which is not implemented; "
            "use grpo, grpo_passk, rloo, reinforce_plus_plus or remax"
        )
    if algorithm["kl_penalty"] == "full":
        raise ConfigError(
            "'algorithm.kl_penalty' full needs the whole vocabulary distributions of policy and reference at "
            "every token, and only the sampled token's log-prob is kept: use low_var_kl, kl, abs or mse"
        )


def _refuse_unsupported_model(cfg: dict) -> None:
    """A local model folder of a family vlgrpo cannot train stops here, at parse time (a hub id's
    config is read where the model loads)."""
    from vlgrpo import models
    from vlgrpo.errors import DataError

    if Path(cfg["model"]["path"]).expanduser().is_dir():
        try:
            models.family_of(cfg["model"]["path"])
        except DataError as e:
            raise ConfigError(f"'model.path': {e}") from None


_UNSUPPORTED = (_refuse_unsupported_multi_process, _refuse_unsupported_algorithms, _refuse_unsupported_model)


def processes(cfg: dict) -> int:
    """Training processes of one segment: n_gpus_per_node (at least 1) on each of nnodes nodes."""
    return max(1, cfg["trainer"]["n_gpus_per_node"]) * cfg["trainer"]["nnodes"]


def _auto_keys(schema: dict, prefix: tuple = ()):
    """(path, x-auto) of every key whose default is `auto`."""
    for key, sub in schema.get("properties", {}).items():
        if "x-auto" in sub:
            yield prefix + (key,), sub["x-auto"]
        yield from _auto_keys(sub, prefix + (key,))


def for_device(cfg: dict, device, family=None) -> dict:
    """A copy of resolved `cfg` with every `auto` switch set for `device` (a torch.device or its type):
    the schema's x-auto value for CUDA, or for anything else. Jobs call it once they know their device
    (the resolved config keeps `auto`: the login node that writes it may have no GPU).
    family: the model's models.Family; the fast paths it cannot serve are turned off where `auto`
    and refused where set (models.limit_fast_paths)."""
    kind = "cuda" if getattr(device, "type", device) == "cuda" else "other"
    out = copy.deepcopy(cfg)
    for path, values in _auto_keys(load_schema()):
        node = out
        for part in path[:-1]:
            node = node[part]
        if node[path[-1]] == "auto":
            node[path[-1]] = values[kind]
    if family is not None:
        from vlgrpo.models import limit_fast_paths

        out = limit_fast_paths(cfg, out, family)
    return out


def deep_merge(base: dict, override: dict) -> dict:
    """Merge `override` into a copy of `base` the way Snakemake merges --configfile/--config."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load(*paths: str | os.PathLike, overrides: dict | None = None) -> dict:
    """Read YAML files in order (later ones override), apply `overrides`, validate."""
    cfg: dict[str, Any] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        cfg = deep_merge(cfg, yaml.safe_load(path.read_text()) or {})
    return validate(deep_merge(cfg, overrides or {}))


def _without_defaults(node, schema: dict):
    """`node` without the leaves that equal their schema default (None if nothing is left). An `auto`
    switch set to its value off CUDA counts as default, so a CPU job hashes as its config reads."""
    if isinstance(node, dict):
        props = schema.get("properties", {})
        kept = {k: _without_defaults(v, props.get(k, {})) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not None}
        return kept or None
    if "x-auto" in schema and schema["x-auto"]["other"] == node:
        return None
    return None if "default" in schema and schema["default"] == node else node


def config_hash(cfg: dict, schema: dict | None = None) -> str:
    """Hash of a (part of a) resolved config, made of the values that differ from the schema's
    defaults: a newer vlgrpo whose schema gains an option (at its default) hashes the same, so a
    run resumes and nothing reruns. `schema` is the part of the schema `cfg` is checked against."""
    explicit = _without_defaults(cfg, load_schema() if schema is None else schema)
    return hashlib.sha256(json.dumps(explicit, sort_keys=True).encode()).hexdigest()[:16]


def experiment_dir(cfg: dict) -> Path:
    return Path(cfg["results_dir"]) / cfg["experiment"]


def write_resolved(cfg: dict, path: str | os.PathLike) -> None:
    """Write the resolved config, replacing the file atomically."""
    atomic.write_text(path, yaml.safe_dump(cfg, sort_keys=False))


def read_resolved(path: str | os.PathLike) -> dict:
    """Read a resolved config written by write_resolved and validate it again."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"resolved config not found: {path}")
    return validate(yaml.safe_load(path.read_text()))

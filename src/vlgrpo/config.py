"""Load, validate and resolve experiment configs.

The JSON schema (config.schema.yaml, also at workflow/schemas/) is the one place where defaults
live: validation fills every missing key with its default, so code reads the resolved config and
never re-declares a hyperparameter.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


class ConfigError(ValueError):
    """A config that does not match the schema; the message names the key and what is allowed."""


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


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _describe(error: jsonschema.ValidationError) -> str:
    key = ".".join(str(p) for p in error.absolute_path) or "<top level>"
    schema = error.schema
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        return f"{error.message} at '{key}'; allowed keys: {', '.join(allowed)}"
    if error.validator == "enum":
        return f"'{key}' is {error.instance!r}; allowed values: {', '.join(map(repr, schema['enum']))}"
    what = schema.get("description", "")
    return f"'{key}': {error.message}" + (f" ({what})" if what else "")


def validate(cfg: dict) -> dict:
    """Return a deep copy of `cfg` with defaults filled in; raise ConfigError naming every bad key."""
    cfg = copy.deepcopy(cfg)
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
    if actor["optim"]["strategy"] == "adamw" and cfg["model"]["dtype"] != "float32":
        raise ConfigError(
            "'worker.actor.optim.strategy' adamw keeps float32 moments and needs 'model.dtype' float32; "
            "use adamw_bf16 for bfloat16 weights"
        )
    return cfg


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


def config_hash(cfg: dict) -> str:
    """Hash of the resolved config (sorted JSON), stored in checkpoints and markers."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def experiment_dir(cfg: dict) -> Path:
    return Path(cfg["results_dir"]) / cfg["experiment"]


def write_resolved(cfg: dict, path: str | os.PathLike) -> None:
    """Write the resolved config, replacing the file atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)


def read_resolved(path: str | os.PathLike) -> dict:
    """Read a resolved config written by write_resolved and validate it again."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"resolved config not found: {path}")
    return validate(yaml.safe_load(path.read_text()))

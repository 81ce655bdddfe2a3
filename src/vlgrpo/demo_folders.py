"""Where the demo's dataset and model are made: folders keyed by the settings that make them.

Every demo experiment shares demo.out_dir. A config names the plain folders (config.yaml:
results/_demo/geometry_synth/train.parquet, results/_demo/tiny_qwen2_5_vl); the workflow resolves
them (keyed) to folders named with a hash of what each is made from, e.g.
results/_demo/geometry_synth-<key>/train.parquet and results/_demo/tiny_qwen2_5_vl-<key>, and
config.resolved.yaml holds those. Experiments with the same settings share one folder; one with
another seed, pixel bounds or template gets its own, so it never rebuilds another's (which would
rerun that experiment), and a build that fails leaves every other folder as it was.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from vlgrpo import config as config_lib

DATA_NAME = "geometry_synth"
DATA_KEYS = ("seed", "demo.task", "demo.n_train", "demo.n_val", "demo.n_test", "demo.image_size")
MODEL_KEYS = ("seed", "demo", "data.min_pixels", "data.max_pixels", "data.format_prompt")


def _key(cfg: dict, dotted: tuple[str, ...]) -> str:
    picked = {}
    for name in dotted:
        node = cfg
        for part in name.split("."):
            node = node[part]
        picked[name] = node
    return config_lib.config_hash(config_lib.expand_dotted(picked))[:10]


def data_dir(cfg: dict) -> Path:
    """The folder of the synthetic dataset that cfg's seed and demo settings make."""
    return Path(cfg["demo"]["out_dir"]) / f"{DATA_NAME}-{_key(cfg, DATA_KEYS)}"


def keyed(cfg: dict) -> dict:
    """cfg with data.train, data.val and model.path that name the demo's plain folders resolved to
    the keyed ones (a copy; other paths, and paths already keyed, as they are)."""
    out = os.path.normpath(cfg["demo"]["out_dir"])
    cfg = copy.deepcopy(cfg)
    for split in ("train", "val"):
        path = Path(os.path.normpath(cfg["data"][split]))
        if str(path.parent) == os.path.join(out, DATA_NAME):
            cfg["data"][split] = str(data_dir(cfg) / path.name)
    model = Path(os.path.normpath(cfg["model"]["path"]))
    suffix = f"-{_key(cfg, MODEL_KEYS)}"
    if str(model.parent) == out and model.name != DATA_NAME and not model.name.endswith(suffix):
        cfg["model"]["path"] = str(model.with_name(model.name + suffix))
    return cfg

"""LoRA adapters on the policy (worker.actor.model.lora), built with peft.

peft injects its LoRA layers into the Hugging Face model in place (peft.inject_adapter_in_model), so
the policy stays the model class every other module reads (model.model.visual, model.lm_head, the
static engine's layers); only the adapters require grad, so the optimizer holds state for them only.
The reference model is the policy with its adapters switched off (adapters_disabled), not a copy.
A checkpoint's model/ folder is a peft adapter folder (adapter_config.json, adapter_model.safetensors
with PeftModel.save_pretrained's tensor names), loadable with PeftModel.from_pretrained on the base
model, plus base_model.json: the base model's path and fingerprint (bytes and SHA-256 of its config
and weight index), which a resume and a validation check. export_merged writes the adapters merged
into the base weights as a from_pretrained folder (peft's merge_and_unload).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from vlgrpo import atomic
from vlgrpo.config import ConfigError

log = logging.getLogger(__name__)
ADAPTER = "default"  # peft's adapter name; the only adapter
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the model's own names
BASE_FILE = "base_model.json"
ADAPTER_FILE = "model/adapter_model.safetensors"  # in a checkpoint folder
FINGERPRINTED = ("config.json", "model.safetensors.index.json", "model.safetensors")


def settings(cfg: dict) -> dict:
    return cfg["worker"]["actor"]["model"]["lora"]


def enabled(cfg: dict) -> bool:
    return settings(cfg)["rank"] > 0


def peft_config(cfg: dict):
    """peft.LoraConfig of worker.actor.model.lora (EasyR1's mapping: a comma list or all-linear)."""
    import peft

    lora = settings(cfg)
    targets = lora["target_modules"].strip()
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return peft.LoraConfig(
        r=lora["rank"], lora_alpha=lora["alpha"], target_modules=targets, exclude_modules=lora["exclude_modules"],
        lora_dropout=0.0, base_model_name_or_path=cfg["model"]["path"],
    )


def add_adapters(model, cfg: dict):
    """`model` with fresh LoRA adapters (B = 0: the model still computes the base function).

    A's random init is a pure function of cfg's seed (torch's global RNG forked, left as it was): every
    rank draws the same adapters, and a run on N processes starts where one on a single process starts."""
    import peft

    devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg["seed"])
            peft.inject_adapter_in_model(peft_config(cfg), model, ADAPTER)
    except ValueError as e:  # peft's message names the target modules it did not find
        raise ConfigError(f"'worker.actor.model.lora': {e}") from None
    return model


def _tuner_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model) -> bool:
    return bool(getattr(model, "peft_config", None)) and bool(_tuner_layers(model))


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def set_trainable(model, freeze_vision_tower: bool) -> None:
    """Only the adapters train (those on the vision tower too, unless it is frozen; a text-only model has none)."""
    from vlgrpo import models

    tower = models.vision_tower(model)
    visual = {id(p) for p in tower.parameters()} if tower is not None else set()
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) and not (freeze_vision_tower and id(p) in visual))


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model's function while inside (the reference model); a model without adapters as it is."""
    layers = _tuner_layers(model) if has_adapters(model) else []
    # peft's switch also sets requires_grad (True for every adapter when enabling): kept as it was here
    trainable = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in trainable:
            p.requires_grad_(flag)


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The adapters' parameters (DTensors under FSDP2) under the names PeftModel.save_pretrained gives them."""
    from peft import get_peft_model_state_dict

    params = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    return {PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(model, state_dict=params, adapter_name=ADAPTER).items()}


def counts(model) -> dict:
    """Trainable and total parameters (a sharded model's whole tensors)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, "total_params": total, "trainable_fraction": trainable / max(1, total)}


# --- the base model: referenced, not saved --------------------------------------------------------
def base_fingerprint(path: str) -> dict:
    """Bytes and SHA-256 of the base model's config and weight index (a single-file model: its weights),
    local folder or hub cache."""
    from transformers.utils import cached_file

    files = {}
    for name in FINGERPRINTED:
        if name == "model.safetensors" and "model.safetensors.index.json" in files:
            continue
        found = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        if found is not None:
            digest = hashlib.sha256()
            with open(found, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
            files[name] = {"bytes": os.path.getsize(found), "sha256": digest.hexdigest()}
    if "config.json" not in files:
        raise ConfigError(f"model.path {path!r} has no config.json: not a model folder or hub id")
    return {"path": str(path), "files": files}


def write_adapter_folder(model, folder: Path) -> None:
    """adapter_config.json (peft's) and base_model.json into `folder`; the tensors are written by the store."""
    model.peft_config[ADAPTER].save_pretrained(str(folder))
    atomic.write_json(folder / BASE_FILE, base_fingerprint(model.peft_config[ADAPTER].base_model_name_or_path))


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def check_base(folder: Path, base_path: str) -> None:
    """Refuse adapters in `folder` for a base model other than the one they were trained on."""
    recorded = json.loads((Path(folder) / BASE_FILE).read_text())
    current = base_fingerprint(base_path)
    if recorded["files"] != current["files"]:
        changed = sorted(n for n in set(recorded["files"]) | set(current["files"])
                         if recorded["files"].get(n) != current["files"].get(n))
        raise ConfigError(
            f"the adapters in {folder} were trained on the base model {recorded['path']!r}; model.path {base_path!r} "
            f"differs in {', '.join(changed)} (bytes or SHA-256): point model.path at that base model, or start a new experiment"
        )


def load_with_adapters(folder: Path, model_cfg: dict, device: torch.device):
    """The base model (model.path) with the adapters of checkpoint folder `folder`, through
    PeftModel.from_pretrained; prepared for inference. Returns the Hugging Face model (adapters inside)."""
    from peft import PeftModel

    from vlgrpo.policy import load_pretrained, prepare_model

    check_base(folder, model_cfg["path"])
    base = load_pretrained(model_cfg["path"], model_cfg, device)
    model = PeftModel.from_pretrained(base, str(folder), adapter_name=ADAPTER, is_trainable=False).get_base_model()
    return prepare_model(model, model_cfg, device, trainable=False)


def export_merged(model_cfg: dict, folder: Path, out: Path, processor=None) -> Path:
    """Base model + the adapters of `folder` merged into its weights (peft merge_and_unload), saved as a
    from_pretrained folder at `out` (replaced whole: written aside, then renamed). On the CPU, in the
    model's dtype."""
    from peft import PeftModel

    from vlgrpo.policy import load_pretrained

    check_base(folder, model_cfg["path"])
    base = load_pretrained(model_cfg["path"], model_cfg, torch.device("cpu"))
    merged = PeftModel.from_pretrained(base, str(folder), adapter_name=ADAPTER).merge_and_unload()
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    if processor is not None:
        processor.save_pretrained(str(tmp))
    atomic.fsync_tree(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out

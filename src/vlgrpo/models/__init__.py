"""What differs between model families: the one place the rest of vlgrpo asks.

A family is a transformers `model_type` (read from the model's config.json, local folder or hub
id). Each has a Family record: whether it sees images and at what pixel factor, how its vision
tower is reached, which fast paths compute for it what the plain path computes, and why not where
one cannot. Everything else (data sizing, policy loading and forwards, rollout engines, the
benchmark's random model) asks this module instead of branching on a model_type. A text-only
family's processor is its tokenizer (`tokenizer`, `takes_images`) and its rope positions are 1-D
(`text_positions`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from vlgrpo.errors import DataError

log = logging.getLogger("vlgrpo.models")


@dataclass(frozen=True)
class Family:
    model_type: str
    title: str
    vision: bool  # loads with AutoModelForImageTextToText and takes images; else AutoModelForCausalLM, text rows
    image_factor: int | None = None  # patch_size x merge_size: image sides snap to multiples of it
    window_vision: bool = False  # Qwen2.5-VL's windowed vision tower (its CPU index and packed attention)
    deepstack: bool = False  # vision features added into the first text layers (the model's own forward does it)
    interleaved_mrope: bool = False  # Qwen3-VL's interleaved 3-D rope (equal axes for text after the prompt)
    linear_attention: bool = False  # some layers are Gated DeltaNet with a recurrent state, not keys/values
    moe: bool = False  # sparse MoE MLPs in the text layers
    # Fast path (schema key) -> why it cannot serve this family; a key absent here serves it.
    cannot: dict = field(default_factory=dict)

    def serves(self, fast_path: str) -> bool:
        return fast_path not in self.cannot


_STATIC = "worker.rollout.engine"
_PREFIX = "worker.actor.prefix_sharing"
_PACKED = "model.packed_vision_attention"
_FUSED = "model.fused_rms_norm"
_NOT_WINDOWED = "packed vision attention is built for Qwen2.5-VL's windowed vision tower"
_NO_TOWER = "a text-only model has no vision tower"
_LINEAR = "its Gated DeltaNet layers keep a recurrent state, which the prefix cache and the static decode step do not build"

FAMILIES = {
    f.model_type: f
    for f in (
        Family("qwen2_vl", "Qwen2-VL", vision=True, image_factor=28, cannot={_PACKED: _NOT_WINDOWED}),
        Family("qwen2_5_vl", "Qwen2.5-VL", vision=True, image_factor=28, window_vision=True),
        Family("qwen3_vl", "Qwen3-VL", vision=True, image_factor=32, deepstack=True, interleaved_mrope=True,
               cannot={_PACKED: _NOT_WINDOWED}),
        Family("qwen3_vl_moe", "Qwen3-VL-MoE", vision=True, image_factor=32, deepstack=True, interleaved_mrope=True,
               moe=True, cannot={_PACKED: _NOT_WINDOWED, _STATIC: "the static decode step does not route MoE MLPs yet"}),
        Family("qwen3_5", "Qwen3.5", vision=True, image_factor=32, interleaved_mrope=True, linear_attention=True,
               cannot={_PACKED: _NOT_WINDOWED, _STATIC: _LINEAR, _PREFIX: _LINEAR,
                       _FUSED: "its RMSNorm scales by (1 + weight), which F.rms_norm does not"}),
        Family("qwen3_5_moe", "Qwen3.5-MoE", vision=True, image_factor=32, interleaved_mrope=True,
               linear_attention=True, moe=True,
               cannot={_PACKED: _NOT_WINDOWED, _STATIC: _LINEAR, _PREFIX: _LINEAR,
                       _FUSED: "its RMSNorm scales by (1 + weight), which F.rms_norm does not"}),
        # Text-only causal LMs: AutoModelForCausalLM, text rows, 1-D rope (text_positions).
        Family("qwen2", "Qwen2 / Qwen2.5 (text)", vision=False, cannot={_PACKED: _NO_TOWER}),
        Family("qwen3", "Qwen3 (text)", vision=False, cannot={_PACKED: _NO_TOWER}),
        Family("qwen3_moe", "Qwen3-MoE (text)", vision=False, moe=True,
               cannot={_PACKED: _NO_TOWER, _STATIC: "the static decode step does not route MoE MLPs yet"}),
        Family("llama", "Llama (text)", vision=False, cannot={_PACKED: _NO_TOWER}),
    )
}


def supported() -> str:
    return ", ".join(FAMILIES)


def family(model_type: str | None, where: str = "the model") -> Family:
    """The Family of `model_type`; DataError naming the supported ones otherwise."""
    if model_type is None:
        raise DataError(f"{where}: its config.json has no model_type; vlgrpo trains these families: {supported()}")
    if model_type not in FAMILIES:
        raise DataError(f"{where}: model_type {model_type!r} is not supported; vlgrpo trains these families: {supported()}")
    return FAMILIES[model_type]


def read_config(path: str | os.PathLike) -> dict:
    """A local model folder's config.json, or a hub id's config (AutoConfig), as a dict."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise DataError(f"{folder}: no config.json, so its model family is unknown (families: {supported()})")
        try:
            out = json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{config}: unreadable ({e}); it must name the model_type (families: {supported()})") from e
        if not isinstance(out, dict):
            raise DataError(f"{config}: not a JSON object; it must name the model_type (families: {supported()})")
        return out
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception as e:  # no hub here, an unknown id, an unknown architecture: say which
        raise DataError(f"model.path {str(path)!r}: cannot read its config to know the model family: {type(e).__name__}: {e}") from e


def family_of(path: str | os.PathLike) -> Family:
    """The Family of the model at `path` (local folder or hub id); DataError if unsupported, or if its
    attention uses a sliding window (the log-prob and decode paths attend to the whole sequence)."""
    config = read_config(path)
    fam = family(config.get("model_type"), str(path))
    text = config.get("text_config") or config
    if text.get("use_sliding_window"):
        raise DataError(f"{path}: its config sets use_sliding_window (a window of {text.get('sliding_window')} tokens), "
                        "which vlgrpo does not run: its log-prob and decode paths attend to the whole sequence. Set "
                        "use_sliding_window to false in config.json if prompt + response fit the window")
    return fam


def family_of_model(model) -> Family:
    """The Family of a loaded model (its config's model_type)."""
    return family(model.config.model_type, type(model).__name__)


def model_class(fam: Family):
    """The transformers Auto class that builds and loads this family's models."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if fam.vision else AutoModelForCausalLM


def text_model(model):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb): the language model of a
    vision-language model, the base model of a text-only one."""
    base = model.model
    return getattr(base, "language_model", base)


def head_dim(text_config) -> int:
    """Width of an attention head: the config's own head_dim where it sets one (Qwen3-VL-4B: 128, not
    hidden / heads = 80)."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def kv_cache_bytes(text_config, dtype, sequences: int, tokens: int) -> int:
    """Bytes of keys and values for `sequences` sequences of `tokens` tokens each (all layers)."""
    per_token = 2 * text_config.num_hidden_layers * text_config.num_key_value_heads * head_dim(text_config) * dtype.itemsize
    return sequences * tokens * per_token


def vision_tower(model):
    """The vision tower of a vision-language model; None for a text-only one."""
    return getattr(model.model, "visual", None)


def tokenizer(processor):
    """The tokenizer of `processor`: a vision-language processor's own, or the processor itself for a
    text-only model (data.sources.load_processor gives such a model its tokenizer, as EasyR1 does)."""
    return getattr(processor, "tokenizer", processor)


def takes_images(processor) -> bool:
    """Whether `processor` is a vision-language model's (it has an image processor)."""
    return getattr(processor, "image_processor", None) is not None


def text_positions(model, attention_mask):
    """Rope positions a text-only model is given over left-padded rows, as EasyR1 gives them and
    transformers' generate makes them: 0 at each row's first real token, padding at 0. (N, L) long.
    None for a vision-language family: its own forward derives 3-D mrope positions from the batch."""
    if family_of_model(model).vision:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def limit_fast_paths(settings: dict, cfg: dict, fam: Family) -> dict:
    """`cfg` (for_device's copy of `settings`) with each fast path `fam` cannot serve turned off.

    A switch that was `auto` in `settings` is turned off (the static engine falls back to hf) with a
    log line saying which and why; one set explicitly is refused with the family named.
    """
    from vlgrpo.config import ConfigError

    for key, why in fam.cannot.items():
        *parents, leaf = key.split(".")
        given, node = settings, cfg
        for part in parents:
            given, node = given[part], node[part]
        off = "hf" if leaf == "engine" else False
        if node[leaf] in (off, "vllm"):
            continue
        if given[leaf] != "auto":
            raise ConfigError(f"'{key}' is {given[leaf]!r}, which {fam.title} ({fam.model_type}) cannot run: {why}; "
                              f"set it to {off!r} or auto")
        node[leaf] = off
        log.info("%s for %s (%s): %s", f"{key}: {off}" if leaf == "engine" else f"{key} off", fam.title, fam.model_type, why)
    return cfg

"""Where rows and the processor come from: a hub id or a local path, checked before any work."""

from __future__ import annotations

import json
import os
import re
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoProcessor, ProcessorMixin

from vlgrpo import models
from vlgrpo.errors import DataError

if TYPE_CHECKING:
    import datasets

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_HUB_SPLIT = re.compile(r"[\w.-]+(\[[^\]]*\])?")  # "train", "test[:100]"


def _looks_local(spec: str) -> bool:
    """A string shaped like a file path rather than a hub id ('name' or 'owner/name')."""
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".parquet") or spec.count("/") > 1


def _parse_source(spec: str) -> list[Path] | tuple[str, str]:
    """Parquet files of a local file/folder spec, or (hub id, split) of 'owner/name@split'."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"bad data spec {spec!r}: expected 'owner/name@split' or a parquet file or folder")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".parquet":
            raise DataError(f"{spec}: not a .parquet file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise DataError(f"{spec}: folder holds no *.parquet files")
        return files
    if _looks_local(spec):
        raise FileNotFoundError(f"data file or folder not found: {spec}")
    name, at, split = spec.rpartition("@")
    if not at or not _HUB_ID.fullmatch(name) or not _HUB_SPLIT.fullmatch(split):
        raise DataError(
            f"bad data spec {spec!r}: expected a hub id with a split ('hiyouga/geometry3k@train') "
            "or an existing parquet file or folder"
        )
    return name, split


def load_split(spec: str, image_key: str, prompt_key: str, answer_key: str) -> datasets.Dataset:
    """Load one split: 'owner/name@split' from the hub, or a local parquet file or folder of them.

    Raises FileNotFoundError for a missing local path and DataError for a bad spec, an unreadable
    source, or a missing column (naming it and the columns there are).
    """
    import datasets  # here: training and evaluation load the processor from this module without it

    source = _parse_source(spec)
    try:
        if isinstance(source, list):
            ds = datasets.load_dataset("parquet", data_files=[str(f) for f in source], split="train")
        else:
            ds = datasets.load_dataset(source[0], split=source[1])
    except Exception as e:  # any loader failure: say which spec and why
        raise DataError(f"cannot load data {spec!r}: {type(e).__name__}: {e}") from e
    missing = [k for k in (image_key, prompt_key, answer_key) if k not in ds.column_names]
    if missing:
        raise DataError(
            f"{spec}: missing column(s) {', '.join(map(repr, missing))}; the columns there are "
            f"{', '.join(map(repr, ds.column_names))} (set data.image_key / prompt_key / answer_key)"
        )
    return ds


def _json_has_key(path: Path, key: str) -> bool:
    try:
        return path.is_file() and key in json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def check_model_folder(folder: str | os.PathLike) -> None:
    """Raise unless `folder` holds the config of a supported family (models.FAMILIES), its image
    processor (vision-language families), tokenizer and chat template.

    Both layouts count: the released one (preprocessor_config.json, vocab.json + merges.txt or
    tokenizer.json, chat_template.json) and the one transformers 5 saves (processor_config.json with
    'image_processor', tokenizer.json, chat_template.jinja). Weights are the trainer's to check.
    """
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model path not found: {folder}")
    if not folder.is_dir():
        raise DataError(f"model path is not a folder: {folder}")
    fam = models.family_of(folder)
    problems = []
    if fam.vision and not (
        (folder / "preprocessor_config.json").is_file() or _json_has_key(folder / "processor_config.json", "image_processor")
    ):
        problems.append("an image processor config (preprocessor_config.json, or processor_config.json with 'image_processor')")
    if not ((folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))):
        problems.append("tokenizer files (tokenizer.json, or vocab.json + merges.txt)")
    if not (
        (folder / "chat_template.jinja").is_file()
        or (folder / "chat_template.json").is_file()
        or _json_has_key(folder / "tokenizer_config.json", "chat_template")
        or _json_has_key(folder / "processor_config.json", "chat_template")
    ):
        problems.append("a chat template (chat_template.jinja, chat_template.json, or 'chat_template' in tokenizer_config.json)")
    if problems:
        raise DataError(f"{folder} is not a {fam.title} model folder; missing " + "; ".join(problems))


def load_processor(model_path: str) -> ProcessorMixin:
    """The model's processor, with its own pixel bounds (as EasyR1 loads it) and left padding.

    Its bounds (preprocessor_config.json) are the ones `images.model_image_size` snaps with, so it
    leaves the filter's images unchanged. A local-looking path is checked first
    (`check_model_folder`); anything else is a hub id. A folder that fails to load raises DataError
    with the loader's exception and traceback.
    """
    local = _looks_local(model_path) or Path(model_path).expanduser().exists()
    if local:
        check_model_folder(model_path)
        model_path = str(Path(model_path).expanduser())
    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except Exception as e:  # say which folder or hub id, and how loading failed
        if isinstance(e, OSError) and not local:
            raise DataError(f"model.path {model_path!r} is neither a local model folder nor a reachable hub id: {e}") from e
        raise _load_error(model_path, e) from e
    fam = models.family_of(model_path)
    if not fam.vision:  # a refusal to be deleted by the change that trains text rows
        raise DataError(f"{model_path}: {fam.title} is a text-only family; this version trains vision-language "
                        f"families only ({', '.join(k for k, f in models.FAMILIES.items() if f.vision)})")
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or getattr(processor, "tokenizer", None) is None:
        raise DataError(f"{model_path}: loaded {type(processor).__name__}, not a vision-language processor")
    factor = image_processor.patch_size * image_processor.merge_size
    if factor != fam.image_factor:
        raise DataError(f"{model_path}: image patch factor {factor} (patch_size * merge_size), "
                        f"expected {fam.image_factor} for {fam.title}")
    processor.tokenizer.padding_side = "left"
    return processor


def _load_error(model_path: str, e: Exception) -> DataError:
    trace = "".join(traceback.format_exception(e)).rstrip()
    return DataError(f"cannot load the processor from {model_path}: {type(e).__name__}: {e}\n{trace}")

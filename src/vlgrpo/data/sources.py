"""Where rows and the processor come from: a hub id or a local path, checked before any work."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin

from vlgrpo import models
from vlgrpo.errors import DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_HUB_SPLIT = re.compile(r"[\w.-]+(\[[^\]]*\])?")  # "train", "test[:100]"
# File suffix -> the `datasets` builder that reads it, as EasyR1 picks it (jsonl is read as json).
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _looks_local(spec: str) -> bool:
    """A string shaped like a file path rather than a hub id ('name' or 'owner/name')."""
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(tuple(BUILDERS)) or spec.count("/") > 1


def _data_files(path: Path) -> tuple[str, list[Path]]:
    """(builder, data files) of a local file or folder; a folder's files must be of one builder."""
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise DataError(f"{path}: not a data file; expected one of {', '.join(BUILDERS)}")
        return BUILDERS[path.suffix], [path]
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in BUILDERS)
    builders = sorted({BUILDERS[f.suffix] for f in files})
    if not files:
        raise DataError(f"{path}: folder holds no data files ({', '.join('*' + s for s in BUILDERS)})")
    if len(builders) > 1:
        raise DataError(f"{path}: folder mixes data file types ({', '.join(builders)}); keep one type per folder")
    return builders[0], files


def _text_features(csv_file: Path):
    """datasets Features reading every column of `csv_file`'s header as a string."""
    import datasets

    with open(csv_file, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _parse_source(spec: str) -> tuple[str, str, dict]:
    """(builder or hub id, split, load_dataset keyword arguments) of a data spec.

    As EasyR1: 'path@split' or 'owner/name@split'; a local path without '@' reads its 'train' split
    (a file or a folder without split-named files is all 'train'); a folder is read by the builder of
    its files' type with data_dir, so files named by split (train.jsonl, test.jsonl) are its splits.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"bad data spec {spec!r}: expected 'owner/name@split' or a local data file or folder")
    name, at, split = spec.rpartition("@") if "@" in spec else (spec, "", "train")
    path = Path(name).expanduser()
    if path.exists():
        if not _HUB_SPLIT.fullmatch(split):
            raise DataError(f"bad data spec {spec!r}: {split!r} is not a split name ('train', 'test[:100]')")
        builder, files = _data_files(path)
        empty = [f for f in files if not f.read_bytes().strip()]
        if empty:
            raise DataError(f"{empty[0]}: no rows (the file is empty)")
        if builder == "parquet" and not sum(_parquet_rows(f) for f in files):  # datasets fails on them unclearly
            raise DataError(f"{spec}: no rows in {', '.join(map(str, files))} (the parquet file(s) hold columns but no data)")
        location = {"data_files": str(path)} if path.is_file() else {"data_dir": str(path)}
        if builder == "csv":  # cells as written: pandas would read an answer column of "3", "12.5" as 3.0, 12.5
            location["features"] = _text_features(files[0])
        return builder, split, location
    if _looks_local(name):
        raise FileNotFoundError(f"data file or folder not found: {name}")
    if not at or not _HUB_ID.fullmatch(name) or not _HUB_SPLIT.fullmatch(split):
        raise DataError(
            f"bad data spec {spec!r}: expected a hub id with a split ('hiyouga/geometry3k@train') "
            f"or an existing data file or folder ({', '.join(BUILDERS)})"
        )
    return name, split, {}


def _parquet_rows(file: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file).metadata.num_rows
    except Exception as e:  # pyarrow's error says what is wrong with the bytes
        raise DataError(f"{file}: not a readable parquet file ({type(e).__name__}: {e})") from None


def load_split(spec: str, image_key: str, prompt_key: str, answer_key: str) -> datasets.Dataset:
    """Load one split as EasyR1 does: 'owner/name@split' from the hub, or a local parquet, json,
    jsonl or csv file or folder of them ('path@split' picks a split of a folder).

    Raises FileNotFoundError for a missing local path and DataError for a bad spec, an empty file or
    split ("no rows"), an unreadable source, or a missing prompt or answer column (naming it and the
    columns there are). The image column may be absent: the rows are then text-only.
    """
    import datasets  # here: training and evaluation load the processor from this module without it

    source, split, location = _parse_source(spec)
    try:
        ds = datasets.load_dataset(source, split=split, **location)
    except Exception as e:  # any loader failure: say which spec and why
        if "corresponds to no data" in str(e):  # datasets' words for a split of no rows (a header-only csv)
            raise DataError(f"{spec}: no rows") from e
        raise DataError(f"cannot load data {spec!r}: {type(e).__name__}: {e}") from e
    if len(ds) == 0:
        raise DataError(f"{spec}: no rows")
    if image_key not in ds.column_names:
        log.info("%s: no %r column (data.image_key): its rows are text-only", spec, image_key)
    missing = [k for k in (prompt_key, answer_key) if k not in ds.column_names]
    if missing:
        raise DataError(
            f"{spec}: missing column(s) {', '.join(map(repr, missing))}; the columns there are "
            f"{', '.join(map(repr, ds.column_names))} (set data.prompt_key / answer_key)"
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


def check_hub_model(model_id: str) -> bool:
    """Whether the hub serves `model_id` (True), or only this machine's cache holds it (False: load it
    with local_files_only); DataError at once, saying to give a local folder, when neither does.

    One request with a short timeout: unreached, transformers would retry every file for minutes.
    HF_HUB_OFFLINE=1 skips the request."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(model_id, "config.json"), str)
    fix = ("give a local model folder as model.path (config.json, the weights and the processor files; "
           "`huggingface-cli download ID --local-dir DIR` makes one where the hub can be reached)")
    if constants.HF_HUB_OFFLINE:
        if cached:
            return False
        raise DataError(f"model.path {model_id!r} is not a local folder, HF_HUB_OFFLINE is set and this machine's "
                        f"hub cache does not hold it; {fix}")
    try:
        model_info(model_id, timeout=10)
        return True
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise DataError(f"model.path {model_id!r} is not a local folder, and the hub refuses it "
                        f"({type(e).__name__}: {str(e).splitlines()[0]}); {fix}") from None
    except Exception as e:  # unreachable: no network, a proxy, a timeout
        if cached:
            return False
        raise DataError(f"model.path {model_id!r} is not a local folder, and the hub cannot be reached from here "
                        f"({type(e).__name__}: {e}) nor does this machine's hub cache hold it; {fix}") from None


def load_processor(model_path: str) -> ProcessorMixin | PreTrainedTokenizerBase:
    """The model's processor, with its own pixel bounds (as EasyR1 loads it) and left padding; for a
    text-only family its tokenizer (AutoTokenizer; EasyR1 has no processor for such a model), with
    EasyR1's pad token where it has none (the EOS token). models.tokenizer reads the tokenizer of either.

    Its bounds (preprocessor_config.json) are the ones `images.model_image_size` snaps with, so it
    leaves the filter's images unchanged. A local-looking path is checked first
    (`check_model_folder`); anything else is a hub id. A folder that fails to load raises DataError
    with the loader's exception and traceback.
    """
    local = _looks_local(model_path) or Path(model_path).expanduser().exists()
    if local:
        check_model_folder(model_path)
        model_path = str(Path(model_path).expanduser())
    cache_only = not local and not check_hub_model(model_path)
    fam = models.family_of(model_path)
    try:
        loader = AutoProcessor if fam.vision else AutoTokenizer
        processor = loader.from_pretrained(model_path, local_files_only=cache_only)
    except Exception as e:  # say which folder or hub id, and how loading failed
        if isinstance(e, OSError) and not local:
            raise DataError(f"model.path {model_path!r} is neither a local model folder nor a reachable hub id: {e}") from e
        raise _load_error(model_path, e) from e
    if not fam.vision:
        if processor.pad_token_id is None:  # as EasyR1's get_tokenizer (Llama's tokenizers have none)
            processor.pad_token = processor.eos_token
        processor.padding_side = "left"
        return processor
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or getattr(processor, "tokenizer", None) is None:
        raise DataError(f"{model_path}: loaded {type(processor).__name__}, not a vision-language processor")
    factor = image_processor.patch_size * image_processor.merge_size
    if factor != fam.image_factor:
        raise DataError(f"{model_path}: image patch factor {factor} (patch_size * merge_size), "
                        f"expected {fam.image_factor} for {fam.title}")
    processor.tokenizer.padding_side = "left"
    return processor


def override_chat_template(processor: ProcessorMixin, template_file: str | None) -> None:
    """Use the Jinja chat template in `template_file` (data.override_chat_template) for the
    processor and its tokenizer, as EasyR1 sets both; None keeps the model's."""
    if template_file is None:
        return
    path = Path(template_file).expanduser()
    if not path.is_file():
        raise DataError(f"data.override_chat_template: no such file {template_file}")
    processor.chat_template = models.tokenizer(processor).chat_template = path.read_text(encoding="utf-8")


def _load_error(model_path: str, e: Exception) -> DataError:
    trace = "".join(traceback.format_exception(e)).rstrip()
    return DataError(f"cannot load the processor from {model_path}: {type(e).__name__}: {e}\n{trace}")

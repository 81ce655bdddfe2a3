"""Dataset filtering stage on the real Geometry3K and the real Qwen2.5-VL-3B processor (no weights)."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import jinja2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from qwen_vl_utils import smart_resize as qwen_vl_utils_smart_resize
from transformers import AutoProcessor

from vlgrpo.config import validate
from vlgrpo.data.filtering import filter_split, load_filtered
from vlgrpo.data.images import (
    ResizeMismatchError,
    decode_images,
    model_image_size,
    processor_pixel_bounds,
    resize_image,
)
from vlgrpo.data.prompts import TEMPLATE_DIR, count_prompt_tokens, encode_prompts, format_prompt, render_prompt
from vlgrpo.data.sources import check_model_folder, load_processor, load_split
from vlgrpo.errors import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
GEO3K = SHARED / "geometry3k"
QWEN = SHARED / "qwen2_5_vl_3b"

# The seed recipe's values.
MIN_PIXELS, MAX_PIXELS, MAX_PROMPT_LENGTH, BATCH = 262144, 524288, 2048, 32
# The processor's own pixel bounds (preprocessor_config.json), the ones its snap to 28 uses.
QWEN_PIXELS = (3136, 12845056)
IMAGE_PAD, VISION_START, VISION_END, IM_START, PAD = 151655, 151652, 151653, 151644, 151643

R1V = (
    " A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>"
)
# Train rows of different sizes: 161x142 (far below min_pixels), 378x250 (below), 864x434 (inside),
# 1604x440 (above max_pixels).
SIZED_ROWS = {597: (161, 142), 561: (378, 250), 0: (864, 434), 124: (1604, 440)}

needs_shared = pytest.mark.skipif(not (GEO3K.is_dir() and QWEN.is_dir()), reason="shared/data is absent")


@pytest.fixture(scope="module")
def processor():
    if not QWEN.is_dir():
        pytest.skip("shared/data/qwen2_5_vl_3b is absent")
    return load_processor(str(QWEN))


@pytest.fixture(scope="module")
def train_table():
    if not GEO3K.is_dir():
        pytest.skip("shared/data/geometry3k is absent")
    return pq.read_table(GEO3K / "train.parquet")


@pytest.fixture(scope="module")
def saved_model(processor, tmp_path_factory) -> Path:
    """The processor saved in the layout transformers 5 writes, next to the real config.json."""
    folder = tmp_path_factory.mktemp("saved_model")
    processor.save_pretrained(folder)
    shutil.copy(QWEN / "config.json", folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory) -> Path:
    """The processor saved with narrower pixel bounds than the images of the filtered split."""
    folder = tmp_path_factory.mktemp("narrow_model")
    AutoProcessor.from_pretrained(QWEN, min_pixels=12544, max_pixels=50176).save_pretrained(folder)
    shutil.copy(QWEN / "config.json", folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def filtered(processor, train_table, tmp_path_factory) -> dict:
    """The first 33 train rows filtered with the seed recipe: source, outputs and stats."""
    folder = tmp_path_factory.mktemp("filtered")
    source = subset(train_table, list(range(33)), folder / "src.parquet")
    stats = filter_split(seed_cfg(str(source)), "train", folder / "train.parquet", folder / "train.stats.json", workers=1)
    return {"source": source, "parquet": folder / "train.parquet", "stats_file": folder / "train.stats.json", "stats": stats}


def seed_cfg(train: str, val: str | None = None, **data_overrides) -> dict:
    return validate(
        {
            "experiment": "test",
            "model": {"path": str(QWEN)},
            "data": {
                "train": train,
                "val": val or train,
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "max_prompt_length": MAX_PROMPT_LENGTH,
                "format_prompt": "r1v",
                **data_overrides,
            },
            "worker": {"rollout": {"batch_size": BATCH}},
        }
    )


def source_image(table: pa.Table, row: int) -> Image.Image:
    return Image.open(io.BytesIO(table.column("images")[row][0]["bytes"].as_py()))


def png(size=(64, 48), mode="RGB", color=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


GOOD_ROW = {"images": [{"bytes": png(), "path": None}], "problem": "<image>Find x.", "answer": "3"}


def write_rows(path: Path, rows: list[dict]) -> Path:
    schema = pa.schema(
        [
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
            ("problem", pa.string()),
            ("answer", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def subset(table: pa.Table, rows: list[int], path: Path) -> Path:
    pq.write_table(table.take(rows), path)
    return path


# ---------------------------------------------------------------------------------------------
# Templates and prompts


def test_builtin_templates_render_easyr1_text():
    assert format_prompt("  <image>Find x.\n", "r1v") == "<image>Find x." + R1V
    assert format_prompt("<image>Find x.", "math") == (
        "<image>Find x. You FIRST think about the reasoning process as an internal monologue and then "
        "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
        "The final answer MUST BE put in \\boxed{}."
    )


# EasyR1's examples/format_prompt/r1v.jinja, as its file reads (trailing newline included).
EASYR1_R1V_JINJA = "{{ content | trim }}" + R1V + "\n"


@needs_shared
def test_r1v_prompts_equal_easyr1s_rendering_on_every_test_problem():
    # EasyR1 reads the file, strips it, and renders it as a jinja2.Template with content=problem.
    easyr1 = jinja2.Template(EASYR1_R1V_JINJA.strip())
    assert (TEMPLATE_DIR / "r1v.jinja").read_text(encoding="utf-8") == EASYR1_R1V_JINJA
    problems = pq.read_table(GEO3K / "test.parquet", columns=["problem"]).column("problem").to_pylist()
    assert len(problems) == 601
    for problem in problems:
        assert format_prompt(problem, "r1v") == easyr1.render(content=problem)


def test_user_template_file_and_template_errors(tmp_path):
    user = tmp_path / "ask.jinja"
    user.write_text("Q: {{ content }}\n")
    assert format_prompt("1+1?", str(user)) == "Q: 1+1?"
    with pytest.raises(DataError, match=r"'nope': not one of \['math', 'r1v'\]"):
        format_prompt("x", "nope")
    lost = tmp_path / "lost.jinja"
    lost.write_text("Answer briefly.")
    with pytest.raises(DataError, match="never uses"):
        format_prompt("x", str(lost))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ content ")
    with pytest.raises(DataError, match="Jinja syntax error"):
        format_prompt("x", str(broken))


@needs_shared
def test_rendered_prompt_ids_equal_hand_written_chat(processor, train_table):
    problem = train_table.column("problem")[0].as_py()
    assert problem == "<image>$\\triangle RST \\cong \\triangle XYZ$. Find $y$."
    image = resize_image(source_image(train_table, 0), MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28)
    assert image.size == (868, 448)  # 864x434 snapped to multiples of 28
    n_image_tokens = (448 // 28) * (868 // 28)

    prompt = render_prompt(processor, problem, "r1v")
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "$\\triangle RST \\cong \\triangle XYZ$. Find $y$." + R1V + "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt == expected

    ids = processor(images=[image], text=[prompt], add_special_tokens=False)["input_ids"][0]
    expanded = expected.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens)
    assert ids == processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    start = ids.index(VISION_START)
    assert ids[:start] == [IM_START, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, IM_START, 872, 198]
    assert ids[start + 1 : start + 1 + n_image_tokens] == [IMAGE_PAD] * n_image_tokens
    assert ids[start + 1 + n_image_tokens] == VISION_END
    assert ids.count(IMAGE_PAD) == n_image_tokens == 496
    assert ids[-3:] == [IM_START, 77091, 198]  # "<|im_start|>assistant\n"
    assert processor.tokenizer.decode(ids[start + 2 + n_image_tokens : -5]) == problem[len("<image>") :] + R1V


# ---------------------------------------------------------------------------------------------
# Images


def easyr1_image_tokens(width: int, height: int) -> int:
    """Image tokens EasyR1 gives an image, from its rule written out: process_image scales into
    [MIN_PIXELS, MAX_PIXELS] (down, then up; int sides), then the processor, loaded with its own
    bounds, rounds each side to the nearest multiple of 28 (they never bind on Geometry3K)."""
    if width * height > MAX_PIXELS:
        scale = math.sqrt(MAX_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < MIN_PIXELS:
        scale = math.sqrt(MIN_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    rows, columns = round(height / 28), round(width / 28)
    assert QWEN_PIXELS[0] <= rows * columns * 28 * 28 <= QWEN_PIXELS[1]
    return rows * columns


def test_model_image_size_is_easyr1_prescale_then_the_processors_snap():
    assert model_image_size(864, 434, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28) == (868, 448)  # inside: snap only
    # 545x480 after scaling up, just under min_pixels: rounded to 532x476 (253,232 px), not up to 560x504.
    assert model_image_size(161, 142, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28) == (532, 476)
    # 1382x379 after scaling down: rounded to 1372x392 (537,824 px, over max_pixels), not down to 1372x364.
    assert model_image_size(1604, 440, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28) == (1372, 392)
    for width, height in [(161, 142), (378, 250), (864, 434), (1604, 440), (666, 803), (31, 2000)]:
        w, h = model_image_size(width, height, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28)
        assert w % 28 == h % 28 == 0 and (w // 28) * (h // 28) == easyr1_image_tokens(width, height)
        # The processor's own smart_resize (and qwen-vl-utils') leave the result unchanged.
        assert qwen_vl_utils_smart_resize(h, w, 28, *QWEN_PIXELS) == (h, w)
    # The demo: 112-pixel images, min = max = 12544, a processor with those bounds.
    assert model_image_size(112, 112, 12544, 12544, (12544, 12544), 28) == (112, 112)
    with pytest.raises(ValueError, match="aspect ratio"):
        model_image_size(1, 300, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28)
    with pytest.raises(ValueError, match="would snap again"):  # min == max leaves no 28-multiple size for 3:4
        model_image_size(300, 400, 12544, 12544, (12544, 12544), 28)


@needs_shared
@pytest.mark.parametrize(("split", "rows", "mean_tokens"), [("train", 2101, 344.1), ("validation", 300, 340.6), ("test", 601, 344.8)])
def test_image_tokens_per_image_equal_easyr1s_on_geometry3k(processor, split, rows, mean_tokens):
    """Every Geometry3K image gets EasyR1's token count through vlgrpo's sizing and the processor's
    own patch arithmetic (sizes read from the image headers; no pixels decoded)."""
    images = pq.read_table(GEO3K / f"{split}.parquet", columns=["images"]).column("images").to_pylist()
    assert len(images) == rows and all(len(row) == 1 for row in images)
    sizes = [Image.open(io.BytesIO(row[0]["bytes"])).size for row in images]
    pixels = processor_pixel_bounds(processor)
    assert pixels == QWEN_PIXELS
    ours, easyr1 = [], []
    for width, height in sizes:
        w, h = model_image_size(width, height, MIN_PIXELS, MAX_PIXELS, pixels, 28)
        ours.append(processor.image_processor.get_number_of_image_patches(h, w, {}) // 4)
        easyr1.append(easyr1_image_tokens(width, height))
    assert ours == easyr1
    assert round(float(np.mean(ours)), 1) == mean_tokens


def test_resize_image_resizes_then_converts_like_easyr1():
    size = model_image_size(100, 80, 784, 784 * 16, QWEN_PIXELS, 28)
    assert size == (112, 84)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (80, 100, 4), dtype=np.uint8)
    for alpha in (None, 255):  # translucent, then opaque (the fast path must give the same pixels)
        if alpha is not None:
            pixels[..., 3] = alpha
        rgba = Image.fromarray(pixels, "RGBA")
        out = resize_image(rgba, 784, 784 * 16, QWEN_PIXELS, 28)
        assert out.mode == "RGB" and out.size == size
        assert np.array_equal(np.asarray(out), np.asarray(rgba.resize(size).convert("RGB")))
    palette = Image.new("P", (100, 80), 3)
    assert resize_image(palette, 784, 784 * 16, QWEN_PIXELS, 28).mode == "RGB"


@needs_shared
@pytest.mark.parametrize("row", sorted(SIZED_ROWS))
def test_image_tokens_equal_resized_area_over_28_squared(processor, train_table, row):
    source = source_image(train_table, row)
    assert source.size == SIZED_ROWS[row]
    image = resize_image(source, MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28)
    w, h = image.size
    assert image.mode == "RGB" and w % 28 == 0 and h % 28 == 0
    assert (w // 28) * (h // 28) == easyr1_image_tokens(*source.size)
    prompt = render_prompt(processor, train_table.column("problem")[row].as_py(), "r1v")
    inputs = processor(images=[image], text=[prompt], return_tensors="pt")
    assert int((inputs["input_ids"] == IMAGE_PAD).sum()) == (h // 28) * (w // 28)
    assert inputs["image_grid_thw"].tolist() == [[1, h // 14, w // 14]]
    assert count_prompt_tokens(processor, prompt, [image]) == inputs["input_ids"].shape[1]
    # The processor did not resample the resized image: same pixels as with resizing switched off.
    unresized = processor(images=[image], text=[prompt], return_tensors="pt", do_resize=False)
    assert torch.equal(inputs["pixel_values"], unresized["pixel_values"])


# ---------------------------------------------------------------------------------------------
# Loading: datasets and the model folder


@needs_shared
def test_load_split_local_file_folder_and_errors(tmp_path, train_table):
    file = subset(train_table, [0, 1, 2], tmp_path / "a.parquet")
    ds = load_split(str(file), "images", "problem", "answer")
    assert len(ds) == 3 and ds[0]["answer"] == "15"
    subset(train_table, [3, 4], tmp_path / "b.parquet")
    assert len(load_split(str(tmp_path), "images", "problem", "answer")) == 5

    with pytest.raises(FileNotFoundError, match="not found: .*missing.parquet"):
        load_split(str(tmp_path / "missing.parquet"), "images", "problem", "answer")
    with pytest.raises(DataError, match=r"missing column\(s\) 'question'; the columns there are 'images', 'problem', 'answer'"):
        load_split(str(file), "images", "question", "answer")
    with pytest.raises(DataError, match="bad data spec 'hiyouga/geometry3k'"):
        load_split("hiyouga/geometry3k", "images", "problem", "answer")  # no @split
    with pytest.raises(DataError, match="bad data spec"):
        load_split("not a spec@train", "images", "problem", "answer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="folder holds no data files"):
        load_split(str(tmp_path / "empty"), "images", "problem", "answer")


def test_load_split_hub_id_goes_to_datasets(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DataError, match="cannot load data 'hiyouga/geometry3k@test\\[:10\\]'.*offline"):
        load_split("hiyouga/geometry3k@test[:10]", "images", "problem", "answer")
    assert calls == [("hiyouga/geometry3k", "test[:10]")]


def test_training_and_evaluation_start_without_importing_datasets():
    """Only the filter stage loads through datasets; every segment and evaluate job would pay its import."""
    code = "import sys, vlgrpo.trainer, vlgrpo.evaluate; print('datasets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path not found"):
        load_processor(str(tmp_path / "no_model"))
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(DataError, match="no config.json, so its model family is unknown .families: qwen2_vl, qwen2_5_vl"):
        load_processor(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(DataError, match="model_type 'gemma3' is not supported; vlgrpo trains these families: qwen2_vl"):
        check_model_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(DataError, match="not a Qwen3-VL model folder; missing an image processor"):
        check_model_folder(tmp_path)


@needs_shared
def test_processor_keeps_its_own_bounds_pads_left_and_loads_the_saved_layout(processor, saved_model, narrow_model):
    # EasyR1 loads the processor without pixel bounds: preprocessor_config.json's hold.
    assert processor_pixel_bounds(processor) == QWEN_PIXELS
    assert processor.tokenizer.padding_side == "left"
    # The layout transformers 5 saves (processor_config.json, tokenizer.json, chat_template.jinja)
    # is a model folder too, with the bounds it was saved with.
    check_model_folder(saved_model)
    assert processor_pixel_bounds(load_processor(str(saved_model))) == QWEN_PIXELS
    assert processor_pixel_bounds(load_processor(str(narrow_model))) == (12544, 50176)


@needs_shared
def test_a_processor_folder_that_cannot_load_says_why_and_the_filter_writes_nothing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for file in QWEN.iterdir():
        (model / file.name).symlink_to(file)
    (model / "preprocessor_config.json").unlink()
    (model / "preprocessor_config.json").write_text('{"min_pixels": 3136,')  # cut short
    with pytest.raises(DataError, match=f"(?s)cannot load the processor from {model}: OSError: .*Traceback") as error:
        load_processor(str(model))
    assert "preprocessor_config.json" in str(error.value)
    cfg = seed_cfg(str(GEO3K / "test.parquet"))
    cfg["model"]["path"] = str(model)
    with pytest.raises(DataError, match="cannot load the processor"):
        filter_split(cfg, "val", tmp_path / "out" / "v.parquet", tmp_path / "out" / "v.json")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Filtering


@needs_shared
def test_filter_split_writes_rendered_rows_and_stats(filtered, processor, train_table):
    stats = filtered["stats"]
    assert json.loads(filtered["stats_file"].read_text()) == stats
    assert stats["rows_in"] == stats["rows_kept"] == 33 and sum(stats["dropped"].values()) == 0
    assert stats["steps_per_epoch"] == 33 // BATCH == 1
    out = pq.read_table(filtered["parquet"])
    assert out.column_names == ["index", "images", "problem", "answer", "prompt", "prompt_length", "image_tokens", "videos"]
    assert out.schema.field("images").type == train_table.schema.field("images").type
    assert not list(filtered["parquet"].parent.glob("*.tmp"))
    lengths = out.column("prompt_length").to_pylist()
    assert stats["prompt_length"] == {
        "min": min(lengths),
        "mean": pytest.approx(np.mean(lengths)),
        "p50": pytest.approx(np.percentile(lengths, 50)),
        "p95": pytest.approx(np.percentile(lengths, 95)),
        "max": max(lengths),
    }
    tokens = out.column("image_tokens").to_pylist()
    assert stats["image_tokens"]["mean"] == pytest.approx(np.mean(tokens))

    # Every stored row is what training will see: same prompt, image, answer and token count.
    for row in load_filtered(filtered["parquet"])[:4]:
        i = row["index"]
        assert row["problem"] == train_table.column("problem")[i].as_py()
        assert row["answer"] == train_table.column("answer")[i].as_py()
        assert row["prompt"] == render_prompt(processor, row["problem"], "r1v")
        (image,) = row["images"]
        assert image.mode == "RGB"
        expected = resize_image(source_image(train_table, i), MIN_PIXELS, MAX_PIXELS, QWEN_PIXELS, 28)
        assert np.array_equal(np.asarray(image), np.asarray(expected))
        assert tokens[i] == easyr1_image_tokens(*source_image(train_table, i).size)
        assert len(processor(images=[image], text=[row["prompt"]])["input_ids"][0]) == lengths[i]


@needs_shared
def test_low_max_prompt_length_drops_rows_and_stats_say_so(filtered, tmp_path):
    full = pq.read_table(filtered["parquet"])
    lengths = full.column("prompt_length").to_pylist()
    limit = int(np.median(lengths))
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    assert 0 < len(too_long) < 33

    cfg = seed_cfg(str(filtered["source"]), max_prompt_length=limit)
    stats = filter_split(cfg, "val", tmp_path / "v.parquet", tmp_path / "v.json", workers=2)
    assert stats["dropped"]["prompt_too_long"] == len(too_long)
    assert stats["rows_kept"] == 33 - len(too_long) and stats["steps_per_epoch"] == 0
    assert stats["dropped_rows"] == {"prompt_too_long": too_long}
    assert stats["prompt_length"]["max"] <= limit
    # Two worker processes keep exactly the rows, images and prompts one process wrote.
    kept = [i for i in range(33) if i not in too_long]
    assert pq.read_table(tmp_path / "v.parquet").equals(full.take(kept))


@needs_shared
def test_each_bad_row_kind_is_dropped_with_its_reason(tmp_path):
    good = GOOD_ROW
    bad = {
        1: ("image_missing", {**good, "images": []}),
        2: ("image_missing", {**good, "images": None}),
        3: ("image_missing", {**good, "images": [{"bytes": None, "path": "gone.png"}]}),
        4: ("image_undecodable", {**good, "images": [{"bytes": b"\x89PNG but not really", "path": None}]}),
        5: ("image_undecodable", {**good, "images": [{"bytes": png()[:60], "path": None}]}),  # truncated
        6: ("no_image_placeholder", {**good, "problem": "Find x."}),
        7: ("more_placeholders_than_images", {**good, "problem": "<image><image>Compare."}),
        8: ("fewer_placeholders_than_images", {**good, "images": good["images"] * 2}),
        9: ("answer_empty", {**good, "answer": ""}),
        10: ("answer_empty", {**good, "answer": None}),
        11: ("problem_empty", {**good, "problem": " "}),
        12: ("image_size_unsupported", {**good, "images": [{"bytes": png((1, 300)), "path": None}]}),
        13: ("processor_error", {**good, "problem": "<image>Is <|image_pad|> a token?"}),
    }
    rows = [good] + [row for _, row in bad.values()] + [{**good, "problem": "<image> What is y?"}]
    source = write_rows(tmp_path / "bad.parquet", rows)
    stats = filter_split(seed_cfg(str(source)), "val", tmp_path / "t.parquet", tmp_path / "t.json", workers=1)

    expected: dict[str, list[int]] = {}
    for index, (reason, _) in bad.items():
        expected.setdefault(reason, []).append(index)
    assert stats["dropped_rows"] == expected
    assert {k: v for k, v in stats["dropped"].items() if v} == {k: len(v) for k, v in expected.items()}
    assert stats["rows_in"] == 15 and stats["rows_kept"] == 2 and stats["steps_per_epoch"] == 0
    assert pq.read_table(tmp_path / "t.parquet").column("index").to_pylist() == [0, 14]


@needs_shared
def test_every_row_failing_stops_with_the_first_exception_and_writes_nothing(tmp_path):
    rows = [{**GOOD_ROW, "problem": "<image>Is <|image_pad|> a token?"}] * 3 + [{**GOOD_ROW, "images": []}]
    source = write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError) as error:
        filter_split(seed_cfg(str(source)), "val", tmp_path / "out" / "v.parquet", tmp_path / "out" / "v.json", workers=1)
    message = str(error.value)
    assert message.startswith(f"'{source}' (val): 0 of 4 rows kept, fewer than 1 row; ")
    assert "top drop reasons: processor_error 3 (rows [0, 1, 2]), image_missing 1 (rows [3])" in message
    first = message.index("the first exception, row 0 (processor_error):\nTraceback (most recent call last):")
    assert message.rstrip().endswith("ValueError: 2 image placeholders in the prompt for 1 images")
    assert "count_prompt_tokens" in message[first:]  # the frames that raised
    assert not (tmp_path / "out").exists()


@needs_shared
def test_a_split_smaller_than_its_batch_is_an_error_naming_the_numbers(tmp_path):
    source = write_rows(tmp_path / "few.parquet", [GOOD_ROW] * 3 + [{**GOOD_ROW, "answer": ""}])
    cfg = seed_cfg(str(source))
    cfg["worker"]["rollout"]["batch_size"] = 4
    message = (
        f"'{source}' (train): 3 of 4 rows kept, fewer than one rollout batch of 4 (worker.rollout.batch_size); "
        "top drop reasons: answer_empty 1 (rows [3])"
    )
    with pytest.raises(DataError, match=re.escape(message) + "$"):
        filter_split(cfg, "train", tmp_path / "t.parquet", tmp_path / "t.json", workers=1)
    assert not list(tmp_path.glob("t.*"))
    # Three rows are a batch of 3, and validation needs one row.
    cfg["worker"]["rollout"]["batch_size"] = 3
    assert filter_split(cfg, "train", tmp_path / "t.parquet", tmp_path / "t.json", workers=1)["steps_per_epoch"] == 1
    cfg["worker"]["rollout"]["batch_size"] = 4
    assert filter_split(cfg, "val", tmp_path / "v.parquet", tmp_path / "v.json", workers=1)["rows_kept"] == 3


@needs_shared
def test_filter_split_checks_model_and_split_before_work(tmp_path):
    cfg = seed_cfg(str(tmp_path / "absent.parquet"))
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        filter_split(cfg, "test", tmp_path / "t.parquet", tmp_path / "t.json")
    cfg["model"]["path"] = str(tmp_path / "no_model")
    with pytest.raises(FileNotFoundError, match="model path not found"):
        filter_split(cfg, "train", tmp_path / "t.parquet", tmp_path / "t.json")


# ---------------------------------------------------------------------------------------------
# Reading back and encoding


@needs_shared
def test_encode_prompts_left_pads_a_batch(filtered, processor):
    rows = load_filtered(filtered["parquet"])
    assert [r["index"] for r in rows] == list(range(33))
    assert all(set(r) == {"index", "images", "problem", "answer", "prompt", "prompt_length", "videos"} for r in rows)
    lengths = [r["prompt_length"] for r in rows]
    pick = [int(np.argmin(lengths)), int(np.argmax(lengths))]
    rows, lengths = [rows[i] for i in pick], [lengths[i] for i in pick]

    batch = encode_prompts(processor, rows)
    longest = max(lengths)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["mm_token_type_ids"].shape == (2, longest)
    for b, n in enumerate(lengths):
        assert batch["attention_mask"][b].tolist() == [0] * (longest - n) + [1] * n
        assert batch["input_ids"][b, : longest - n].eq(PAD).all()
        assert batch["input_ids"][b, -3:].tolist() == [IM_START, 77091, 198]
    sizes = [r["images"][0].size for r in rows]
    assert batch["image_grid_thw"].tolist() == [[1, h // 14, w // 14] for w, h in sizes]
    assert batch["pixel_values"].shape == (sum(w * h // 196 for w, h in sizes), 3 * 2 * 14 * 14)
    assert batch["mm_token_type_ids"].sum() == sum(w * h // 784 for w, h in sizes)


@needs_shared
def test_encode_prompts_on_a_device_moves_only_the_pixel_values(filtered, processor):
    rows = load_filtered(filtered["parquet"])[:3]
    default = encode_prompts(processor, rows)
    explicit = encode_prompts(processor, rows, device="cpu")
    assert set(explicit) == set(default) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
    for key, value in default.items():  # device="cpu" is the default, bit for bit
        assert value.device.type == explicit[key].device.type == "cpu" and torch.equal(value, explicit[key]), key
    # Another device (meta stands in for the GPU): the image processor's output lands there, the
    # token ids and grids that host code reads stay on the CPU, unchanged.
    meta = encode_prompts(processor, rows, device=torch.device("meta"))
    assert meta["pixel_values"].device.type == "meta"
    assert meta["pixel_values"].shape == default["pixel_values"].shape and meta["pixel_values"].dtype == torch.float32
    for key in set(default) - {"pixel_values"}:
        assert meta[key].device.type == "cpu" and torch.equal(meta[key], default[key]), key


@needs_shared
def test_decode_images_decodes_lazy_images_in_place(filtered):
    images = [im for row in load_filtered(filtered["parquet"])[:5] for im in row["images"]]
    assert all(im.tile for im in images)  # opened, not decoded
    decode_images(images)
    assert not any(im.tile for im in images)
    again = [im for row in load_filtered(filtered["parquet"])[:5] for im in row["images"]]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, again))


@needs_shared
def test_encode_prompts_refuses_a_processor_that_would_resize(filtered, narrow_model, tmp_path):
    smaller = load_processor(str(narrow_model))
    rows = load_filtered(filtered["parquet"])[:1]
    with pytest.raises(ResizeMismatchError, match="the processor resized images"):
        encode_prompts(smaller, rows)
    with pytest.raises(ResizeMismatchError, match="the processor would resize images"):
        count_prompt_tokens(smaller, rows[0]["prompt"], rows[0]["images"])
    with pytest.raises(FileNotFoundError, match="run the filter_data stage"):
        load_filtered(tmp_path / "absent.parquet")


@needs_shared
def test_many_undecodable_images_warn_in_the_stats_and_the_report(tmp_path):
    """Half the rows undecodable used to go by without a word (issue 28)."""
    from vlgrpo.report.cli import main as report_main
    from vlgrpo.tracking import append_record

    broken = {**GOOD_ROW, "images": [{"bytes": b"\x89PNG but not really", "path": None}]}
    source = write_rows(tmp_path / "half.parquet", [GOOD_ROW, broken] * 4)
    exp = tmp_path / "exp"
    (exp / "data").mkdir(parents=True)
    stats = filter_split(seed_cfg(str(source)), "val", exp / "data" / "val.parquet", exp / "data" / "val.stats.json", workers=1)
    (warning,) = stats["warnings"]
    assert warning.startswith(f"{source} (val): 4 of 8 rows (50%) dropped as undecodable images (rows [1, 3, 5, 7]...")
    append_record(exp / "metrics.jsonl", {"step": 1, "reward/overall": 0.5})
    assert report_main(["--experiment-dir", str(exp), "--out", str(exp / "report")]) == 0
    assert json.loads((exp / "report" / "summary.json").read_text())["warnings"] == [warning]
    assert "dropped as undecodable images" in (exp / "report" / "report.html").read_text()

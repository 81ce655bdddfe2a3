"""The embedded default's inputs: the synthetic geometry task and the tiny Qwen2.5-VL with its warm-up."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLForConditionalGeneration

from vlgrpo import config
from vlgrpo.batch import PromptBatch
from vlgrpo.data.images import decode_image, processor_pixel_bounds, resize_image
from vlgrpo.data.prompts import encode_prompts, render_prompt
from vlgrpo.demo import make_dataset, make_model
from vlgrpo.demo.model import full_attention_blocks, init_model, mrope_section, tiny_config
from vlgrpo.demo.perception import region_targets, warm_up_vision
from vlgrpo.demo.processor import CHAT_TEMPLATE, SPECIAL_TOKENS, build_processor, build_tokenizer, train_bpe
from vlgrpo.demo.responses import COUNT_WEIGHTS, warmup_response
from vlgrpo.demo.task import QUESTIONS, SPLITS, best_constant_accuracy, make_rows
from vlgrpo.rewards import r1v
from vlgrpo.rewards import math as math_reward
from vlgrpo.rollout import SamplingParams
from vlgrpo.rollout.hf import HFEngine
from vlgrpo.rollout.sampling import sample_key

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
QWEN = SHARED / "qwen2_5_vl_3b"
ANSWERS = {"180", "360", "540", "720"}
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def demo_config(tmp: Path, **demo) -> dict:
    return config.load(
        ROOT / "config.yaml",
        overrides={
            "demo": {"out_dir": str(tmp), **demo},
            "model": {"path": str(tmp / "model")},
            "data": {"train": str(tmp / "data" / "train.parquet"), "val": str(tmp / "data" / "test.parquet")},
        },
    )


SMALL_DATA = {"n_train": 64, "n_val": 8, "n_test": 32}
SMALL_MODEL = {"warmup_steps": 3, "warmup_images": 4, "warmup_batch_size": 2}


def quadrants_drawn(png: bytes) -> int:
    """Quadrants of a figure that hold any non-white pixel: what a perfect reader would count."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    half = pixels.shape[0] // 2
    return sum(
        bool((pixels[r : r + half, c : c + half] < 250).any()) for r in (0, half) for c in (0, half)
    )


# ---------------------------------------------------------------------------------------------
# The task


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_data")
    cfg = demo_config(tmp, **SMALL_DATA)
    stats = make_dataset(cfg, tmp / "data")
    return cfg, tmp / "data", stats


def test_dataset_has_geometry3k_columns_and_image_dependent_answers(dataset):
    cfg, folder, stats = dataset
    assert sorted(p.name for p in folder.iterdir()) == ["test.parquet", "train.parquet", "validation.parquet"]
    reference = pq.read_schema(SHARED / "geometry3k" / "test.parquet") if SHARED.is_dir() else None
    sizes = {"train": 64, "validation": 8, "test": 32}
    for split in SPLITS:
        table = pq.read_table(folder / f"{split}.parquet")
        if reference is not None:
            assert table.schema.equals(reference, check_metadata=True)
        rows = table.to_pylist()
        assert len(rows) == sizes[split] == stats["splits"][split]["rows"]
        for row in rows:
            assert row["problem"].startswith("<image>") and row["problem"] in QUESTIONS
            assert row["answer"] in ANSWERS
            (image,) = row["images"]
            assert Image.open(io.BytesIO(image["bytes"])).size == (112, 112)
            # The answer is the triangle count read off the image, times 180.
            assert quadrants_drawn(image["bytes"]) * 180 == int(row["answer"])
    # Counts are balanced, so a text-only policy's best constant answer is right 1/4 of the time.
    assert stats["splits"]["test"]["answers"] == {a: 8 for a in sorted(ANSWERS)}
    assert stats["best_constant_answer"]["accuracy"] == 0.25


def test_dataset_loads_with_hf_datasets_as_images(dataset):
    _, folder, _ = dataset
    ds = datasets.load_dataset("parquet", data_files=str(folder / "validation.parquet"), split="train")
    assert isinstance(ds[0]["images"][0], Image.Image)


def test_dataset_is_deterministic_and_seeded(dataset, tmp_path):
    cfg, folder, _ = dataset
    make_dataset(cfg, tmp_path / "again")
    for split in SPLITS:
        assert (tmp_path / "again" / f"{split}.parquet").read_bytes() == (folder / f"{split}.parquet").read_bytes()
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in folder.iterdir())
    other = make_rows(cfg["seed"] + 1, "test", 4, 112)
    assert [r["images"][0]["bytes"] for r in other] != [
        r["images"][0]["bytes"] for r in make_rows(cfg["seed"], "test", 4, 112)
    ]


def test_no_figure_appears_in_two_splits(dataset):
    _, folder, _ = dataset
    seen = Counter()
    for split in SPLITS:
        images = pq.read_table(folder / f"{split}.parquet").column("images").to_pylist()
        seen.update({image[0]["bytes"] for image in images})
    assert max(seen.values()) == 1


def test_best_constant_accuracy():
    assert best_constant_accuracy(["180", "360", "360", "720"]) == ("360", 0.5)
    with pytest.raises(ValueError, match="no answers"):
        best_constant_accuracy([])


def test_bad_task_and_size_are_named(tmp_path):
    cfg = demo_config(tmp_path)
    cfg["demo"]["task"] = "count_squares"
    with pytest.raises(ValueError, match="count_squares"):
        make_dataset(cfg, tmp_path / "data")
    with pytest.raises(ValueError, match="at least one row"):
        make_rows(1, "train", 0, 112)


# ---------------------------------------------------------------------------------------------
# Warm-up responses


@pytest.mark.parametrize("template, grader", [("r1v", r1v), ("math", math_reward)])
def test_warmup_responses_teach_the_format_but_not_the_answer(template, grader):
    rng = np.random.default_rng(0)
    responses = [warmup_response(rng, template, 0.4) for _ in range(400)]
    formats = [grader(r, "360")["format"] for r in responses]
    assert 0.33 < np.mean(formats) < 0.47  # 3 standard deviations
    # Every response carries a gradeable answer, drawn with COUNT_WEIGHTS whatever the image ...
    accuracies = [np.mean([grader(r, truth)["accuracy"] for r in responses]) for truth in ("180", "360", "540", "720")]
    assert sum(accuracies) == pytest.approx(1.0)
    assert np.allclose(accuracies, COUNT_WEIGHTS, atol=0.075)  # 3 standard deviations
    # ... and the reasoning names no count: 180 is the only number before the answer.
    for r in responses:
        reasoning = r.split("<answer>")[0].split("\\boxed")[0].removeprefix("The answer is")
        assert set(re.findall(r"\d+", reasoning)) <= {"180"}, r


def test_warmup_response_rejects_unknown_template():
    with pytest.raises(ValueError, match="my.jinja"):
        warmup_response(np.random.default_rng(0), "my.jinja", 0.4)


# ---------------------------------------------------------------------------------------------
# Tokenizer and config pieces


def test_chat_template_is_qwen2_5_vl_verbatim():
    if not QWEN.is_dir():
        pytest.skip("shared Qwen2.5-VL-3B files absent")
    assert CHAT_TEMPLATE == json.loads((QWEN / "chat_template.json").read_text())["chat_template"]


def test_tokenizer_special_tokens_follow_the_vocab_in_qwen_order():
    vocab, merges = train_bpe(["<think> There are 3 triangles </think><answer> 540 </answer><|im_end|>"] * 20, 300)
    assert not any(t in vocab for t in SPECIAL_TOKENS)  # cut out of the corpus, never merged
    tokenizer = build_tokenizer(vocab, merges)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(vocab), len(vocab) + len(SPECIAL_TOKENS)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    with pytest.raises(ValueError, match="vocab_size=200"):
        train_bpe(["abc"], 200)


def test_mrope_and_full_attention_layout_match_qwen2_5_vl():
    assert mrope_section(128) == [16, 24, 24]  # Qwen2.5-VL-3B: head_dim 2048 / 16
    assert sum(mrope_section(32)) == 16
    assert full_attention_blocks(32) == [7, 15, 23, 31]
    assert full_attention_blocks(2) == [1]


def test_tiny_config_rejects_indivisible_heads(tmp_path):
    demo = demo_config(tmp_path)["demo"] | {"text_heads": 3}
    with pytest.raises(ValueError, match="text_heads"):
        tiny_config(demo, build_tokenizer({}, []))


# ---------------------------------------------------------------------------------------------
# The perception warm-up


def test_region_targets_are_colour_stats_per_image_token_in_row_major_order():
    image = Image.new("RGB", (56, 56), "white")
    image.paste((255, 0, 0), (28, 0, 56, 28))  # the top-right token's region
    image.paste((0, 0, 255), (0, 28, 28, 42))  # the top half of the bottom-left region
    targets = region_targets(image)
    assert targets.shape == (4, 6)
    assert targets[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert targets[1].tolist() == [1, 0, 0, 0, 0, 0]
    assert torch.allclose(targets[2], torch.tensor([0.5, 0.5, 1.0, 0.5, 0.5, 0.0]))
    with pytest.raises(ValueError, match="multiple of 28"):
        region_targets(Image.new("RGB", (50, 56)))


def count_r2(model, processor, images, counts) -> float:
    """Held-out R^2 of the triangle count from the mean RMS-normed image token (a linear probe)."""
    encoded = processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        tokens = model.model.visual(encoded["pixel_values"], grid_thw=encoded["image_grid_thw"]).pooler_output
    features = torch.nn.functional.rms_norm(tokens, (tokens.shape[-1],)).view(len(images), -1, tokens.shape[-1]).mean(1)
    x = torch.cat([features, torch.ones(len(images), 1)], 1).double()
    half = len(images) // 2
    w = torch.linalg.lstsq(x[:half], counts[:half, None], driver="gelsd").solution
    residual = (x[half:] @ w).squeeze(1) - counts[half:]
    return 1 - float(residual.pow(2).sum() / (counts[half:] - counts[half:].mean()).pow(2).sum())


def test_perception_warmup_makes_the_image_tokens_carry_the_figure(tmp_path):
    """Regressing region colours (no count, no question) makes the count linearly readable from the
    tokens the language model sees, on figures the warm-up never saw."""
    cfg = demo_config(tmp_path)
    demo, data = cfg["demo"], cfg["data"]
    processor = build_processor(build_tokenizer({}, []), data["min_pixels"], data["max_pixels"])
    rows = make_rows(cfg["seed"], "test", 128, demo["image_size"])
    pixels = processor_pixel_bounds(processor)
    images = [resize_image(decode_image(r["images"][0]), data["min_pixels"], data["max_pixels"], pixels, 28) for r in rows]
    counts = torch.tensor([int(r["answer"]) / 180 for r in rows], dtype=torch.float64)
    model = init_model(demo, processor.tokenizer, cfg["seed"])
    before = count_r2(model, processor, images, counts)
    stats = warm_up_vision(model, processor, images[:64], demo, np.random.default_rng(0))
    after = count_r2(model, processor, images, counts)
    assert stats["loss_final"] < stats["loss_first"]
    assert before < 0.6 and after > 0.85, (before, after)


# ---------------------------------------------------------------------------------------------
# The model folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_model")
    cfg = demo_config(tmp, **SMALL_MODEL)
    stats = make_model(cfg, tmp / "model")
    return cfg, tmp / "model", stats


def test_model_folder_loads_like_qwen2_5_vl_and_generates_with_an_image(model_dir):
    cfg, folder, stats = model_dir
    data = cfg["data"]
    processor = AutoProcessor.from_pretrained(folder, min_pixels=data["min_pixels"], max_pixels=data["max_pixels"])
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(model) is Qwen2_5_VLForConditionalGeneration
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert 300_000 < stats["parameters"] == sum(p.numel() for p in model.parameters()) < 5_000_000

    rows = []
    for row in make_rows(cfg["seed"], "test", 2, cfg["demo"]["image_size"]):
        image = resize_image(decode_image(row["images"][0]), data["min_pixels"], data["max_pixels"], processor_pixel_bounds(processor), 28)
        rows.append({"prompt": render_prompt(processor, row["problem"], data["format_prompt"]), "images": [image]})
    inputs = encode_prompts(processor, rows)
    image_tokens = (inputs["input_ids"] == model.config.image_token_id).sum(-1)
    assert image_tokens.tolist() == [stats["image_tokens_per_image"]] * 2 == [16, 16]

    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - inputs["input_ids"].shape[1] <= 6
    # The image reaches the logits: swapping the two rows' images changes them.
    logits = model(**inputs).logits[:, -1]
    swapped = dict(inputs, pixel_values=torch.cat(inputs["pixel_values"].chunk(2)[::-1]))
    assert not torch.allclose(logits, model(**swapped).logits[:, -1])


def test_token_ids_in_config_match_the_tokenizer_and_tags_are_not_special(model_dir):
    _, folder, stats = model_dir
    processor = AutoProcessor.from_pretrained(folder)
    tokenizer, cfg = processor.tokenizer, json.loads((folder / "config.json").read_text())
    ids = tokenizer.convert_tokens_to_ids
    assert cfg["image_token_id"] == ids("<|image_pad|>") == processor.image_token_id
    assert cfg["video_token_id"] == ids("<|video_pad|>")
    assert cfg["vision_start_token_id"] == ids("<|vision_start|>")
    assert cfg["vision_end_token_id"] == ids("<|vision_end|>")
    assert cfg["text_config"]["vocab_size"] == len(tokenizer) == stats["tokenizer_size"]
    assert cfg["text_config"]["eos_token_id"] == tokenizer.eos_token_id == ids("<|im_end|>")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids("<|im_end|>"), ids("<|endoftext|>")]
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert not set(TAGS) & set(tokenizer.all_special_tokens)
    response = "<think> There are 2 triangles, so 2 x 180 = 360. </think><answer> 360 </answer>"
    decoded = tokenizer.decode(tokenizer(response + "<|im_end|>")["input_ids"], skip_special_tokens=True)
    assert decoded == response and r1v(decoded, "360")["overall"] == 1.0


def test_model_build_is_deterministic_and_replaces_the_folder(model_dir, tmp_path):
    cfg, folder, _ = model_dir
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("from an older build")
    make_model(cfg, target)
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(p.name for p in target.iterdir())
    assert "model.safetensors" in files and "chat_template.jinja" in files
    for name in files:
        assert (target / name).read_bytes() == (folder / name).read_bytes(), name
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary or old folders left


# ---------------------------------------------------------------------------------------------
# After the default warm-up


@pytest.mark.slow
def test_default_warmup_teaches_format_at_t1_leaves_greedy_at_chance_and_grounds_the_figure(tmp_path):
    cfg = demo_config(tmp_path, n_train=4, n_val=4, n_test=64)
    data = cfg["data"]
    make_dataset(cfg, tmp_path / "data")
    stats = make_model(cfg, tmp_path / "model")
    assert stats["warmup"]["loss_final"] < 0.25 * stats["warmup"]["loss_first"]
    processor = AutoProcessor.from_pretrained(tmp_path / "model", min_pixels=data["min_pixels"], max_pixels=data["max_pixels"])
    processor.tokenizer.padding_side = "left"
    pixels = processor_pixel_bounds(processor)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").eval()
    rows = pq.read_table(tmp_path / "data" / "test.parquet").to_pylist()
    encoded = [
        {
            "prompt": render_prompt(processor, row["problem"], data["format_prompt"]),
            "images": [resize_image(decode_image(row["images"][0]), data["min_pixels"], data["max_pixels"], pixels, 28)],
        }
        for row in rows
    ]
    prompts = PromptBatch.from_processor(encode_prompts(processor, encoded), [1] * len(rows))
    engine = HFEngine(model, processor)

    def scores(temperature: float, n: int) -> dict[str, float]:
        keys = torch.tensor([sample_key(cfg["seed"], i, j) for i in range(len(rows)) for j in range(n)])
        out = engine.generate(prompts.repeat_interleave(n), keys, SamplingParams(temperature, 1.0, data["max_response_length"]), 64)
        graded = [r1v(text, row["answer"]) for text, row in zip(out.texts, (r for r in rows for _ in range(n)))]
        return {"texts": out.texts, **{k: float(np.mean([g[k] for g in graded])) for k in ("format", "accuracy")}}

    sampled, greedy = scores(1.0, 4), scores(0.0, 1)
    assert 0.05 < sampled["format"] < 0.6  # parseable some of the time: something for GRPO to reinforce
    assert greedy["format"] == 0.0  # greedy validation starts unformatted, as Qwen2.5-VL-3B on Geometry3K
    # and at chance: one answer whatever the figure (the warm-up's most frequent, "180"), right on the
    # quarter of the balanced rows that hold one triangle, as the best text-only policy is
    assert {re.sub(r"\d+", "#", t) for t in greedy["texts"]} == {"The answer is <answer> # </answer>"}
    assert {re.findall(r"\d+", t)[0] for t in greedy["texts"]} == {"180"}
    assert greedy["accuracy"] == 0.25

    # The grounding term keeps the figure prominent where the answer is written (the count explains
    # most of the hidden state's variance there); without it, the figure fades to a faint direction.
    answer_start = "<think> Each triangle has 180 degrees. </think><answer> "
    at_answer = PromptBatch.from_processor(
        encode_prompts(processor, [{**e, "prompt": e["prompt"] + answer_start} for e in encoded]), [1] * len(rows)
    )
    counts = torch.tensor([int(row["answer"]) // 180 for row in rows])
    ungrounded = tmp_path / "ungrounded"
    make_model(config.deep_merge(cfg, {"demo": {"warmup_grounding_coef": 0.0}}), ungrounded)
    share = {
        name: count_share_of_variance(AutoModelForImageTextToText.from_pretrained(folder).eval(), at_answer, counts)
        for name, folder in (("grounded", tmp_path / "model"), ("ungrounded", ungrounded))
    }
    assert share["grounded"] > 0.6 and share["ungrounded"] < 0.3, share


def count_share_of_variance(model, prompts: PromptBatch, counts: torch.Tensor) -> float:
    """Share of the variance of the final hidden state at the prompts' last position that the
    triangle count (N,) explains: between-count variance / total."""
    with torch.no_grad():
        hidden = model.model(**prompts.model_inputs(), use_cache=False).last_hidden_state[:, -1]  # (N, H)
    mean = hidden.mean(0)
    count_means = torch.stack([hidden[counts == k].mean(0) for k in counts.tolist()])  # (N, H)
    return float(((count_means - mean) ** 2).sum() / ((hidden - mean) ** 2).sum())

"""Every data form EasyR1 reads (parquet, json, jsonl, csv; files, folders, hub ids; image bytes,
structs and paths under data.image_dir; text-only rows) filters to the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlgrpo.config import validate
from vlgrpo.data.filtering import filter_split, load_filtered
from vlgrpo.data.sources import load_split
from vlgrpo.errors import DataError

QWEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "qwen2_5_vl_3b"
needs_qwen = pytest.mark.skipif(not QWEN.is_dir(), reason="shared/data/qwen2_5_vl_3b is absent")

ROWS = [  # images as paths relative to data.image_dir; the last row is text-only
    {"images": ["a.png"], "problem": "<image>Find x.", "answer": "3"},
    {"images": ["sub/b.png"], "problem": "What is the area? <image>", "answer": "12.5"},
    {"images": [], "problem": "What is 2 + 2?", "answer": "4"},
]


def cfg_for(train: str, **data) -> dict:
    return validate(
        {
            "experiment": "forms",
            "model": {"path": str(QWEN)},
            "data": {"train": train, "val": train, "format_prompt": "r1v", **data},
            "worker": {"rollout": {"batch_size": 2}, "actor": {"global_batch_size": 2}},
        }
    )


def write_images(folder: Path) -> None:
    (folder / "sub").mkdir(parents=True)
    Image.new("RGB", (300, 200), (200, 30, 30)).save(folder / "a.png")
    Image.new("L", (90, 700), 128).save(folder / "sub" / "b.png")


def write_form(path: Path, rows: list[dict]) -> Path:
    """`rows` as a parquet, json (one array), jsonl or csv file (csv: one path per cell, "" for none)."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        lines = ["images,problem,answer"] + [
            ",".join(json.dumps(v) for v in ((row["images"] or [""])[0], row["problem"], row["answer"])) for row in rows
        ]
        path.write_text("\n".join(lines) + "\n")
    return path


def filtered(cfg: dict, out: Path) -> tuple[dict, list[dict]]:
    stats = filter_split(cfg, "val", out / "v.parquet", out / "v.json", workers=1)
    return stats, load_filtered(out / "v.parquet")


@needs_qwen
def test_parquet_json_jsonl_and_csv_files_and_folders_filter_to_identical_prompts(tmp_path):
    images = tmp_path / "images"
    write_images(images)
    results = {}
    for suffix in (".parquet", ".json", ".jsonl", ".csv"):
        source = write_form(tmp_path / f"rows{suffix}", ROWS)
        results[suffix] = filtered(cfg_for(str(source), image_dir=str(images)), tmp_path / suffix[1:])
    stats, rows = results[".parquet"]
    assert stats["rows_kept"] == 3 and stats["kinds"] == {
        "image": {"kept": 2, "dropped": {}}, "video": {"kept": 0, "dropped": {}}, "text": {"kept": 1, "dropped": {}}
    }
    assert [len(r["images"]) for r in rows] == [1, 1, 0]
    assert rows[0]["images"][0].size == (616, 420)  # 300x200 scaled up to 627x418 (min_pixels), snapped to 28
    assert "<|image_pad|>" in rows[1]["prompt"] and "<|vision_start|>" not in rows[2]["prompt"]
    assert "<|im_start|>user\nWhat is 2 + 2? A conversation" in rows[2]["prompt"]
    for suffix, (other_stats, other_rows) in results.items():
        assert other_stats["prompt_length"] == stats["prompt_length"], suffix
        for a, b in zip(rows, other_rows, strict=True):
            assert (a["prompt"], a["answer"], a["problem"]) == (b["prompt"], b["answer"], b["problem"]), suffix
            assert [im.tobytes() for im in a["images"]] == [im.tobytes() for im in b["images"]], suffix

    # A folder of files named by split: 'folder@split' picks one, as EasyR1 reads it (data_dir).
    folder = tmp_path / "folder"
    folder.mkdir()
    write_form(folder / "train.jsonl", ROWS[:2])
    write_form(folder / "test.jsonl", ROWS)
    assert len(load_split(f"{folder}@test", "images", "problem", "answer")) == 3
    assert len(load_split(str(folder), "images", "problem", "answer")) == 2  # no @: 'train'
    _, folder_rows = filtered(cfg_for(f"{folder}@test", image_dir=str(images)), tmp_path / "folder_out")
    assert [r["prompt"] for r in folder_rows] == [r["prompt"] for r in rows]
    # Absolute paths need no image_dir; bytes structs need none either.
    absolute = [{**row, "images": [str(images / p) for p in row["images"]]} for row in ROWS]
    structs = [
        {**row, "images": [{"bytes": (images / p).read_bytes(), "path": None} for p in row["images"]]} for row in ROWS
    ]
    for name, form in (("abs", absolute), ("bytes", structs)):
        _, got = filtered(cfg_for(str(write_form(tmp_path / f"{name}.jsonl" if name == "abs" else tmp_path / f"{name}.parquet", form))), tmp_path / name)
        assert [r["prompt"] for r in got] == [r["prompt"] for r in rows]
        assert [im.tobytes() for r in got for im in r["images"]] == [im.tobytes() for r in rows for im in r["images"]]


@needs_qwen
def test_a_dataset_without_an_image_column_is_text_only_rendered_by_the_tokenizer_template(tmp_path):
    source = write_form(tmp_path / "text.jsonl", [{"problem": "What is 2 + 2?", "answer": "4"}] * 2)
    stats, rows = filtered(cfg_for(str(source)), tmp_path / "out")
    assert stats["kinds"]["text"]["kept"] == 2 and stats["kinds"]["image"]["kept"] == 0
    assert stats["image_tokens"]["max"] == 0 and rows[0]["images"] == []
    assert rows[0]["prompt"].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")


@needs_qwen
def test_missing_and_corrupt_image_files_are_dropped_naming_the_rows(tmp_path):
    images = tmp_path / "images"
    write_images(images)
    (images / "bad.png").write_bytes(b"\x89PNG not an image")
    rows = ROWS + [
        {"images": ["gone.png"], "problem": "<image>Find y.", "answer": "1"},
        {"images": ["bad.png"], "problem": "<image>Find z.", "answer": "2"},
        {"images": [], "problem": "<video>What happens?", "answer": "3"},  # a video placeholder without a video
        {"images": [], "videos": ["clip.mp4"], "problem": "What happens?", "answer": "3"},
    ]
    stats, kept = filtered(cfg_for(str(write_form(tmp_path / "r.jsonl", rows)), image_dir=str(images)), tmp_path / "o")
    assert [r["index"] for r in kept] == [0, 1, 2]
    assert stats["dropped_rows"] == {"image_missing": [3], "image_undecodable": [4], "video_missing": [5], "no_video_placeholder": [6]}
    assert stats["kinds"] == {
        "image": {"kept": 2, "dropped": {"image_missing": 1, "image_undecodable": 1}},
        "video": {"kept": 0, "dropped": {"video_missing": 1, "no_video_placeholder": 1}},
        "text": {"kept": 1, "dropped": {}},
    }
    # A split where every row fails stops with the first error, naming the file it could not find.
    source = write_form(tmp_path / "bad.jsonl", rows[3:5])
    with pytest.raises(DataError, match=r"(?s)0 of 2 rows kept.*row 0 \(image_missing\).*image file not found: .*gone.png"):
        filtered(cfg_for(str(source), image_dir=str(images)), tmp_path / "bad")


def test_empty_files_and_bad_specs_are_errors_naming_the_file(tmp_path):
    for suffix in (".parquet", ".json", ".jsonl", ".csv"):
        (tmp_path / f"empty{suffix}").write_bytes(b"")
        with pytest.raises(DataError, match=f"empty{suffix}: no rows"):
            load_split(str(tmp_path / f"empty{suffix}"), "images", "problem", "answer")
    header_only = tmp_path / "header.csv"
    header_only.write_text("images,problem,answer\n")
    with pytest.raises(DataError, match="header.csv: no rows"):
        load_split(str(header_only), "images", "problem", "answer")
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(DataError, match="rows.txt: not a data file; expected one of .parquet, .json, .jsonl, .csv"):
        load_split(str(tmp_path / "rows.txt"), "images", "problem", "answer")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_form(mixed / "a.jsonl", ROWS)
    write_form(mixed / "b.csv", ROWS)
    with pytest.raises(DataError, match="mixes data file types \\(csv, json\\)"):
        load_split(str(mixed), "images", "problem", "answer")
    with pytest.raises(FileNotFoundError, match="not found: .*absent.jsonl"):
        load_split(str(tmp_path / "absent.jsonl"), "images", "problem", "answer")


@needs_qwen
def test_override_chat_template_renders_image_and_text_rows_with_the_given_template(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}{% endfor %}[assistant]"
    )
    images = tmp_path / "images"
    write_images(images)
    rows = ROWS + [{"problem": "Plain text?", "answer": "1"}]
    cfg = cfg_for(str(write_form(tmp_path / "r.jsonl", rows)), image_dir=str(images), format_prompt=str(write_plain(tmp_path)),
                  override_chat_template=str(template))
    _, kept = filtered(cfg, tmp_path / "o")
    assert kept[0]["prompt"] == "[user]<|vision_start|><|image_pad|><|vision_end|>Find x.[assistant]"
    assert [r["prompt"] for r in kept[2:]] == ["[user]What is 2 + 2?[assistant]", "[user]Plain text?[assistant]"]
    cfg["data"]["override_chat_template"] = str(tmp_path / "absent.jinja")
    with pytest.raises(DataError, match="data.override_chat_template: no such file .*absent.jinja"):
        filtered(cfg, tmp_path / "absent")


def write_plain(folder: Path) -> Path:
    """A format prompt that is the problem alone."""
    (folder / "plain_format.jinja").write_text("{{ content }}")
    return folder / "plain_format.jinja"

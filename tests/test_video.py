"""Video rows (tiny demo model, float32, CPU): read, rendered and counted as EasyR1 does, dropped with
reasons when bad, and through every engine and log-prob path. Videos are frames written here (a list
of frame images, which qwen-vl-utils takes without a video reader) or a tiny mp4 file."""

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from conftest import make_experiment
from test_mixed_data import trains_two_steps_and_resumes_bitwise
from vlgrpo import config, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.data.filtering import filter_split, load_filtered
from vlgrpo.data.prompts import encode_prompts, fetch_videos, format_prompt
from vlgrpo.data.sources import load_processor
from vlgrpo.errors import DataError
from vlgrpo.policy import ForwardOptions, prepare_model, response_logprobs
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.graded import encode_batch
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.trainer import GRPOTrainer


def write_frames(folder, name: str, count: int, size=(64, 48)) -> list[str]:
    """`count` frame PNGs under folder/name, each a different colour and square; paths relative to folder."""
    (folder / name).mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        image = Image.new("RGB", size, (40 * i % 256, 90, 200 - 30 * i % 200))
        image.paste((255, 255, 255), (4 * i, 4, 4 * i + 12, 16))
        image.save(folder / name / f"{i}.png")
        out.append(f"{name}/{i}.png")
    return out


def write_mp4(path, frames: int = 8, fps: int = 4) -> bool:
    """A tiny mp4 written with PyAV; False where PyAV or a video reader for qwen-vl-utils is missing."""
    try:
        import av
        import decord  # noqa: F401  qwen-vl-utils' reader here (torchvision's was removed)
    except ImportError:
        return False
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = np.full((48, 64, 3), 30 * i, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return True


VIDEO_PROBLEMS = ["<video>How many frames show a white square?", "What colour comes last in <video>?"]


def video_rows(folder, count: int) -> list[dict]:
    """Source rows with one video each (a list of 3 to 5 frame paths under folder)."""
    return [{"images": [], "videos": [write_frames(folder, f"clip{i}", 3 + i % 3)], "problem": VIDEO_PROBLEMS[i % 2], "answer": str(i)}
            for i in range(count)]


def video_experiment(demo_base, folder, n_image: int = 4, n_video: int = 4, overrides=None) -> dict:
    """An experiment whose splits hold n_image demo image rows and n_video video rows, filtered."""
    source = pq.read_table(demo_base["data"]["train"]).slice(0, n_image).select(["images", "problem", "answer"])
    schema = source.schema.append(pa.field("videos", pa.list_(pa.list_(pa.string()))))
    images = [{**row, "videos": []} for row in source.to_pylist()]
    data = folder / "video.parquet"
    pq.write_table(pa.Table.from_pylist(images + video_rows(folder, n_video), schema=schema), data)
    cfg = make_experiment(demo_base, folder / "results",
                          config.deep_merge({"data": {"train": str(data), "val": str(data), "image_dir": str(folder)}}, overrides or {}))
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        stats = filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split), workers=1)
        assert stats["kinds"]["video"] == {"kept": n_video, "dropped": {}}
    return cfg


@pytest.fixture(scope="module")
def trainer(demo_base, tmp_path_factory):
    t = GRPOTrainer(video_experiment(demo_base, tmp_path_factory.mktemp("video")))
    t.load(0)
    return t


def rollout(engine, prompts, temperature, max_tokens=20):
    keys = torch.tensor([sample_key(1, 2, i) for i in range(len(prompts))])
    return engine.generate(prompts, keys, SamplingParams(temperature, 1.0, max_tokens), batch_size=len(prompts))


def easyr1_inputs(processor, problem: str, frames: list[str], cfg: dict):
    """EasyR1's rendering of a video row, step by step (RLHFDataset.__getitem__ with process_video)."""
    from qwen_vl_utils.vision_process import fetch_video

    content = format_prompt(problem, cfg["data"]["format_prompt"])  # the Jinja template with the problem as content
    parts = []
    for i, piece in enumerate(content.split("<video>")):
        if i:
            parts.append({"type": "video"})
        if piece:
            parts.append({"type": "text", "text": piece})
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    info = {"video": frames, "min_pixels": cfg["data"]["min_pixels"], "max_pixels": cfg["data"]["max_pixels"], "fps": cfg["data"]["video_fps"]}
    video, sample_fps = fetch_video(info, return_video_sample_fps=True)
    inputs = processor(videos=[video], text=[prompt], add_special_tokens=False, return_tensors="pt")
    return inputs, 2.0 / sample_fps


def test_video_prompt_ids_equal_easyr1s(trainer):
    """Same prompt tokens (the processor's video tokens for qwen-vl-utils' frames), grid and seconds per grid."""
    video_rows_ = [r for r in trainer.rows if r["videos"]]
    assert len(video_rows_) == 4
    folder = trainer.cfg["data"]["image_dir"]
    for row in video_rows_:
        frames = json.loads(row["videos"][0])["video"]
        assert all(f.startswith(folder) for f in frames)  # resolved under data.image_dir
        theirs, seconds = easyr1_inputs(trainer.processor, row["problem"], frames, trainer.cfg)
        ours = encode_prompts(trainer.processor, [row])
        assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
        assert torch.equal(ours["video_grid_thw"], theirs["video_grid_thw"])
        assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])
        assert ours["second_per_grid_ts"].tolist() == [seconds]
        assert (theirs["input_ids"] == trainer.processor.video_token_id).sum() > 0
    lengths = pq.read_table(paths.path(paths.FILTERED, config.experiment_dir(trainer.cfg), split="train"))["prompt_length"].to_pylist()
    for row, length in zip(trainer.rows, lengths, strict=True):  # the filter's count: the processor's tokens
        assert length == len(encode_prompts(trainer.processor, [row])["input_ids"][0])


def test_a_video_file_is_read_and_relative_to_image_dir(demo_base, tmp_path):
    if not write_mp4(tmp_path / "clip.mp4"):
        pytest.skip("no PyAV to write or decord to read an mp4 (pip install -e '.[video]')")
    (tmp_path / "broken.mp4").write_bytes(b"not a video" * 10)
    rows = [{"videos": ["clip.mp4"], "problem": "<video>What happens?", "answer": "1"},
            {"videos": ["broken.mp4"], "problem": "<video>And here?", "answer": "1"}]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_experiment(demo_base, tmp_path / "results", {"data": {"train": str(tmp_path / "v.jsonl"), "val": str(tmp_path / "v.jsonl"),
                                                                       "image_dir": str(tmp_path)}})
    out = tmp_path / "val.parquet"
    stats = filter_split(cfg, "val", out, tmp_path / "val.stats.json", workers=1)
    assert stats["kinds"]["video"] == {"kept": 1, "dropped": {"video_undecodable": 1}}
    row = load_filtered(out)[0]
    (video,) = fetch_videos([row])[0]
    assert video.frames.shape[0] == 4 and video.sample_fps == 2.0  # 2 s at 4 fps sampled at data.video_fps 2
    enc = encode_prompts(load_processor(cfg["model"]["path"]), [row])
    assert len(enc["input_ids"][0]) == pq.read_table(out)["prompt_length"][0].as_py()


def test_bad_video_rows_are_dropped_with_reasons(demo_base, tmp_path):
    good = write_frames(tmp_path, "good", 4)
    (tmp_path / "broken.png").write_bytes(b"not an image" * 10)
    Image.new("RGB", (112, 112), (10, 200, 30)).save(tmp_path / "picture.png")  # the demo's image size
    rows = [
        {"videos": [good], "problem": "<video>Fine?", "answer": "1"},
        {"videos": [good], "problem": "<video>Fine again?", "answer": "1"},
        {"videos": [good[:2] + ["missing.png"]], "problem": "<video>Where?", "answer": "1"},
        {"videos": [good[:2] + ["broken.png"]], "problem": "<video>Broken?", "answer": "1"},
        {"videos": [], "problem": "<video>Nothing?", "answer": "1"},
        {"videos": [good], "problem": "No placeholder", "answer": "1"},
        {"videos": [good], "problem": "<video><video>Two?", "answer": "1"},
        {"videos": [good], "images": ["picture.png"], "problem": "<image>Then <video>: both?", "answer": "1"},
    ]
    source = tmp_path / "bad.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_experiment(demo_base, tmp_path / "results", {"data": {"train": str(source), "val": str(source), "image_dir": str(tmp_path)}})
    stats = filter_split(cfg, "val", tmp_path / "val.parquet", tmp_path / "val.stats.json", workers=1)
    assert stats["dropped_rows"] == {"video_missing": [2, 4], "video_undecodable": [3], "no_video_placeholder": [5],
                                     "more_placeholders_than_videos": [6]}
    assert stats["kinds"]["video"] == {"kept": 3, "dropped": {"video_missing": 2, "video_undecodable": 1, "no_video_placeholder": 1,
                                                              "more_placeholders_than_videos": 1}}
    both = load_filtered(tmp_path / "val.parquet")[-1]  # an image and a video in one prompt
    assert both["index"] == 7 and len(both["images"]) == len(both["videos"]) == 1
    enc = encode_prompts(load_processor(cfg["model"]["path"]), [both])
    assert len(enc["input_ids"][0]) == pq.read_table(tmp_path / "val.parquet")["prompt_length"][-1].as_py()
    assert enc["image_grid_thw"].shape == enc["video_grid_thw"].shape == (1, 3)
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text(json.dumps(rows[3]) + "\n")
    cfg["data"]["val"] = str(only_bad)
    with pytest.raises(DataError, match=r"0 of 1 rows kept.*video_undecodable.*row 0 \(video_undecodable\)"):
        filter_split(cfg, "val", tmp_path / "v2.parquet", tmp_path / "v2.stats.json", workers=1)


def video_batch(trainer, n=2) -> PromptBatch:
    """image, video, image, video rows, each n times."""
    images = [r for r in trainer.rows if not r["videos"]]
    videos = [r for r in trainer.rows if r["videos"]]
    return encode_batch(trainer.processor, [images[0], videos[0], images[1], videos[1]], n, torch.device("cpu"))


def test_the_batch_carries_videos_by_row(trainer):
    prompts = video_batch(trainer)
    assert prompts.num_videos.tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and prompts.num_images.tolist() == [1, 1, 0, 0] * 2
    assert prompts.video_grid_thw.shape == (4, 3) and prompts.second_per_grid_ts.shape == (4,)
    sub = prompts.select([3, 6])
    ranges = prompts._patch_ranges(prompts.video_grid_thw, prompts.num_videos)
    assert torch.equal(sub.pixel_values_videos, torch.cat([prompts.pixel_values_videos[slice(*ranges[r])] for r in (3, 6)]))
    assert sub.pixel_values_videos is not None and sub.pixel_values is None and len(sub.videos) == 2
    assert prompts.select([0, 1]).pixel_values_videos is None and prompts.select([0]).num_videos is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_engine_gives_the_hf_tokens_on_a_video_batch(trainer, temperature):
    prompts = video_batch(trainer)
    static = make_engine("static", trainer.policy, trainer.processor)
    hf, fast = rollout(trainer.engine, prompts, temperature, 24), rollout(static, prompts, temperature, 24)
    assert torch.equal(fast.responses, hf.responses) and fast.texts == hf.texts
    assert (fast.logp - hf.logp).abs().max() < 1e-5


def test_fast_path_logprobs_equal_plain_on_a_video_batch(trainer):
    prompts = video_batch(trainer, n=3)
    out = rollout(trainer.engine, prompts, 1.0)
    assert out.response_mask.sum() > 50
    with torch.no_grad():
        plain = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7)
        fast = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7,
                                 ForwardOptions(prefix_sharing=True, logprobs_chunk_size=7))
        packed_model = copy.deepcopy(trainer.policy)
        cfg = {**trainer.cfg["model"], "packed_vision_attention": True, "fused_rms_norm": False, "aligned_vision_mlp": False,
               "fused_vision_rope": False, "cudnn_attention": False, "attn_implementation": "sdpa"}
        prepare_model(packed_model, cfg, torch.device("cpu"), trainable=False)
        packed = response_logprobs(packed_model, prompts, out.responses, out.response_mask, 0.7, ForwardOptions(prefix_sharing=True))
    assert (fast - plain).abs().max() < 1e-5, (fast - plain).abs().max()
    assert (packed - plain).abs().max() < 1e-5, (packed - plain).abs().max()
    mask = out.response_mask.bool()  # the log-probs of generation's own forward (temperature 1)
    with torch.no_grad():
        at_one = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0)
    assert torch.allclose(at_one[mask], out.logp[mask], atol=1e-5)


@pytest.mark.slow
def test_a_video_dataset_trains_two_steps_and_resumes_bitwise(demo_base, tmp_path):
    cfg = video_experiment(demo_base, tmp_path, overrides={"worker": {"rollout": {"n": 4}}})
    trains_two_steps_and_resumes_bitwise(cfg, "videos")

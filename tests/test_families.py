"""Every supported family (tiny random models on the real processors of ../shared/data): refusal of
the unsupported, prompts and image tokens as the family's processor makes them, log-probs of
generation equal to training's, fast paths equal to the plain ones where the family runs them, and
two GRPO steps with a checkpoint, a bitwise resume and validation."""

import json
import logging

import pytest
import torch
from PIL import Image

import families
from conftest import ROOT, SHARED, make_experiment, needs_shared
from vlgrpo import bench, config, models, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.checkpoint import CheckpointStore
from vlgrpo.config import ConfigError
from vlgrpo.data.filtering import filter_split
from vlgrpo.data.images import image_factor, image_tokens, processor_pixel_bounds, resize_image
from vlgrpo.data.prompts import count_prompt_tokens, encode_prompts, render_prompt
from vlgrpo.data.sources import load_processor
from vlgrpo.tracking import read_metrics
from vlgrpo.trainer import GRPOTrainer, run_segment

TRAINED = ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"]
EXPERIMENT = {  # small steps: 2 prompts x 2 samples, 8 response tokens
    "data": {"max_prompt_length": 1024, "max_response_length": 8},
    "worker": {"actor": {"global_batch_size": 2}, "rollout": {"n": 2, "batch_size": 2}},
    "trainer": {"max_steps": 2, "save_freq": 2, "val_freq": 2, "val_before_train": False},
}


def test_unsupported_family_or_missing_model_type_stops_at_parse_time(tmp_path):
    demo = config.load(ROOT / "config.yaml")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ConfigError, match="'model.path'.*model_type 'gemma3' is not supported; vlgrpo trains these "
                                          "families: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5"):
        config.validate(config.deep_merge(demo, {"model": {"path": str(tmp_path)}}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ConfigError, match="has no model_type; vlgrpo trains these families: qwen2_vl"):
        config.validate(config.deep_merge(demo, {"model": {"path": str(tmp_path)}}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))  # text-only families train
    assert config.validate(config.deep_merge(demo, {"model": {"path": str(tmp_path)}}))["model"]["path"] == str(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}))
    with pytest.raises(ConfigError, match="sets use_sliding_window \\(a window of 4096 tokens\\).*attend to the whole sequence"):
        config.validate(config.deep_merge(demo, {"model": {"path": str(tmp_path)}}))


def test_auto_turns_off_what_a_family_cannot_run_and_explicit_true_is_refused(caplog):
    demo = config.load(ROOT / "config.yaml")
    qwen3_5, qwen2_5 = models.family("qwen3_5"), models.family("qwen2_5_vl")
    with caplog.at_level(logging.INFO, logger="vlgrpo.models"):
        cuda = config.for_device(demo, "cuda", qwen3_5)
    assert cuda["worker"]["rollout"]["engine"] == "hf"
    assert cuda["worker"]["actor"]["prefix_sharing"] is False
    assert cuda["model"]["packed_vision_attention"] is False and cuda["model"]["fused_rms_norm"] is False
    assert cuda["worker"]["actor"]["logprobs_chunk_size"] == 4096  # served by every family
    assert "worker.rollout.engine: hf for Qwen3.5 (qwen3_5): its Gated DeltaNet layers" in caplog.text
    assert config.for_device(demo, "cuda", qwen2_5) == config.for_device(demo, "cuda")
    static = config.deep_merge(demo, {"worker": {"rollout": {"engine": "static"}}})
    with pytest.raises(ConfigError, match="'worker.rollout.engine' is 'static', which Qwen3.5 .qwen3_5. cannot run"):
        config.for_device(static, "cpu", qwen3_5)
    packed = config.deep_merge(demo, {"model": {"packed_vision_attention": True}})
    with pytest.raises(ConfigError, match="'model.packed_vision_attention' is True, which Qwen3-VL"):
        config.for_device(packed, "cuda", models.family("qwen3_vl"))


@needs_shared("qwen2_vl_2b", "qwen2_5_vl_7b", "qwen3_vl_4b", "qwen3_5_0_8b")
@pytest.mark.parametrize("folder,tokens", [("qwen2_vl_2b", 391), ("qwen2_5_vl_7b", 391), ("qwen3_vl_4b", 300),
                                           ("qwen3_5_0_8b", 300)])
def test_prompt_and_image_tokens_as_the_family_processor_makes_them(folder, tokens):
    processor = load_processor(str(SHARED / folder))
    image = resize_image(Image.new("RGB", (640, 480), "white"), 262144, 524288, processor_pixel_bounds(processor),
                         image_factor(processor))
    assert image.size == (640, 480) if tokens == 300 else image.size == (644, 476)
    assert image_tokens(image, image_factor(processor)) == tokens
    prompt = render_prompt(processor, "<image>Find x.", "r1v")
    full = processor(text=[prompt], images=[image], add_special_tokens=False)
    assert count_prompt_tokens(processor, prompt, [image]) == len(full["input_ids"][0])
    assert full["input_ids"][0].count(processor.image_token_id) == tokens
    if folder == "qwen3_5_0_8b":  # its template opens the answer with an empty think block unless told
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert prompt.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module", params=TRAINED)
def family_experiment(request, demo_base, tmp_path_factory):
    """An experiment on the tiny `param` model with the demo's data filtered by its processor."""
    model_type = request.param
    if not (SHARED / families.FOLDERS[model_type]).exists():
        pytest.skip(f"shared data absent: {families.FOLDERS[model_type]}")
    root = tmp_path_factory.mktemp(model_type)
    folder = families.build(model_type, root / "model")
    cfg = make_experiment(demo_base, root / "results", config.deep_merge(EXPERIMENT, {"model": {"path": str(folder)}}))
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split))
    return model_type, cfg


@pytest.fixture(scope="module")
def family_trainer(family_experiment):
    model_type, cfg = family_experiment
    t = GRPOTrainer(cfg)
    t.load(0)
    return model_type, t


def _prompts(trainer, count=2, n=2):
    rows = []
    for i, row in enumerate(trainer.rows[:count]):
        problem = row["problem"] + " Look closely." * (2 * i)  # different lengths: left padding differs
        rows.append({**row, "problem": problem, "prompt": render_prompt(trainer.processor, problem, "r1v")})
    return PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [1] * count).repeat_interleave(n)


def test_generation_logprobs_equal_training_and_fast_paths_equal_plain(family_trainer):
    model_type, trainer = family_trainer
    families.check_logprobs_and_engines(trainer, model_type, _prompts(trainer))


@pytest.mark.slow
def test_two_steps_checkpoint_bitwise_resume_and_validation(family_experiment, tmp_path):
    model_type, base = family_experiment
    straight = make_experiment(base, tmp_path / "straight")
    run_segment(straight, 2, paths.path(paths.MARKER, config.experiment_dir(straight), step=2))
    halves = make_experiment(base, tmp_path / "halves", {"trainer": {"save_freq": 1}})
    for end in (1, 2):  # a checkpoint at step 1, then a resume from it
        run_segment(halves, end, paths.path(paths.MARKER, config.experiment_dir(halves), step=end))
    assert CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(halves))).latest() == 2
    records = [[families.deterministic(r) for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(c)))]
               for c in (straight, halves)]
    assert [r["step"] for r in records[0]] == [1, 2] and records[1] == records[0]
    a, b = families.checkpoint_weights(straight, 2), families.checkpoint_weights(halves, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model_type
    validated = json.loads(paths.path(paths.VAL_IN_PROCESS, config.experiment_dir(straight), step=2).read_text())
    assert validated["step"] == 2 and 0 <= validated["val/accuracy_reward"] <= 1


@pytest.mark.parametrize("model_type", TRAINED)
def test_bench_builds_random_weights_of_each_family_from_a_config_folder(model_type, tmp_path):
    if not (SHARED / families.FOLDERS[model_type]).exists():
        pytest.skip(f"shared data absent: {families.FOLDERS[model_type]}")
    folder = families.build(model_type, tmp_path / "model", weights=False)
    cfg = config.load(ROOT / "config.yaml", overrides={"model": {"path": str(folder)}})
    model, weights = bench.base_model(cfg, torch.device("cpu"))
    assert weights == "random" and model.config.model_type == model_type
    assert models.family_of_model(model).vision and models.vision_tower(model) is not None
    assert models.text_model(model).config.hidden_size == families.HIDDEN
    again, _ = bench.base_model(cfg, torch.device("cpu"))  # seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_video_prompts_through_generation_logprobs_and_fast_paths(family_trainer, tmp_path):
    """A video row beside an image row, encoded by the family's processor (its rope index with video
    grids, Qwen3's timestamps): generation's log-probs are training's, the fast paths the plain path's,
    static greedy hf's."""
    from test_video import VIDEO_PROBLEMS, write_frames
    from vlgrpo.data.videos import video_spec
    from vlgrpo.rollout.graded import encode_batch

    model_type, trainer = family_trainer
    data = trainer.cfg["data"]
    video = {"problem": VIDEO_PROBLEMS[0], "answer": "1", "images": [], "prompt": render_prompt(trainer.processor, VIDEO_PROBLEMS[0], "r1v"),
             "videos": [video_spec(write_frames(tmp_path, "clip", 4), str(tmp_path), data["min_pixels"], data["max_pixels"], data["video_fps"])]}
    prompts = encode_batch(trainer.processor, [trainer.rows[0], video], 2, torch.device("cpu"))
    assert prompts.num_videos.tolist() == [0, 0, 1, 1]
    assert (prompts.input_ids == trainer.processor.video_token_id).sum() == 2 * prompts.video_grid_thw[0].prod() // 4
    families.check_logprobs_and_engines(trainer, model_type, prompts)

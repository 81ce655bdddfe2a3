"""Text-only and image rows in one batch (tiny demo model, float32, CPU): generation, log-probs, their
fast paths and whole training steps handle rows without pixels."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import make_experiment
from vlgrpo import config, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.data.filtering import filter_split
from vlgrpo.data.prompts import encode_prompts, render_prompt
from vlgrpo.policy import ForwardOptions, response_logprobs
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.trainer import GRPOTrainer

def deterministic(record):
    """A step's metrics without wall-clock figures."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


TEXT_PROBLEMS = ["How many sides does a triangle have?", "A square has 4 corners. How many corners do 2 squares have? Count them."]


@pytest.fixture(scope="module")
def trainer(demo_base, tmp_path_factory):
    t = GRPOTrainer(make_experiment(demo_base, tmp_path_factory.mktemp("mixed")))
    t.load(0)
    return t


def mixed_rows(trainer) -> list[dict]:
    """image, text, image, text rows of different lengths."""
    text = [{"problem": p, "answer": "3", "images": [], "prompt": render_prompt(trainer.processor, p, "r1v")} for p in TEXT_PROBLEMS]
    return [trainer.rows[0], text[0], trainer.rows[1], text[1]]


def encode(trainer, rows, n=2) -> PromptBatch:
    return PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [len(r["images"]) for r in rows]).repeat_interleave(n)


def rollout(engine, prompts, temperature, max_tokens=20):
    keys = torch.tensor([sample_key(1, 2, i) for i in range(len(prompts))])
    return engine.generate(prompts, keys, SamplingParams(temperature, 1.0, max_tokens), batch_size=len(prompts))


def test_a_text_row_is_the_same_alone_in_a_text_batch_and_beside_images(trainer):
    """Rope positions of a text-only row start at its first token however it is batched (as EasyR1,
    which encodes each row alone): same samples, same log-probs."""
    rows = mixed_rows(trainer)
    mixed = encode(trainer, rows, n=1)
    assert mixed.num_images.tolist() == [1, 0, 1, 0] and mixed.image_grid_thw.shape == (2, 3)
    text_only = encode(trainer, [rows[1], rows[3]], n=1)
    assert text_only.pixel_values is None and text_only.image_grid_thw.shape == (0, 3)
    assert mixed.select([1, 3]).pixel_values is None
    out = rollout(trainer.engine, mixed, 1.0)
    with torch.no_grad():
        in_mixed = response_logprobs(trainer.policy, mixed, out.responses, out.response_mask, 1.0)
        by_itself = response_logprobs(trainer.policy, mixed.select([3]), out.responses[[3]], out.response_mask[[3]], 1.0)
    mask = out.response_mask.bool()
    assert torch.allclose(in_mixed[mask], out.logp[mask], atol=1e-5)
    assert torch.allclose(by_itself[0][mask[3]], out.logp[3][mask[3]], atol=1e-5)
    # The text rows' samples (keys 1 and 3 in the mixed batch) do not depend on the images beside them.
    keys = torch.tensor([sample_key(1, 2, i) for i in (1, 3)])
    same_keys = trainer.engine.generate(text_only, keys, SamplingParams(1.0, 1.0, 20), batch_size=2)
    assert torch.equal(same_keys.responses, out.responses[[1, 3]])


def test_fast_path_logprobs_equal_plain_on_a_mixed_batch(trainer):
    prompts = encode(trainer, mixed_rows(trainer), n=3)
    out = rollout(trainer.engine, prompts, 1.0)
    assert out.response_mask.sum() > 50
    fast_options = ForwardOptions(prefix_sharing=True, logprobs_chunk_size=7)
    with torch.no_grad():
        plain = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7)
        fast = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7, fast_options)
        # a micro-batch of text rows only, as dynamic batching may make one
        text_rows = [3, 4, 5, 9, 10, 11]
        sub = prompts.select(text_rows)
        fast_text = response_logprobs(trainer.policy, sub, out.responses[text_rows], out.response_mask[text_rows], 0.7, fast_options)
    assert (fast - plain).abs().max() < 1e-5, (fast - plain).abs().max()
    assert (fast_text - plain[text_rows]).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_engine_gives_the_hf_tokens_on_a_mixed_batch(trainer, temperature):
    prompts = encode(trainer, mixed_rows(trainer), n=2)
    static = make_engine("static", trainer.policy, trainer.processor)
    hf, fast = rollout(trainer.engine, prompts, temperature, 24), rollout(static, prompts, temperature, 24)
    assert torch.equal(fast.responses, hf.responses) and fast.texts == hf.texts
    assert (fast.logp - hf.logp).abs().max() < 1e-5
    text_only = prompts.select([2, 3, 6, 7])
    assert torch.equal(rollout(static, text_only, temperature, 24).responses, rollout(trainer.engine, text_only, temperature, 24).responses)


def mixed_experiment(demo_base, folder, overrides=None) -> dict:
    """An experiment whose train and val splits are 8 demo image rows and 8 text-only rows, filtered."""
    source = pq.read_table(demo_base["data"]["train"]).slice(0, 8).select(["images", "problem", "answer"])
    text = [{"images": [], "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    mixed = folder / "mixed.parquet"
    pq.write_table(pa.concat_tables([source, pa.Table.from_pylist(text, schema=source.schema)]), mixed)
    cfg = make_experiment(demo_base, folder / "results", {"data": {"train": str(mixed), "val": str(mixed)}, **(overrides or {})})
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        stats = filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split), workers=1)
    assert stats["kinds"] == {"image": {"kept": 8, "dropped": {}}, "video": {"kept": 0, "dropped": {}}, "text": {"kept": 8, "dropped": {}}}
    return cfg


@pytest.mark.slow
def test_a_mixed_dataset_trains_two_steps_and_resumes_bitwise(demo_base, tmp_path):
    cfg = mixed_experiment(demo_base, tmp_path, {"worker": {"rollout": {"n": 4}}})
    trains_two_steps_and_resumes_bitwise(cfg, "images")


def trains_two_steps_and_resumes_bitwise(cfg: dict, column: str) -> None:
    """Two steps whose batches together hold rows with and without `column` (images, videos), then a
    run stopped after step 1 and resumed: the same metrics and bitwise the same weights."""
    straight = GRPOTrainer(cfg)
    straight.load(0)
    kinds = {bool(straight.rows[i][column]) for step in (1, 2) for i in straight.batch_indices(step)}
    assert kinds == {True, False}
    records = [straight.step(1), straight.step(2)]
    assert all(r["response_length/mean"] > 0 for r in records)
    first = GRPOTrainer(cfg)
    first.load(0)
    assert deterministic(first.step(1)) == deterministic(records[0])
    first.save(1, "run").result()
    resumed = GRPOTrainer(cfg)
    resumed.load(1)
    assert deterministic(resumed.step(2)) == deterministic(records[1])
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_data_shuffle_and_seed_set_the_train_order():
    """data.shuffle: a seeded permutation per epoch, else file order; data.seed overrides the seed."""

    def order(top_seed=1, **data):
        t = object.__new__(GRPOTrainer)  # batch_indices reads only these
        t.cfg = config.validate({"experiment": "order", "seed": top_seed, "model": {"path": "m"},
                                 "data": {"train": "t.parquet", "val": "v.parquet", **data},
                                 "worker": {"rollout": {"batch_size": 4}, "actor": {"global_batch_size": 4}}})
        t.rows, t.batch_size, t.steps_per_epoch = [None] * 12, 4, 3
        return [t.batch_indices(step) for step in range(1, 7)]

    assert order(shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2
    shuffled = order()
    assert sorted(sum(shuffled[:3], [])) == list(range(12)) and shuffled[:3] != shuffled[3:]  # a new order each epoch
    assert order(top_seed=7, seed=1) == shuffled and order(top_seed=2) != shuffled

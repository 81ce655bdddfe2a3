"""Speed-ups that must give the same results: pixel values made on the model's device, parallel
grading, the int32 noise hash."""

from dataclasses import replace

import torch
from vlgrpo import config, paths, rewards
from vlgrpo.batch import PromptBatch, to_device
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.data.sources import load_processor
from vlgrpo.rewards import Grading, score_responses, load_reward_function, start_workers


def demo_prompts(cfg: dict, device=None) -> PromptBatch:
    """Three validation prompts of the demo experiment, their pixel values encoded on `device`."""
    rows = load_filtered(paths.path(paths.FILTERED, config.experiment_dir(cfg), split="val"))[:3]
    processor = load_processor(cfg["model"]["path"])
    return PromptBatch.from_processor(encode_prompts(processor, rows, device), [len(r["images"]) for r in rows])


def test_prompt_batch_works_on_pixel_values_where_they_are(demo_base):
    host, on_device = demo_prompts(demo_base), demo_prompts(demo_base, "cpu")
    views = (lambda b: b, lambda b: b.select([2, 0, 0]), lambda b: b.repeat_interleave(2),
             lambda b: b.repeat_interleave(2).to("cpu", torch.float64))
    for view in views:  # device="cpu" encodes the same tensors, and every batch operation keeps them equal
        a, b = view(host), view(on_device)
        for name in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "num_images"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    # Pixel values off the host (meta: no data, so any copy to the host would raise) stay there
    # through select, repeat_interleave and to (which casts them on their device).
    meta = replace(host, pixel_values=host.pixel_values.to("meta"))
    for a, b in ((meta.select([2, 0, 0]), host.select([2, 0, 0])), (meta.repeat_interleave(2), host.repeat_interleave(2))):
        assert a.pixel_values.device.type == "meta" and a.pixel_values.shape == b.pixel_values.shape
        assert a.input_ids.device.type == "cpu" and torch.equal(a.input_ids, b.input_ids)
    moved = meta.repeat_interleave(2).to("meta", torch.bfloat16)
    assert moved.pixel_values.device.type == "meta" and moved.pixel_values.dtype == torch.bfloat16


def test_to_device_pins_host_tensors_only(monkeypatch):
    calls = []

    def pin_memory(self):
        calls.append(("pin", self.device.type))
        return self

    def to(self, target, non_blocking=False):
        calls.append(("to", str(target), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    cuda = torch.device("cuda")
    to_device(torch.zeros(4), cuda)  # from the host: pinned, then queued without waiting
    assert calls == [("pin", "cpu"), ("to", "cuda", True)]
    calls.clear()
    to_device(torch.zeros(4, device="meta"), cuda)  # already off the host (pixel values made on a GPU): no pin_memory
    assert calls == [("to", "cuda", False)]
    calls.clear()
    to_device(torch.zeros(4), torch.device("cpu"))
    assert calls == [("to", "cpu", False)]


def test_parallel_grading_on_started_workers():
    start_workers(2)  # spawned before any grading asks for them
    assert len(rewards._pool(2)._processes) == 2
    fn = load_reward_function("r1v", 0.5)
    texts = ["<think>x</think> <answer>3</answer>", "3", "no", "<answer>4</answer>"] * 5
    truths = ["3", "3", "4", "4"] * 5
    assert Grading(fn, texts, truths, workers=2).result() == score_responses(fn, texts, truths)


def test_int32_noise_is_the_int64_noise_bit_for_bit():
    from vlgrpo.rollout import sampling as S

    def int64_noise(keys, position, vocab):  # the previous implementation
        row = S._mix32(keys.to(torch.int64) * 31 + position * S._M3)[:, None]
        tok = S._mix32(torch.arange(vocab, dtype=torch.int64) + S._M1)[None, :]
        return S.unit_interval(S._mix32(row ^ tok))

    keys = torch.randint(0, 2**32, (16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    for position in (0, 1, 511, torch.tensor([7]), 2**31 + 5):
        assert torch.equal(S.uniform_noise(keys, position, 5000), int64_noise(keys, position, 5000))


def test_noise_stays_inside_the_open_unit_interval_at_the_extreme_hashes():
    from vlgrpo.rollout import sampling as S

    extremes = torch.tensor([0, 1, 2**23 - 1, 2**31 - 1, -(2**31), -1], dtype=torch.int32)  # -1: all 32 bits set
    for h in (extremes, extremes.to(torch.int64) & 0xFFFFFFFF):
        u = S.unit_interval(h)
        assert bool(((u > 0) & (u < 1)).all()), u
        assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())
    assert float(S.unit_interval(torch.tensor([-1], dtype=torch.int32))) == 1 - 0.5 / 2**23

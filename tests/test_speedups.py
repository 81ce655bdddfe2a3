"""Speed-ups that must give the same results: parallel encode and grading, the int32 noise hash."""

import torch
from conftest import make_experiment
from vlgrpo.data import encode_prompts, load_processor, load_filtered
from vlgrpo.evaluate import encode_in_parallel
from vlgrpo.rewards import Grading, score_responses, load_reward_function
from vlgrpo.trainer import GRPOTrainer

def test_parallel_encode_and_grading(demo_base, tmp_path):
    t = GRPOTrainer(make_experiment(demo_base, tmp_path))
    rows = t.rows[:9]
    a = encode_prompts(t.processor, rows)
    b = encode_in_parallel(t.processor, rows, workers=3)
    assert set(a.keys()) == set(b.keys())
    for k in a.keys():
        assert torch.equal(a[k], b[k]), k
    fn = load_reward_function("r1v", 0.5)
    texts = ["<think>x</think> <answer>3</answer>", "3", "no", "<answer>4</answer>"] * 5
    truths = ["3", "3", "4", "4"] * 5
    assert Grading(fn, texts, truths, workers=2).result() == score_responses(fn, texts, truths)


def test_int32_noise_is_the_int64_noise_bit_for_bit():
    from vlgrpo.rollout import sampling as S

    def int64_noise(keys, position, vocab):  # the previous implementation
        row = S._mix32(keys.to(torch.int64) * 31 + position * S._M3)[:, None]
        tok = S._mix32(torch.arange(vocab, dtype=torch.int64) + S._M1)[None, :]
        return ((S._mix32(row ^ tok) >> 8).to(torch.float32) + 0.5) / float(1 << 24)

    keys = torch.randint(0, 2**32, (16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    for position in (0, 1, 511, torch.tensor([7]), 2**31 + 5):
        assert torch.equal(S.uniform_noise(keys, position, 5000), int64_noise(keys, position, 5000))

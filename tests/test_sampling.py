import math

import pytest
import torch

from vlgrpo.rollout.sampling import keyed_sample, sample_key, top_k_mask, top_p_mask, uniform_noise


def test_sample_key_is_a_pure_function_of_its_parts():
    assert sample_key(1, 5, 17, 3) == sample_key(1, 5, 17, 3)
    keys = {sample_key(1, step, prompt, sample) for step in range(4) for prompt in range(8) for sample in range(4)}
    assert len(keys) == 4 * 8 * 4  # no collisions among nearby tuples
    assert all(0 <= k < 2**32 for k in keys)


def test_noise_depends_only_on_key_position_and_token():
    keys = torch.tensor([sample_key(1, 1, i, 0) for i in range(6)])
    full = uniform_noise(keys, 3, 50)
    alone = uniform_noise(keys[4:5], 3, 50)
    assert torch.equal(full[4:5], alone)  # batch composition does not matter
    assert not torch.equal(uniform_noise(keys, 4, 50), full)  # positions differ
    assert full.min() > 0 and full.max() < 1


def test_noise_is_uniform():
    keys = torch.tensor([sample_key(7, i) for i in range(200)])
    u = uniform_noise(keys, 0, 1000).flatten()
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002


def test_keyed_sampling_matches_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.7
    n = 20000
    keys = torch.tensor([sample_key(3, i) for i in range(n)])
    tokens, logp = keyed_sample(logits.expand(n, 4), keys, 0, temperature, 1.0)
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = (logits[0] / temperature).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.01)
    assert torch.allclose(logp, expected.log()[tokens], atol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = top_p_mask(logits, 0.7)
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    masked = top_p_mask(logits, 0.1)
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]
    keys = torch.tensor([sample_key(0, i) for i in range(2000)])
    tokens, _ = keyed_sample(logits.expand(2000, 4), keys, 0, 1.0, 0.7)
    assert set(tokens.tolist()) == {0, 1}


def _top_p_by_scatter(logits, top_p):
    """The nucleus by sorted position (ties split by sort order), scattered back to the vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs > top_p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.95, 0.999])
def test_top_p_threshold_equals_the_sorted_nucleus(top_p):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 1000, generator=generator) * torch.linspace(0.1, 8.0, 64)[:, None]  # flat to peaked
    logits[:, :10] = float("-inf")  # banned tokens
    assert torch.equal(top_p_mask(logits, top_p), _top_p_by_scatter(logits, top_p))


def test_top_p_on_bf16_logits_gives_the_float32_nucleus():
    """keyed_sample finds the nucleus on the model's bf16 logits: the tokens of the float32 nucleus."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(32, 2000, generator=generator) * torch.linspace(0.5, 6.0, 32)[:, None]).bfloat16()
    keys = torch.tensor([sample_key(5, i) for i in range(32)])
    for top_p in (0.3, 0.9):
        tokens, logp = keyed_sample(logits, keys, 4, 0.6, top_p)
        expected, expected_logp = keyed_sample(logits.float(), keys, 4, 0.6, top_p)
        assert torch.equal(tokens, expected) and torch.equal(logp, expected_logp)
        scaled = logits.float() / 0.6
        kept = torch.isfinite(top_p_mask(scaled, top_p))
        assert kept.gather(-1, tokens[:, None]).all()


def test_top_p_keeps_every_token_tied_at_the_edge():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert torch.isfinite(top_p_mask(logits, 0.5)).tolist() == [[True, True, True, True]]
    assert torch.isfinite(top_p_mask(logits, 0.3)).tolist() == [[True, False, False, False]]


def test_banned_tokens_are_never_sampled_but_logp_is_of_the_full_distribution():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    banned = torch.tensor([True, False, False])
    keys = torch.tensor([sample_key(0, i) for i in range(500)])
    tokens, logp = keyed_sample(logits.expand(500, 3), keys, 0, 1.0, 1.0, banned)
    assert (tokens != 0).all()
    assert torch.allclose(logp, logits.log_softmax(-1)[0, 1].expand(500))
    greedy, _ = keyed_sample(logits, keys[:1], 0, 0.0, 1.0, banned)
    assert greedy.item() in (1, 2)


def test_greedy_is_argmax():
    logits = torch.randn(5, 11)
    tokens, logp = keyed_sample(logits, torch.zeros(5, dtype=torch.long), 0, 0.0, 1.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logp, logits.log_softmax(-1).max(-1).values)
    assert math.isclose(float(logp.exp().sum()), float(logits.softmax(-1).max(-1).values.sum()), rel_tol=1e-6)


def test_top_k_keeps_the_k_most_likely_then_top_p_on_their_renormalised_mass():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.isfinite(top_k_mask(logits, 2)).tolist() == [[True, True, False, False]]
    assert torch.equal(top_k_mask(logits, -1), logits) and torch.equal(top_k_mask(logits, 4), logits)
    n = 20000
    keys = torch.tensor([sample_key(5, i) for i in range(n)])
    tokens, logp = keyed_sample(logits.expand(n, 4), keys, 0, 1.0, 1.0, top_k=3)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]), atol=0.01)  # 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9
    assert torch.allclose(logp, logits[0].log_softmax(-1)[tokens])  # log-probs of the full distribution, as training
    # top_p 0.75 after top_k 2 acts on (4/7, 3/7): {0, 1}; on the full distribution it keeps {0, 1, 2} (mass 0.7 before 2)
    tokens, _ = keyed_sample(logits.expand(n, 4), keys, 0, 1.0, 0.75, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = keyed_sample(logits.expand(n, 4), keys, 0, 1.0, 0.75)
    assert set(tokens.tolist()) == {0, 1, 2}
    # greedy ignores it; the same keys give the same tokens whatever the batch
    assert keyed_sample(logits, keys[:1], 0, 0.0, 1.0, top_k=2)[0].item() == 0
    alone, _ = keyed_sample(logits.expand(3, 4)[1:2], keys[1:2], 0, 1.0, 1.0, top_k=3)
    assert alone.item() == keyed_sample(logits.expand(3, 4), keys[:3], 0, 1.0, 1.0, top_k=3)[0][1].item()


def test_responses_are_decoded_as_worker_reward_skip_special_tokens_says():
    """EasyR1's skip_special_tokens: the texts the reward function grades keep special tokens when false."""
    from vlgrpo.rollout.hf import finish_rollout

    class Tokenizer:  # id 9 is a special token (<|im_end|>, the EOS here)
        def batch_decode(self, rows, skip_special_tokens):
            return [" ".join("<|im_end|>" if t == 9 else str(t) for t in row if not (skip_special_tokens and t == 9)) for row in rows]

    responses = torch.tensor([[5, 6, 9, 7], [8, 8, 8, 8]])
    kept = finish_rollout(responses, torch.zeros(2, 4), [9], 0, Tokenizer(), False, skip_special_tokens=False)
    skipped = finish_rollout(responses, torch.zeros(2, 4), [9], 0, Tokenizer(), False)
    assert kept.texts == ["5 6 <|im_end|>", "8 8 8 8"] and skipped.texts == ["5 6", "8 8 8 8"]
    assert kept.truncated.tolist() == [False, True] and kept.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]

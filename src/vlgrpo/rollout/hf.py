"""Rollout engine on transformers' `generate` (batched, left padding, KV cache), CPU or GPU.

generate runs greedy decoding over logits that a processor has already turned into a one-hot
choice made by keyed sampling (rollout.sampling), so the randomness of each sample is its own,
and the processor records the log-prob of every chosen token on the way.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from vlgrpo import models
from vlgrpo.batch import PromptBatch
from vlgrpo.rollout import Rollout, SamplingParams
from vlgrpo.rollout.sampling import keyed_sample

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


class _KeyedSampler(LogitsProcessor):
    def __init__(self, keys, prompt_len, params: SamplingParams, banned, progress):
        self.keys, self.prompt_len, self.params, self.banned = keys, prompt_len, params, banned
        self.logps: list[torch.Tensor] = []
        self.progress = progress

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_len
        tokens, logp = keyed_sample(
            scores, self.keys, position, self.params.temperature, self.params.top_p, self.banned, self.params.top_k
        )
        self.logps.append(logp)
        self.progress.update(1)
        choice = torch.full_like(scores, float("-inf"))
        return choice.scatter_(1, tokens[:, None], 0.0)


def eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and the model's generation_config ones."""
    eos = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    eos.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return sorted(i for i in eos if i is not None)


def banned_tokens(tokenizer, vocab: int) -> torch.Tensor:
    """(vocab,) bool: tokens never sampled, the vision placeholders and embedding rows with no token behind them."""
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[len(tokenizer) :] = True
    for tok in VISION_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            banned[tid] = True
    return banned


def finish_rollout(responses, logp, eos: list[int], pad_id: int, tokenizer, ignore_eos: bool, skip_special_tokens: bool = True) -> Rollout:
    """A Rollout from (N, R) sampled ids and their log-probs: mask up to and including the first EOS,
    pad after it, truncation flags, texts decoded (special tokens skipped unless skip_special_tokens is false)."""
    is_eos = torch.isin(responses, torch.tensor(eos, device=responses.device))
    if ignore_eos:
        is_eos = torch.zeros_like(is_eos)
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    mask = (~after_eos).long()
    responses = responses.masked_fill(after_eos, pad_id)
    truncated = ~is_eos.any(-1)
    texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, mask)], skip_special_tokens=skip_special_tokens)
    return Rollout(responses.cpu(), mask.cpu(), (logp * mask).cpu(), texts, truncated.cpu())


class HFEngine:
    def __init__(self, model, processor):
        self.model, self.tokenizer = model, models.tokenizer(processor)
        self.eos_ids = eos_ids(model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        self.banned = banned_tokens(self.tokenizer, model.get_output_embeddings().weight.shape[0])

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, keys: torch.Tensor, params: SamplingParams, batch_size: int, progress=False
    ) -> Rollout:
        """Sample one response per row of `prompts` (N rows), `batch_size` rows per generate call."""
        device = self.model.device
        chunks = []
        for start in range(0, len(prompts), batch_size):
            rows = list(range(start, min(start + batch_size, len(prompts))))
            sub = prompts.select(rows).to(device, self.model.dtype)
            chunks.append(self._generate(sub, keys[rows].to(device), params, progress))
        responses = torch.cat([c[0] for c in chunks])
        logp = torch.cat([c[1] for c in chunks])
        return finish_rollout(responses, logp, self.eos_ids, self.pad_id, self.tokenizer, params.ignore_eos, params.skip_special_tokens)

    def _generate(self, sub: PromptBatch, keys, params: SamplingParams, progress):
        prompt_len = sub.input_ids.shape[1]
        config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens if params.ignore_eos else 0,
            do_sample=False,
            eos_token_id=None if params.ignore_eos else self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
            # generate fills unset options from the model's generation_config.json (Qwen2.5-VL's sets
            # repetition_penalty 1.05): the sampler must see the raw logits the training forward sees.
            repetition_penalty=1.0,
        )
        with tqdm(total=params.max_tokens, desc="generate", leave=False, disable=not progress) as bar:
            sampler = _KeyedSampler(keys, prompt_len, params, self.banned.to(keys.device), bar)
            out = self.model.generate(
                **sub.model_inputs(), generation_config=config, logits_processor=LogitsProcessorList([sampler])
            )
        responses = out[:, prompt_len:]
        logp = torch.stack(sampler.logps, dim=1)  # (n, R') one column per decode step
        pad = params.max_tokens - responses.shape[1]
        responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_id)
        logp = torch.nn.functional.pad(logp, (0, pad))
        return responses, logp

"""Rollout engines: given prompts with images, produce n samples each.

An engine takes a PromptBatch (already repeated n times per prompt) and one 32-bit key per row,
and returns a Rollout. Keys come from sampling.sample_key(seed, step, prompt index, sample index),
so each sample is reproducible on its own. `hf` (transformers generate) is the engine here; a vLLM
engine implements the same `generate` signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 = greedy
    top_p: float
    max_tokens: int
    ignore_eos: bool = False  # benchmarks: every response exactly max_tokens long


@dataclass
class Rollout:
    responses: torch.Tensor  # (N, R) token ids, pad after the end
    response_mask: torch.Tensor  # (N, R) 1 up to and including EOS
    logp: torch.Tensor  # (N, R) log-prob of each sampled token under softmax(logits / T)
    texts: list[str]  # decoded responses, special tokens skipped
    truncated: torch.Tensor  # (N,) bool: hit max_tokens without EOS

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)


def make_engine(name: str, model, processor):
    """The rollout engine named by worker.rollout.engine."""
    if name == "hf":
        from vlgrpo.rollout.hf import HFEngine

        return HFEngine(model, processor)
    raise ValueError(f"rollout engine {name!r} is not available here (engines: hf)")

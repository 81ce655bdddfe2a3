"""Rollout engines: given prompts with images, produce n samples each.

An engine takes a PromptBatch (already repeated n times per prompt) and one 32-bit key per row,
and returns a Rollout. Keys come from sampling.sample_key(seed, step, prompt index, sample index),
so each sample is reproducible on its own. Engines: `hf` (transformers generate) and `static`
(static KV cache, decode step replayed as a CUDA graph; same tokens); a vLLM engine implements the
same `generate` signature.
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


def make_engine(name: str, model, processor, cuda_graph: bool = True):
    """The rollout engine named by worker.rollout.engine (cuda_graph: worker.rollout.cuda_graph, static only)."""
    if name == "hf":
        from vlgrpo.rollout.hf import HFEngine

        return HFEngine(model, processor)
    if name == "static":
        from vlgrpo.rollout.static import StaticEngine

        return StaticEngine(model, processor, cuda_graph)
    raise ValueError(f"rollout engine {name!r} is not available here (engines: hf, static)")

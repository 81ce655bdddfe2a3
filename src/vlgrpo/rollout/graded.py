"""The rollout-and-score path that training and validation share: encode the prompts, generate n
samples of each with their own keys, and start grading them.

Training keys sample j of prompt row r by sample_key(seed, step, r["index"], j); validation by
sample_key(seed, VAL_STREAM, r["index"], j), the same at every step. Grading runs in worker
processes while the caller goes on (the trainer computes old and ref log-probs meanwhile).
"""

from __future__ import annotations

import time

import torch

from vlgrpo.batch import PromptBatch
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.rewards import Grading
from vlgrpo.rollout import Rollout, SamplingParams
from vlgrpo.rollout.sampling import sample_key


def generate_and_grade(
    engine, processor, rows: list[dict], n: int, key_prefix: tuple[int, ...], params: SamplingParams,
    batch_size: int, reward_fn, device: torch.device, progress: bool = False,
) -> tuple[PromptBatch, Rollout, Grading, dict]:
    """Samples of `rows` (filtered rows with images, answer and index), n each, and their grading.

    Returns prompts (N = len(rows) * n rows, each prompt repeated n times in a row), the Rollout (N rows),
    the started Grading (its result() gives the N scores and the error count) and the seconds spent
    encoding, generating and starting the grading.
    """
    start = time.perf_counter()
    enc = encode_prompts(processor, rows, device)  # pixels made on the model's device: no host copies on a GPU
    prompts = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows], [r["images"] for r in rows]).repeat_interleave(n)
    keys = torch.tensor([sample_key(*key_prefix, r["index"], j) for r in rows for j in range(n)])
    encoded = time.perf_counter()
    out = engine.generate(prompts, keys, params, batch_size=batch_size, progress=progress)
    generated = time.perf_counter()
    grading = Grading(reward_fn, out.texts, [r["answer"] for r in rows for _ in range(n)], lengths=out.lengths.tolist())
    timing = {"encode": encoded - start, "generation": generated - encoded, "grading": time.perf_counter() - generated}
    return prompts, out, grading, timing

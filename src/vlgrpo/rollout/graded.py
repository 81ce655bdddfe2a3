"""The rollout-and-score path that training and validation share: encode the prompts, generate n
samples of each with their own keys, and start grading them.

Training keys sample j of prompt row r by sample_key(seed, step, r["index"], j); validation by
sample_key(seed, VAL_STREAM, r["index"], j), the same at every step. Grading runs in worker
processes while the caller goes on (the trainer computes old and ref log-probs meanwhile).

With several ranks (vlgrpo.distributed), each rank generates and grades its contiguous share of the
prompts and the results are gathered: every rank gets the whole batch, the same rows the 1-process
path gives, since each sample's randomness is its own key.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from vlgrpo import distributed, models
from vlgrpo.batch import PromptBatch
from vlgrpo.data.prompts import encode_prompts, fetch_videos
from vlgrpo.errors import VlgrpoError
from vlgrpo.rewards import Grading
from vlgrpo.rollout import Rollout, SamplingParams
from vlgrpo.rollout.sampling import sample_key


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of `parts` in order, each part's columns padded to the widest (pad_id after the responses)."""
    width = max(p.responses.shape[1] for p in parts)

    def cat(name, value):
        return torch.cat([F.pad(getattr(p, name), (0, width - getattr(p, name).shape[1]), value=value) for p in parts])

    return Rollout(cat("responses", pad_id), cat("response_mask", 0), cat("logp", 0.0),
                   [t for p in parts for t in p.texts], torch.cat([p.truncated for p in parts]))


def select_rollout(out: Rollout, rows: list[int]) -> Rollout:
    """The given rows of a Rollout, in that order."""
    index = torch.tensor(rows, dtype=torch.long)
    return Rollout(out.responses[index], out.response_mask[index], out.logp[index], [out.texts[i] for i in rows],
                   out.truncated[index])


def encode_batch(processor, rows: list[dict], n: int, device: torch.device) -> PromptBatch:
    """The PromptBatch of `rows`, each prompt repeated n times in a row (len(rows) * n rows)."""
    videos = fetch_videos(rows)  # kept in the batch for engines that process them themselves (vllm)
    enc = encode_prompts(processor, rows, device, videos)  # pixels made on the model's device: no host copies on a GPU
    return PromptBatch.from_processor(enc, [len(r["images"]) for r in rows], [r["images"] for r in rows],
                                      [len(v) for v in videos], videos, vision=models.takes_images(processor)).repeat_interleave(n)


class Graded:
    """Grading already done (a batch assembled from several tries): result() as Grading's."""

    def __init__(self, scores: list[dict[str, float]], errors: int):
        self.scores, self.errors = scores, errors

    def result(self) -> tuple[list[dict[str, float]], int]:
        return self.scores, self.errors


class GatheredGrading:
    """The whole batch's grading from each rank's share: result() gathers scores in rank order and
    sums the error counts; a rank whose grading failed fails every rank (none waits forever)."""

    def __init__(self, local: Grading):
        self.local = local

    def result(self) -> tuple[list[dict[str, float]], int]:
        try:
            mine = (self.local.result(), None)
        except Exception as e:  # noqa: BLE001 re-raised below, after every rank has heard of it
            mine, error = (None, f"rank {distributed.rank()}: {e}"), e
        parts = distributed.gather_objects(mine)
        if mine[1] is not None:
            raise error
        failed = [message for _, message in parts if message is not None]
        if failed:
            raise VlgrpoError(f"grading failed on another rank ({failed[0]})")
        return [s for (scores, _), _ in parts for s in scores], sum(errors for (_, errors), _ in parts)


def generate_and_grade(
    engine, processor, rows: list[dict], n: int, key_prefix: tuple[int, ...], params: SamplingParams,
    batch_size: int, reward_fn, device: torch.device, progress: bool = False,
) -> tuple[PromptBatch, Rollout, Grading | GatheredGrading, dict]:
    """Samples of `rows` (filtered rows with images, answer and index), n each, and their grading.

    Returns prompts (N = len(rows) * n rows, each prompt repeated n times in a row), the Rollout (N rows),
    the started Grading (its result() gives the N scores and the error count) and the seconds spent
    encoding, generating and starting the grading. Several ranks: each generates and grades its share
    of the rows (batch_size rows per generate call), the rollout is gathered, result() gathers the scores.
    """
    start = time.perf_counter()
    prompts = encode_batch(processor, rows, n, device)
    keys = torch.tensor([sample_key(*key_prefix, r["index"], j) for r in rows for j in range(n)])
    answers = [r["answer"] for r in rows for _ in range(n)]
    encoded = time.perf_counter()
    model = getattr(engine, "model", None)  # gathered while it generates, if sharded (FSDP2)
    if distributed.world() == 1:
        with distributed.gathered(model):
            out = engine.generate(prompts, keys, params, batch_size=batch_size, progress=progress)
        generated = time.perf_counter()
        grading = Grading(reward_fn, out.texts, answers, lengths=out.lengths.tolist())
    else:  # every rank encoded the whole batch (same padding as one process), generates its share
        mine = [p * n + j for p in distributed.share(len(rows)) for j in range(n)]
        with distributed.gathered(model):
            local = engine.generate(prompts.select(mine), keys[mine], params, batch_size=batch_size, progress=progress)
        out = concat_rollouts(distributed.gather_objects(local), models.tokenizer(processor).pad_token_id)
        generated = time.perf_counter()
        grading = GatheredGrading(Grading(reward_fn, local.texts, [answers[i] for i in mine], lengths=local.lengths.tolist()))
    timing = {"encode": encoded - start, "generation": generated - encoded, "grading": time.perf_counter() - generated}
    return prompts, out, grading, timing

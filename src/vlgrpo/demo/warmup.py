"""The demo model's supervised warm-up: teach the language and the output format, not the answer.

A random model never writes a parseable answer, so GRPO would get reward 0 everywhere and learn
nothing. The warm-up trains on prompts rendered and encoded exactly as training does, each with a
synthetic response (responses.py) whose triangle count is random with respect to the image and
which is well formatted only a fraction of the time. After it the model writes the format
sometimes and answers at chance; the rest is left to GRPO.

The loss is the token-mean negative log-likelihood of response tokens (including the final
<|im_end|>), computed by the same forward the trainer's log-probs use (policy.response_logprobs).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vlgrpo.batch import PromptBatch
from vlgrpo.data import encode_prompts
from vlgrpo.demo.processor import EOS_TOKEN
from vlgrpo.demo.responses import warmup_response
from vlgrpo.policy import response_logprobs

LOSS_WINDOW = 10  # steps averaged for the reported final loss


def encode_responses(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of each text + <|im_end|>, right-padded: (responses (B, R), mask (B, R))."""
    ids = [tokenizer(text + EOS_TOKEN, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(row) for row in ids)
    responses = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        responses[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return responses, mask


def fit(optimizer: torch.optim.Optimizer, steps: int, next_loss) -> dict:
    """`steps` optimizer steps on next_loss() with the lr decaying linearly to 0; the loss summary.

    The decay lets the last steps average over many batches, so what the model settles on reflects
    the whole target distribution instead of echoing the last few batches.
    """
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        loss = next_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return {"loss_first": losses[0], "loss_final": float(np.mean(losses[-LOSS_WINDOW:])), "seconds": round(time.perf_counter() - start, 3)}


def warm_up(model, processor, rows: list[dict], demo: dict, template: str, rng: np.random.Generator) -> dict:
    """Train `model` in place for demo["warmup_steps"] AdamW steps (lr decaying linearly from
    demo["warmup_lr"] to 0); return the loss curve's summary.

    rows: prompts as encode_prompts takes them ({"prompt", "images"}); each step draws
    demo["warmup_batch_size"] of them at random, each with a fresh random response in the format of
    `template` (r1v or math).
    """
    steps, batch_size = demo["warmup_steps"], demo["warmup_batch_size"]
    stats = {"steps": steps, "batch_size": batch_size, "lr": demo["warmup_lr"], "loss_first": None, "loss_final": None, "seconds": 0.0}
    if steps == 0:
        return stats
    prompts = PromptBatch.from_processor(encode_prompts(processor, rows), [len(r["images"]) for r in rows])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=demo["warmup_lr"])
    model.train()

    def next_loss() -> torch.Tensor:
        picked = rng.choice(len(rows), size=batch_size, replace=True)
        texts = [warmup_response(rng, template, demo["warmup_format_fraction"]) for _ in picked]
        responses, mask = encode_responses(processor.tokenizer, texts)
        logp = response_logprobs(model, prompts.select(picked.tolist()), responses, mask, temperature=1.0)
        return -(logp.sum() / mask.sum())

    stats.update(fit(optimizer, steps, next_loss))
    model.eval()
    return stats

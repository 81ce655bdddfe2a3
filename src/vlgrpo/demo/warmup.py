"""The demo model's supervised warm-up: teach the language and the output format, not the answer.

A random model never writes a parseable answer, so GRPO would get reward 0 everywhere and learn
nothing. The warm-up trains on prompts rendered and encoded exactly as training does, each with a
synthetic response (responses.py) whose triangle count is random with respect to the image and
which is well formatted only a fraction of the time. After it the model writes the format
sometimes and answers at chance; the rest is left to GRPO.

The loss is the token-mean negative log-likelihood of response tokens (including the final
<|im_end|>), computed by the same forward the trainer's log-probs use (policy.response_logprobs),
plus a grounding term: at every response position a throwaway linear head must read the image's
region colours (perception.region_targets, standardised) from the language model's final hidden
state. Text targets that ignore the image let the picture fade to a faint direction of the hidden
state, which GRPO's answer could not pick up (without the term, greedy accuracy stayed at chance
for 75 GRPO steps in three settings; with it, it rose within 25); the term keeps the picture in
view, as a pretrained VLM's language model does, without a question, count or answer.
"""

from __future__ import annotations

import numpy as np
import torch

from vlgrpo.batch import PromptBatch
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.demo.fit import fit
from vlgrpo.demo.perception import region_targets
from vlgrpo.demo.processor import EOS_TOKEN
from vlgrpo.demo.responses import warmup_response
from vlgrpo.policy import response_logprobs


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


def grounding_targets(rows: list[dict]) -> torch.Tensor:
    """(rows, tokens * 6): each row's image's region_targets, flattened, standardised over the rows."""
    targets = torch.stack([region_targets(row["images"][0]).flatten() for row in rows])
    return (targets - targets.mean(0)) / (targets.std(0) + 1e-6)


def warm_up(model, processor, rows: list[dict], demo: dict, template: str, rng: np.random.Generator) -> dict:
    """Train `model` in place for demo["warmup_steps"] AdamW steps (lr decaying linearly from
    demo["warmup_lr"] to 0); return the loss curve's summary.

    rows: prompts as encode_prompts takes them ({"prompt", "images"}, one image each); each step
    draws demo["warmup_batch_size"] of them at random, each with a fresh random response in the
    format of `template` (r1v or math). Loss: NLL + demo["warmup_grounding_coef"] x grounding MSE.
    """
    steps, batch_size = demo["warmup_steps"], demo["warmup_batch_size"]
    stats = {"steps": steps, "batch_size": batch_size, "lr": demo["warmup_lr"], "loss_first": None, "loss_final": None, "seconds": 0.0}
    if steps == 0:
        return stats
    prompts = PromptBatch.from_processor(encode_prompts(processor, rows), [len(r["images"]) for r in rows])
    targets = grounding_targets(rows)  # (rows, T)
    head = torch.nn.Linear(model.config.text_config.hidden_size, targets.shape[1])
    trained = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(trained, lr=demo["warmup_lr"])
    # The hidden states come from response_logprobs' own forward: its final norm's output.
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.language_model.norm.register_forward_hook(lambda module, args, out: captured.update(hidden=out))
    model.train()

    def next_loss() -> torch.Tensor:
        picked = rng.choice(len(rows), size=batch_size, replace=True)
        texts = [warmup_response(rng, template, demo["warmup_format_fraction"]) for _ in picked]
        responses, mask = encode_responses(processor.tokenizer, texts)
        logp = response_logprobs(model, prompts.select(picked.tolist()), responses, mask, temperature=1.0)
        hidden = captured["hidden"][:, -(responses.shape[1] + 1) : -1]  # (B, R, H): the positions predicting responses
        grounding = ((head(hidden) - targets[picked][:, None]) ** 2).mean(-1)  # (B, R)
        return -(logp.sum() / mask.sum()) + demo["warmup_grounding_coef"] * (grounding * mask).sum() / mask.sum()

    try:
        stats.update(fit(optimizer, steps, next_loss))
    finally:
        hook.remove()
    model.eval()
    return stats

"""Loading the policy and computing log-probs of responses the way training does.

The log-prob forward runs the model's own forward over prompt + response with the prompt's
attention mask, image inputs and mm_token_type_ids (zeros over the response), so Qwen2.5-VL computes
the same 3-D rope positions that generation used, and divides the logits by the sampling temperature
as EasyR1/verl do.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from vlgrpo.batch import PromptBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is 'cuda' but no CUDA device is visible")
    return torch.device(name)


def load_model(path: str | os.PathLike, model_cfg: dict, device: torch.device, trainable: bool):
    """A Qwen2.5-VL-style model from a hub id or folder (also a checkpoint's model/ folder)."""
    model = AutoModelForImageTextToText.from_pretrained(
        str(path),
        dtype=DTYPES[model_cfg["dtype"]],
        attn_implementation=model_cfg["attn_implementation"],
        trust_remote_code=model_cfg["trust_remote_code"],
    ).to(device)
    model.eval()
    if trainable:
        if model_cfg["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
    else:
        model.requires_grad_(False)
    return model


def is_model_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "config.json").is_file()


def response_logprobs(
    model,
    prompts: PromptBatch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the response tokens under softmax(logits / temperature).

    prompts: N rows (left-padded, P columns); responses, response_mask: (N, R).
    Returns logp (N, R) float32, zero where the mask is 0. Only the last R + 1 positions go through
    the LM head.
    """
    device, full_width = model.device, responses.shape[1]
    width = int(response_mask.sum(-1).max())  # trailing all-padding columns are not computed
    responses, response_mask = responses[:, :width].to(device), response_mask[:, :width].to(device)
    inputs = prompts.to(device, model.dtype).model_inputs()
    inputs["input_ids"] = torch.cat([inputs["input_ids"], responses], dim=1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], response_mask], dim=1)
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(responses, dtype=inputs["mm_token_type_ids"].dtype)], dim=1
        )
    logits = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :-1]  # (N, R, V)
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    logp = logits.log_softmax(dim=-1).gather(-1, responses[..., None]).squeeze(-1) * response_mask
    return torch.nn.functional.pad(logp, (0, full_width - width))

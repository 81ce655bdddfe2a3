"""Validation of one checkpoint (or of the base model: step 0, the baseline).

Generates on the filtered validation split with worker.rollout.val_override_config (temperature 0 =
greedy; n > 1 gives mean scores and pass@n), scores with the training reward function, and writes
val/step_XXXXXX.json (EasyR1 metric names plus `samples`: the same val_generations_to_log items at
every step, chosen by the seed) and val/step_XXXXXX.generations.jsonl (every response with its score).
The sampling noise of item i is keyed by (seed, item, sample) only, the same at every step, so the
difference between two checkpoints is not sampling luck.
Launch: `vlgrpo evaluate --config results/<exp>/config.resolved.yaml --step N`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from vlgrpo import config as config_lib
from vlgrpo import paths, plan
from vlgrpo.batch import PromptBatch
from vlgrpo.checkpoint import CheckpointStore, apply_retention, write_json_atomic
from vlgrpo.data import encode_prompts, load_filtered, load_processor
from vlgrpo.policy import load_model, resolve_device
from vlgrpo.rewards import Grading, load_reward_function, start_workers
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.sampling import sample_key

VAL_STREAM = 0x5A17  # keeps validation keys apart from training keys (seed, step, ...)


def logged_items(seed: int, n_rows: int, count: int) -> list[int]:
    """Positions of the validation rows shown at every step: a fixed, seeded choice."""
    generator = torch.Generator().manual_seed(sample_key(seed, VAL_STREAM))
    return sorted(torch.randperm(n_rows, generator=generator)[:count].tolist())


def _length_stats(prefix: str, lengths: torch.Tensor, limit: int) -> dict:
    lengths = lengths.float()
    return {
        f"{prefix}/mean": lengths.mean().item(),
        f"{prefix}/max": lengths.max().item(),
        f"{prefix}/min": lengths.min().item(),
        f"{prefix}/clip_ratio": (lengths == limit).float().mean().item(),
    }


def model_path_for(cfg: dict, step: int) -> str:
    """The base model for step 0, else the model folder of checkpoint `step`."""
    if step == 0:
        return cfg["model"]["path"]
    folder = CheckpointStore(paths.path(paths.CHECKPOINTS, config_lib.experiment_dir(cfg))).model_dir(step)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"no model weights for step {step} at {folder}: the checkpoint was never written or its "
            f"weights were removed after validation (trainer.keep_validated_weights: false)"
        )
    return str(folder)


def evaluate(cfg: dict, step: int, model=None) -> dict:
    """Validate step `step`; write its JSON and JSONL; return the record.

    model: an in-memory model to validate instead of loading step's (the benchmark's random weights).
    """
    start = time.perf_counter()
    start_workers()  # the grading processes spawn and import while the model loads and generates
    exp = config_lib.experiment_dir(cfg)
    data, val = cfg["data"], cfg["worker"]["rollout"]["val_override_config"]
    device = resolve_device(cfg["trainer"]["device"])
    processor = load_processor(cfg["model"]["path"], data["min_pixels"], data["max_pixels"])
    if model is None:
        model = load_model(model_path_for(cfg, step), cfg["model"], device, trainable=False)
    rollout = cfg["worker"]["rollout"]
    engine = make_engine(rollout["engine"], model, processor, rollout["cuda_graph"], cfg)
    reward = cfg["worker"]["reward"]
    reward_fn = load_reward_function(reward["reward_function"], reward["format_weight"])
    rows = load_filtered(paths.path(paths.FILTERED, exp, split="val"))

    n = val["n"]
    encode_start = time.perf_counter()
    enc = encode_prompts(processor, rows, device)  # pixel values made on the model's device: no host copy of them
    prompts = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows], [r["images"] for r in rows]).repeat_interleave(n)
    keys = torch.tensor([sample_key(cfg["seed"], VAL_STREAM, r["index"], j) for r in rows for j in range(n)])
    params = SamplingParams(val["temperature"], val["top_p"], data["max_response_length"])
    batch = data["val_batch_size"] if data["val_batch_size"] > 0 else len(prompts)
    gen_start = time.perf_counter()
    out = engine.generate(prompts, keys, params, batch_size=batch, progress=True)
    score_start = time.perf_counter()
    answers = [r["answer"] for r in rows for _ in range(n)]
    scores, errors = Grading(reward_fn, out.texts, answers).result()  # on several CPU cores where there are
    timing = {"encode": gen_start - encode_start, "generation": score_start - gen_start,
              "scoring": time.perf_counter() - score_start}

    def mean(key):
        return sum(s[key] for s in scores) / len(scores)

    accuracy = torch.tensor([s["accuracy"] for s in scores]).view(len(rows), n)
    record = {
        "step": step,
        "val/overall_reward": mean("overall"),
        "val/format_reward": mean("format"),
        "val/accuracy_reward": mean("accuracy"),
        "val/reward_score": mean("overall"),
        f"val/pass@{n}": (accuracy >= 1.0).any(dim=1).float().mean().item(),
        "val/reward_errors": errors,
        **_length_stats("val_response_length", out.lengths, data["max_response_length"]),
        **_length_stats("val_prompt_length", prompts.attention_mask.sum(-1), data["max_prompt_length"]),
        "val/tokens_per_s": float(out.lengths.sum()) / timing["generation"],
        **{f"timing_s/{k}": v for k, v in timing.items()},
    }
    record["samples"] = [
        {
            "index": rows[i]["index"],
            "problem": rows[i]["problem"],
            "ground_truth": rows[i]["answer"],
            "response": out.texts[i * n],
            **scores[i * n],
        }
        for i in logged_items(cfg["seed"], len(rows), cfg["trainer"]["val_generations_to_log"])
    ]
    record["timing_s/validation"] = time.perf_counter() - start

    generations = paths.path(paths.GENERATIONS, exp, step=step)
    generations.parent.mkdir(parents=True, exist_ok=True)
    tmp = generations.with_name(f".{generations.name}.tmp")
    with open(tmp, "w") as f:
        for k, text in enumerate(out.texts):
            row = rows[k // n]
            line = {"index": row["index"], "sample": k % n, "ground_truth": row["answer"], "response": text,
                    "length": int(out.lengths[k]), "truncated": bool(out.truncated[k]), **scores[k]}
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, generations)
    write_json_atomic(paths.path(paths.VAL, exp, step=step), record)
    return record


def prune_after_validation(cfg: dict, step: int) -> None:
    """Weights of a validated checkpoint that is no longer among the newest ones can go now."""
    if step:
        stats = json.loads(paths.path(paths.STATS, config_lib.experiment_dir(cfg), split="train").read_text())
        apply_retention(cfg, plan.total_steps(cfg, stats["steps_per_epoch"]))


def main(config_path: str | Path, step: int) -> dict:
    cfg = config_lib.read_resolved(config_path)
    record = evaluate(cfg, step)
    prune_after_validation(cfg, step)
    return record

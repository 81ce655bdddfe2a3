"""Validation of one checkpoint (or of the base model: step 0, the baseline).

Generates on the filtered validation split with worker.rollout.val_override_config (temperature 0 =
greedy; n > 1 gives mean scores and pass@n), scores with the training reward function, and writes
val/step_XXXXXX.json (EasyR1 metric names plus `samples`: the same val_generations_to_log items at
every step, chosen by the seed) and val/step_XXXXXX.generations.jsonl (every response with its score);
the metrics also go into metrics.jsonl as the step's validation record (and W&B, when configured).
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
from vlgrpo import metrics, paths, plan
from vlgrpo.checkpoint import CheckpointStore, apply_retention, write_json_atomic
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.sources import load_processor
from vlgrpo.policy import load_model, resolve_device
from vlgrpo.rewards import reward_from_config, start_workers
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.graded import generate_and_grade
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.tracking import SAMPLES, Tracker

VAL_STREAM = 0x5A17  # keeps validation keys apart from training keys (seed, step, ...)


def logged_items(seed: int, n_rows: int, count: int) -> list[int]:
    """Positions of the validation rows shown at every step: a fixed, seeded choice."""
    generator = torch.Generator().manual_seed(sample_key(seed, VAL_STREAM))
    return sorted(torch.randperm(n_rows, generator=generator)[:count].tolist())


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
    cfg = config_lib.for_device(cfg, device)
    processor = load_processor(cfg["model"]["path"])
    rows = load_filtered(paths.path(paths.FILTERED, exp, split="val"))
    reward_fn = reward_from_config(cfg, [r["answer"] for r in rows[:8]])  # stops here if it breaks the contract
    if model is None:
        model = load_model(model_path_for(cfg, step), cfg["model"], device, trainable=False)
    rollout = cfg["worker"]["rollout"]
    engine = make_engine(rollout["engine"], model, processor, rollout["cuda_graph"])

    n = val["n"]
    params = SamplingParams(val["temperature"], val["top_p"], data["max_response_length"])
    batch = data["val_batch_size"] if data["val_batch_size"] > 0 else len(rows) * n
    prompts, out, grading, timing = generate_and_grade(
        engine, processor, rows, n, (cfg["seed"], VAL_STREAM), params, batch, reward_fn, device, progress=True
    )
    score_start = time.perf_counter()
    scores, errors = grading.result()  # on several CPU cores where there are
    timing = {"encode": timing["encode"], "generation": timing["generation"],
              "scoring": timing.pop("grading") + time.perf_counter() - score_start}

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
        **metrics.length_metrics("val_response_length", out.lengths, data["max_response_length"]),
        **metrics.length_metrics("val_prompt_length", prompts.attention_mask.sum(-1), data["max_prompt_length"]),
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


def log_validation(cfg: dict, record: dict, tracker: Tracker | None = None) -> None:
    """Log a validation result as the validated step's "val" record, in metrics.jsonl and the
    experiment's W&B run (through `tracker` when the caller holds one open, else a job-own one)."""
    own = tracker is None
    tracker = tracker or Tracker(cfg, config_lib.experiment_dir(cfg))
    tracker.log({k: v for k, v in record.items() if k != SAMPLES}, kind="val")
    if own:
        tracker.close()


def main(config_path: str | Path, step: int) -> dict:
    cfg = config_lib.read_resolved(config_path)
    record = evaluate(cfg, step)
    log_validation(cfg, record)
    prune_after_validation(cfg, step)
    return record

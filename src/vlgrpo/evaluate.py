"""Validation of one checkpoint (or of the base model: step 0, the baseline).

Generates on the filtered validation split with worker.rollout.val_override_config (temperature 0 =
greedy; n > 1 gives mean scores and pass@n), scores with the training reward function, and writes
val/step_XXXXXX.json (EasyR1 metric names plus `samples`: the same val_generations_to_log items at
every step, chosen by the seed) and val/step_XXXXXX.generations.jsonl (every response with its score);
the metrics also go into metrics.jsonl as the step's validation record (and W&B, when configured).
The sampling noise of item i is keyed by (seed, item, sample) only, the same at every step, so the
difference between two checkpoints is not sampling luck.
A training segment validates its own checkpoint in-process (evaluate(..., in_process=True)); the
evaluate rule then adopts that result instead of validating again (val_results).
Launch: `vlgrpo evaluate --config results/<exp>/config.resolved.yaml --step N`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from vlgrpo import config as config_lib
from vlgrpo import atomic, distributed, lora, metrics, models, paths, val_results
from vlgrpo.checkpoint import CheckpointStore
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.sources import load_processor
from vlgrpo.policy import load_model, resolve_device
from vlgrpo.rewards import reward_file_digest, reward_from_config, start_workers
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.graded import generate_and_grade
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.tracking import SAMPLES, Tracker

VAL_STREAM = 0x5A17  # keeps validation keys apart from training keys (seed, step, ...)


def logged_items(seed: int, n_rows: int, count: int) -> list[int]:
    """Positions of the validation rows shown at every step: a fixed, seeded choice."""
    generator = torch.Generator().manual_seed(sample_key(seed, VAL_STREAM))
    return sorted(torch.randperm(n_rows, generator=generator)[:count].tolist())


def checkpoint_model_dir(cfg: dict, step: int) -> Path:
    return CheckpointStore(paths.path(paths.CHECKPOINTS, config_lib.experiment_dir(cfg))).model_dir(step)


def model_path_for(cfg: dict, step: int) -> str:
    """The base model for step 0, else the model folder of checkpoint `step`."""
    if step == 0:
        return cfg["model"]["path"]
    folder = checkpoint_model_dir(cfg, step)
    if not (folder / "config.json").is_file() and not lora.is_adapter_folder(folder):
        raise FileNotFoundError(
            f"no model weights for step {step} at {folder}: the checkpoint was never written or its "
            f"weights were removed after validation (trainer.keep_validated_weights: false)"
        )
    return str(folder)


def evaluate(cfg: dict, step: int, model=None, engine=None, in_process: bool = False) -> dict:
    """Validate step `step`; write its JSON and JSONL; return the record.

    model: an in-memory model to validate instead of loading step's (the trainer's policy, the
    benchmark's random weights); engine: a rollout engine of that model to generate with (the
    trainer's: a vLLM engine holds its own weights and KV cache, a second one would double them).
    in_process: write the result aside for the evaluate rule to adopt.
    Called by every rank of a distributed segment: each generates for its share of the items
    (generate_and_grade), rank 0 writes.
    `cfg` is the config as the resolved file holds it: the result is keyed on it (val_results.eval_key),
    before its `auto` switches are set for this device.
    """
    start = time.perf_counter()
    key = val_results.eval_key(cfg)
    start_workers()  # the grading processes spawn and import while the model loads and generates
    exp = config_lib.experiment_dir(cfg)
    data, val = cfg["data"], cfg["worker"]["rollout"]["val_override_config"]
    device = model.device if model is not None else resolve_device(cfg["trainer"]["device"])  # a rank: its own GPU
    cfg = config_lib.for_device(cfg, device, models.family_of(cfg["model"]["path"]))
    processor = load_processor(cfg["model"]["path"])
    rows = load_filtered(paths.path(paths.FILTERED, exp, split="val"))
    reward_fn = reward_from_config(cfg, [r["answer"] for r in rows[:8]])  # stops here if it breaks the contract
    if model is None:
        folder = model_path_for(cfg, step)
        model = lora.load_with_adapters(Path(folder), cfg["model"], device) if step and lora.is_adapter_folder(Path(folder)) \
            else load_model(folder, cfg["model"], device, trainable=False)
    rollout = cfg["worker"]["rollout"]
    engine = engine or make_engine(rollout["engine"], model, processor, rollout["cuda_graph"], cfg)

    n = val["n"]
    top_k = rollout["top_k"] if val["top_k"] is None else val["top_k"]  # EasyR1 overrides only the keys given
    params = SamplingParams(val["temperature"], val["top_p"], data["max_response_length"], top_k=top_k,
                            skip_special_tokens=cfg["worker"]["reward"]["skip_special_tokens"])
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

    pass_at = {}  # vlgrpo's own metric, where the reward gives an accuracy
    if "accuracy" in scores[0]:
        accuracy = torch.tensor([s["accuracy"] for s in scores]).view(len(rows), n)
        pass_at[f"val/pass@{n}"] = (accuracy >= 1.0).any(dim=1).float().mean().item()
    record = {
        "step": step,
        **{f"val/{k}_reward": mean(k) for k in scores[0]},  # every key the reward returns, as EasyR1
        "val/reward_score": mean("overall"),
        "val/reward_errors": errors,
        **pass_at,
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

    record["eval_key"] = key
    record["reward_sha256"] = reward_file_digest(cfg["worker"]["reward"]["reward_function"])  # a later run tells a change
    record["validated_in_process"] = in_process

    lines = []
    for k, text in enumerate(out.texts):
        row = rows[k // n]
        line = {"index": row["index"], "sample": k % n, "ground_truth": row["answer"], "response": text,
                "length": int(out.lengths[k]), "truncated": bool(out.truncated[k]), **scores[k]}
        lines.append(json.dumps(line) + "\n")
    generations, val = (paths.GENERATIONS_IN_PROCESS, paths.VAL_IN_PROCESS) if in_process else (paths.GENERATIONS, paths.VAL)
    if distributed.is_rank0():  # every rank validated its share of the items; the gathered result is written once
        atomic.write_lines(paths.path(generations, exp, step=step), lines)  # the record last: it says the pair is complete
        atomic.write_json(paths.path(val, exp, step=step), record)
    return record


def log_validation(cfg: dict, record: dict, tracker: Tracker | None = None) -> None:
    """Log a validation result as the validated step's "val" record, in metrics.jsonl and the
    experiment's W&B run (through `tracker` when the caller holds one open, else a job-own one)."""
    own = tracker is None
    tracker = tracker or Tracker(cfg, config_lib.experiment_dir(cfg))
    tracker.log({k: v for k, v in record.items() if k != SAMPLES and isinstance(v, (int, float))}, kind="val")
    if own:
        tracker.close()


def main(config_path: str | Path, step: int) -> dict:
    """The evaluate rule: adopt the segment's own validation of `step` if it has one; else, when the
    step's weights are gone, put its kept result back; else validate. The result is kept (val_results)."""
    cfg = config_lib.read_resolved(config_path)
    record = val_results.adopt(cfg, step)
    if record is None and step and not (checkpoint_model_dir(cfg, step) / "config.json").is_file():
        record = val_results.put_back(cfg, step)  # its weights are gone: it cannot be validated again
    if record is None:
        record = evaluate(cfg, step)
    val_results.keep(cfg, step)
    log_validation(cfg, record)
    return record

"""GRPO step benchmark: the production GRPOTrainer.step, optimized and plain, in one process.

    vlgrpo bench --config configs/bench_h200.yaml --out benchmarks/results/bench_h200.json

The config is an experiment config (configs/bench_*.yaml: rollout 32 x 4, every response exactly
max_response_length tokens, 2 mini-batch updates). The model folder's weights are used if it holds
any, else random ones (seeded) in model.dtype, built on the device from its config.json. Filtered
splits are made with data.filter_split where missing. In order, on the same weights:
  1. --warmup then --steps steps of GRPOTrainer.step with the config as given (the optimized path);
     with --profile, one more step under torch.profiler, not counted in the measured ones;
  2. greedy decoding of a few prompts by the config's engine and by the hf engine (same tokens?);
  3. the validation of the whole validation split (601 items on Geometry3K's test split) as a
     segment's in-process one runs (GRPOTrainer.validate: the reference model and gradients freed,
     the trainer's engine); with --profile, a second one under torch.profiler;
  4. --plain-steps steps of the plain path (the config with --plain on top: configs/plain.yaml turns
     every fast path off), starting at the first measured step so that both paths see the same prompts.
A profile is a table of each phase's wall time against its GPU kernel time (how host-bound the
phase is) and its top kernels, beside the JSON: <out>.profile.txt for the step, <out>.eval.profile.txt
for the validation's prefill and decode. Prints one table and writes the JSON. Step FLOPs are what a
step needs (step_flops), so MFU is comparable between the paths.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import platform
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from vlgrpo import config as config_lib
from vlgrpo import distributed, metrics, models, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.data.filtering import filter_split, load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.policy import DTYPES, load_model, resolve_device
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.trainer import GRPOTrainer

log = logging.getLogger("vlgrpo.bench")

PHASES = ("gen", "reward", "old", "ref", "adv", "update_actor")
EVAL_PHASES = ("prefill", "vision", "decode")  # record_function ranges: the static engine's, the vision tower's within prefill
TARGETS = {"step_s": 15.0, "eval_s": 30.0}  # issue 7, on one H200 (printed for H200 runs only)


def base_model(cfg: dict, device: torch.device):
    """(model, 'loaded' | 'random'): the folder's weights, or random ones from its config (any
    supported family: models.model_class builds it)."""
    folder = Path(cfg["model"]["path"])
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        resolved = config_lib.for_device(cfg, device, models.family_of(folder))
        return load_model(folder, resolved["model"], device, trainable=True), "loaded"
    torch.manual_seed(cfg["seed"])
    with torch.device(device):
        model = models.model_class(models.family_of(folder)).from_config(
            AutoConfig.from_pretrained(folder), dtype=DTYPES[cfg["model"]["dtype"]],
            attn_implementation=cfg["model"]["attn_implementation"],
        )
    return model, "random"


def ensure_filtered(cfg: dict) -> None:
    exp = config_lib.experiment_dir(cfg)
    for split in ("train", "val"):
        out = paths.path(paths.FILTERED, exp, split=split)
        if not out.is_file():
            filter_split(cfg, split, out, paths.path(paths.STATS, exp, split=split))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Measured dense matmul rate (TFLOP/s): 8192^3 on a GPU, 1024^3 on a CPU, random operands."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def forward_flops(model_config, prompt_tokens: list[int], image_patches: list[int], n: int, response_tokens: float) -> float:
    """Matmul FLOPs of one forward over a step's sequences, each prompt (and image) counted once.

    prompt_tokens, image_patches: per prompt; n samples per prompt; response_tokens: mean per sample.
    Text: 2 x linear params per token, causal attention 2 x S^2 x heads x head_dim per layer, the LM
    head on response positions. Vision: 2 x linear params per patch, windowed attention over
    `window` patches (full attention in fullatt blocks; every block where the tower has no windows),
    the 2x2 merger. Every text layer counts as dense softmax attention (linear-attention and MoE
    layers are counted as such). A text-only model's config has no vision part (image_patches are 0).
    """
    t, v = model_config.get_text_config(), getattr(model_config, "vision_config", None)
    d = models.head_dim(t)
    text_linear = t.num_hidden_layers * (2 * t.hidden_size * t.num_attention_heads * d
                                         + 2 * t.hidden_size * t.num_key_value_heads * d + 3 * t.hidden_size * t.intermediate_size)
    attn = 2 * t.num_hidden_layers * t.num_attention_heads * d  # x S^2 (causal)
    total = 0.0
    for p, patches in zip(prompt_tokens, image_patches):
        r = response_tokens
        prompt = 2 * text_linear * p + attn * p * p
        responses = n * (2 * text_linear * r + attn * (2 * p * r + r * r) + 2 * t.hidden_size * t.vocab_size * r)
        total += prompt + responses + (_vision_flops(v, patches) if v is not None else 0.0)
    return total


def _vision_flops(v, patches: int) -> float:
    """Matmul FLOPs of the vision tower (config `v`) over one prompt's `patches` (forward_flops)."""
    vision_linear = v.depth * (4 * v.hidden_size**2 + 3 * v.hidden_size * v.intermediate_size)
    window_size = getattr(v, "window_size", None)  # Qwen2.5-VL's windowed tower; the others attend over whole images
    window = (window_size // v.patch_size) ** 2 if window_size else 0
    full_layers = len(v.fullatt_block_indexes) if window_size else v.depth
    merger = 4 * v.hidden_size * (4 * v.hidden_size + v.out_hidden_size) / 4  # params per patch
    return (2 * (vision_linear + merger) * patches
            + 4 * v.hidden_size * patches * ((v.depth - full_layers) * window + full_layers * patches))


def step_flops(trainer: GRPOTrainer, step: int, response_tokens: float) -> float:
    """FLOPs a GRPO step needs: forwards for generation, old and ref log-probs, 3 per update epoch.

    With actor.old_logprobs_from_update the old pass covers the rows after the first mini-batch only.
    """
    cfg = trainer.cfg
    rows = [trainer.rows[i] for i in trainer.batch_indices(step)]
    enc = encode_prompts(trainer.processor, rows, trainer.device)  # only lengths and grids are read
    prompt_tokens = enc["attention_mask"].sum(-1).tolist()
    patches, first = enc["image_grid_thw"].prod(-1).tolist() if "image_grid_thw" in enc else [], [0]
    for r in rows:
        first.append(first[-1] + len(r["images"]))
    per_row = [sum(patches[first[k] : first[k + 1]]) for k in range(len(rows))]  # 0 for text rows
    actor = cfg["worker"]["actor"]
    old = 1 - min(actor["global_batch_size"], len(rows)) / len(rows) if trainer.old_from_update else 1
    forwards = 1 + old + (trainer.ref is not None) + 3 * actor["ppo_epochs"]
    model_config = trainer.policy.config
    return forwards * forward_flops(model_config, prompt_tokens, per_row, cfg["worker"]["rollout"]["n"], response_tokens)


def profiled(device: torch.device, out: Path, phases: tuple[str, ...] = PHASES):
    """A profiler writing a summary of `phases` (profile_summary) to `out` when it exits.

    The trace is exported by the profiler's C++ side and summarised from its JSON (profile_summary):
    turning a whole step's events into Python objects (key_averages) takes minutes on a GPU step.
    """
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def summarise(prof) -> None:
        trace = out.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))
        out.write_text(profile_summary(json.loads(trace.read_text())["traceEvents"], phases))
        trace.unlink()
        log.info("profile written to %s", out)

    return torch.profiler.profile(activities=activities, on_trace_ready=summarise)


def profile_summary(events: list[dict], phases: tuple[str, ...] = PHASES, top: int = 8) -> str:
    """Per phase (a record_function range named in `phases`): wall s, GPU kernel s, busy fraction, kernels launched and the
    host time per launch; then each phase's costliest kernels, and its costliest operators by the GPU time
    of the kernels they launched (which `aten::mul` a generic elementwise kernel was). events: a Chrome
    trace's traceEvents.

    A kernel belongs to the innermost phase whose range holds the host call that launched it (matched by
    the trace's correlation ids), so work queued in one phase and run in the next counts where it was
    queued, and a phase nested in another (vision within prefill) is not counted in it; and to the
    innermost operator (cpu_op) around that call on its thread.
    """
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name") in phases)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})]
    launched_at = {e["args"]["correlation"]: e["ts"] for e in runtime}
    operator = _launching_operators(events, runtime)

    def phase_of(ts):  # the innermost range holding ts
        inner = None
        for start, end, name in ranges:
            if start <= ts <= end:
                inner = name
        return inner

    gpu, launches = defaultdict(float), defaultdict(int)
    kernels, operators = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        correlation = e.get("args", {}).get("correlation")
        phase = phase_of(launched_at.get(correlation, -1.0))
        if phase is not None:
            gpu[phase] += e["dur"] / 1e6
            launches[phase] += 1
            kernels[phase][e["name"][:90]] += e["dur"] / 1e6
            operators[phase][operator.get(correlation, "(no operator)")] += e["dur"] / 1e6
    walls = {}  # a phase's ranges (the vision tower's, once per prefill forward) summed, in order of first start
    for start, end, name in ranges:
        walls[name] = walls.get(name, 0.0) + (end - start) / 1e6
    lines = [f"{'phase':<16}{'wall s':>10}{'gpu kernels s':>15}{'gpu busy':>10}{'kernels':>10}{'us/launch':>11}"]
    for name, wall in walls.items():
        per_launch = wall * 1e6 / launches[name] if launches[name] else 0.0
        lines.append(f"{name:<16}{wall:>10.3f}{gpu[name]:>15.3f}{gpu[name] / wall if wall else 0:>10.0%}{launches[name]:>10}{per_launch:>11.1f}")
    for name in walls:
        for title, costs in (("kernels", kernels[name]), ("operators", operators[name])):
            if costs:
                lines += ["", f"{name}: costliest {title} (s)"]
                lines += [f"{t:>10.3f}  {k}" for k, t in sorted(costs.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines) + "\n"


def _launching_operators(events: list[dict], launches: list[dict]) -> dict:
    """correlation id -> the name of the innermost operator (cpu_op) around the launch of that id on its thread."""
    by_thread = defaultdict(list)  # tid -> (time, order, event): operators open before launches at the same time
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[e.get("tid")].append((e["ts"], 0, e))
    for e in launches:
        by_thread[e.get("tid")].append((e["ts"], 1, e))
    out = {}
    for timeline in by_thread.values():
        timeline.sort(key=lambda item: (item[0], item[1], -item[2].get("dur", 0)))
        open_ops = []  # (end, name), innermost last
        for ts, kind, e in timeline:
            while open_ops and open_ops[-1][0] < ts:
                open_ops.pop()
            if kind == 0:
                open_ops.append((ts + e["dur"], e["name"]))
            elif open_ops:
                out[e["args"]["correlation"]] = open_ops[-1][1]
    return out


def timed_step(trainer: GRPOTrainer, step: int, device: torch.device) -> tuple[dict, float]:
    """One GRPOTrainer.step: its record and wall seconds, the device's queue drained at both ends."""
    sync(device)
    start = time.perf_counter()
    record = trainer.step(step)
    sync(device)
    return record, time.perf_counter() - start


def run_steps(trainer: GRPOTrainer, steps: range, device: torch.device, peak_tflops: float) -> dict:
    """Run `steps`; per-phase medians, step wall time (synchronised), throughput, MFU, peak memory."""
    records, walls, flops = [], [], []
    for step in steps:
        record, wall = timed_step(trainer, step, device)
        walls.append(wall)
        records.append(record)
        flops.append(step_flops(trainer, step, record["response_length/mean"]))
        log.info("step %d: %.2f s %s", step, walls[-1], {p: round(record.get(f"timing_s/{p}", 0.0), 2) for p in PHASES})
    step_s = statistics.median(walls)
    tokens = statistics.median(r["perf/total_num_tokens"] for r in records)
    out = {
        "steps": list(steps),
        "step_s": step_s,
        "steps_s": walls,
        "phase_s": {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in records) for p in PHASES},
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / step_s,
        "flops_per_step": statistics.median(flops),
        "mfu": statistics.median(flops) / step_s / (peak_tflops * 1e12),
        "response_length_mean": statistics.median(r["response_length/mean"] for r in records),
        "pg_loss": [r["actor/pg_loss"] for r in records],
    }
    if device.type == "cuda":
        out["peak_memory_allocated_gb"] = max(r["perf/max_memory_allocated_gb"] for r in records)
        out["peak_memory_reserved_gb"] = max(r["perf/max_memory_reserved_gb"] for r in records)
        out["cuda_malloc_calls"] = [r["perf/cuda_malloc_calls"] for r in records]
        out["cuda_alloc_retries"] = [r["perf/cuda_alloc_retries"] for r in records]
        out["graph_captures"] = [r["perf/cuda_graph_captures"] for r in records]  # the static engine's
    else:
        out["peak_memory_allocated_gb"] = out["peak_memory_reserved_gb"] = None  # not tracked on a CPU
    return out


def profiled_step(trainer: GRPOTrainer, step: int, device: torch.device, out: Path) -> dict:
    """One more step under the profiler (summary to `out`): its wall time (the trace's export after
    it not included) and phases. The profiler's own bookkeeping slows the step a little."""
    with profiled(device, out):
        record, wall = timed_step(trainer, step, device)
    return {"step": step, "step_s": wall, "phase_s": {p: record.get(f"timing_s/{p}", 0.0) for p in PHASES}}


def greedy_check(trainer: GRPOTrainer, prompts_count: int = 4, tokens: int = 64) -> dict:
    """Greedy tokens of the configured engine against the hf engine on the same weights."""
    rows = trainer.rows[:prompts_count]
    enc = encode_prompts(trainer.processor, rows, trainer.device)  # as the step encodes them
    prompts = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows], vision=models.takes_images(trainer.processor)).repeat_interleave(2)
    keys, params = torch.arange(len(prompts)), SamplingParams(0.0, 1.0, tokens, ignore_eos=True)
    with distributed.gathered(trainer.policy):  # under torchrun the policy is sharded
        fast = trainer.engine.generate(prompts, keys, params, batch_size=len(prompts)).responses
        plain = make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, params, batch_size=len(prompts)).responses
    same = fast == plain
    first = [int((~row).nonzero()[0]) if not row.all() else tokens for row in same]
    return {"rows": len(prompts), "tokens": tokens, "identical_rows": int(same.all(-1).sum()),
            "identical_tokens_fraction": same.float().mean().item(), "first_divergence": first}


def eval_time(trainer: GRPOTrainer, step: int) -> dict:
    """The validation of every item as a segment's last act (GRPOTrainer.validate), timed."""
    start = time.perf_counter()
    record = trainer.validate(step)
    if record is None:
        raise RuntimeError("the in-process validation failed (its error is logged above)")
    return {"items": len(load_filtered(paths.path(paths.FILTERED, config_lib.experiment_dir(trainer.cfg), split="val"))),
            "eval_s": time.perf_counter() - start, "encode_s": record["timing_s/encode"],
            "generate_s": record["timing_s/generation"], "scoring_s": record["timing_s/scoring"],
            "tokens_per_s": record["val/tokens_per_s"], "response_length_mean": record["val_response_length/mean"]}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(result: dict) -> str:
    fast, plain = result, result.get("plain")

    def row(name, key, fmt, sub=None):
        get = (lambda r: r[sub][key]) if sub else (lambda r: r[key])
        a = get(fast)
        b = get(plain) if plain else None
        ratio = f"{b / a:8.2f}x" if (b is not None and a) else ""
        fa = format(a, fmt) if a is not None else "-"
        fb = format(b, fmt) if b is not None else "-"
        return f"{name:<28}{fa:>12}{fb:>12}{ratio:>10}"

    lines = [f"{'':<28}{'optimized':>12}{'plain':>12}{'plain/opt':>10}"]
    lines += [row(f"{p} s", p, ".2f", "phase_s") for p in PHASES]
    lines += [row("step s", "step_s", ".2f"), row("tokens/s/GPU", "tokens_per_s_per_gpu", ".0f"), row("MFU", "mfu", ".3f"),
              row("peak memory allocated GB", "peak_memory_allocated_gb", ".1f"),
              row("peak memory reserved GB", "peak_memory_reserved_gb", ".1f")]
    h200 = "H200" in result["device"]
    if "eval" in result:
        e = result["eval"]
        lines.append(f"eval {e['items']} items: {e['eval_s']:.1f} s (generation {e['generate_s']:.1f} s)"
                     + (f", target {TARGETS['eval_s']:.0f} s" if h200 else ""))
    if plain:
        lines.append(f"step {result['step_s']:.2f} s" + (f" (target {TARGETS['step_s']:.0f} s)" if h200 else "")
                     + f", speed-up {result['speedup']:.2f}x")
    return "\n".join(lines)


def checkpoint_cost(trainer: GRPOTrainer, step: int) -> dict:
    """Save checkpoint `step` as a segment does (in the foreground here), then remove it: seconds and bytes
    (model/: the weights, or a LoRA run's adapters; optim/: the optimizer state)."""
    start = time.perf_counter()
    folder = trainer.save(step, "bench").result()
    seconds = time.perf_counter() - start
    sizes = {part: sum(f.stat().st_size for f in (folder / part).rglob("*") if f.is_file()) for part in ("model", "optim")}
    shutil.rmtree(folder)
    (trainer.store.root / "latest.json").unlink(missing_ok=True)
    return {"save_s": seconds, "model_bytes": sizes["model"], "optim_bytes": sizes["optim"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="vlgrpo bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="an experiment config, e.g. configs/bench_h200.yaml")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<experiment>.json)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--plain-steps", type=int, default=1, help="0 skips the plain path")
    parser.add_argument("--plain", default="configs/plain.yaml", help="the overlay that makes the plain path")
    parser.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True, help="time the evaluator")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--profile", action="store_true",
                        help="profile the last measured step (torch.profiler): <out>.profile.txt, per phase GPU busy time and top kernels")
    parser.add_argument("--checkpoint", action="store_true",
                        help="also save a checkpoint after the measured steps (seconds, bytes; removed after)")
    args = parser.parse_args(argv)
    logging.getLogger("vlgrpo.trainer").setLevel(logging.DEBUG)  # each phase's seconds as it ends
    overrides = config_lib.parse_assignments(args.set)
    cfg = config_lib.load(args.config, overrides=overrides)
    out_path = Path(args.out or f"benchmarks/results/{cfg['experiment']}.json")
    device = resolve_device(cfg["trainer"]["device"])
    ensure_filtered(cfg)
    model, weights = base_model(cfg, device)
    dtype = DTYPES[cfg["model"]["dtype"]]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    measured = matmul_tflops(device, dtype)
    peak = metrics.peak_tflops(device)
    result = {
        "device": name,
        "config": str(args.config),
        "weights": weights,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model_type": models.family_of(cfg["model"]["path"]).model_type,
        "rollout": {k: config_lib.for_device(cfg, device, models.family_of(cfg["model"]["path"]))["worker"]["rollout"][k]
                    for k in ("batch_size", "n", "engine", "ignore_eos")}
        | {"max_response_length": cfg["data"]["max_response_length"]},
        "matmul_tflops": measured,
        "peak_tflops": peak or measured,
        "peak_source": "datasheet" if peak else "measured matmul",
        "targets": TARGETS,
    }

    def write():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    trainer = GRPOTrainer(cfg)
    # Under torchrun the trainer shards the model it is given (in place): the plain path needs it whole.
    trainer.load(0, base=copy.deepcopy(model) if distributed.launched() and args.plain_steps else model)
    first = args.warmup + 1
    for step in range(1, first):
        trainer.step(step)
    result.update(run_steps(trainer, range(first, first + args.steps), device, result["peak_tflops"]))
    if hasattr(trainer.engine, "decoders"):  # the static engine, over the warm-up and measured steps
        engine = trainer.engine
        result["static_engine"] = {"decoders": engine.decoders, "captures": engine.captures, "own_weights": engine.own_weights}
    last = first + args.steps - 1
    if args.profile:
        last += 1
        result["profiled_step"] = profiled_step(trainer, last, device, out_path.with_suffix(".profile.txt"))
    if trainer.lora_info:
        result["lora"] = trainer.lora_info
    if args.checkpoint:
        result["checkpoint"] = checkpoint_cost(trainer, last)
    write()
    if trainer.cfg["worker"]["rollout"]["engine"] != "hf":
        result["greedy_vs_hf"] = greedy_check(trainer)
        write()
    if args.eval:
        result["eval"] = eval_time(trainer, last)
        write()
        if args.profile:  # again, under the profiler: the first run's time stands
            with profiled(device, out_path.with_suffix(".eval.profile.txt"), EVAL_PHASES):
                trainer.validate(last)
    trainer = None
    free(device)
    if args.plain_steps:
        plain_cfg = config_lib.load(args.config, args.plain, overrides=overrides)
        trainer = GRPOTrainer(plain_cfg)
        trainer.load(0, base=model)
        plain = run_steps(trainer, range(first, first + args.plain_steps), device, result["peak_tflops"])
        result["plain"] = plain
        result["plain_step_s"] = plain["step_s"]
        result["speedup"] = plain["step_s"] / result["step_s"]
        trainer = None
        free(device)
    write()
    print(table(result), flush=True)
    print(f"wrote {out_path}")
    return result

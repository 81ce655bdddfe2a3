"""Where the optimized GRPO step's time goes on the GPU (issue 7 follow-up to `vlgrpo bench`).

    python benchmarks/diagnose_h200.py --config configs/bench_h200.yaml --out diag.json

Same model, data and trainer as `vlgrpo bench` (random weights, rollout 32 x 4 x 512 tokens):
  1. warm-up step 1 (unprofiled);
  2. step 2 with each phase under its own torch.profiler: wall seconds, GPU kernel seconds (sum of
     kernel times: wall much larger means the GPU waits on the host) and the top kernels (gen
     is only timed);
  3. the static engine's decode step (one CUDA graph replay) in ms, at the training shape and at the
     evaluator's shape (601 rows) with and without top-p, and keyed sampling alone at 601 rows;
  4. the evaluator's pieces: encoding the 601 prompts on the CPU, prefill (generate 1 token), scoring;
  5. step 3 with the update's token budget doubled (micro_batch_size_per_device_for_update 16).
Prints as it goes; writes the numbers as JSON (after each section).
On the H200 (benchmarks/results/diagnose_h200.*) it ran about 400 s: the profiler's processing of the
update phase alone took about 4 minutes, and section 5 ran out of memory (137.6 GiB allocated) and
is recorded under "errors". Run it with a timeout and PYTHONFAULTHANDLER=1, as NOTES.md does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import traceback

import torch

from vlgrpo import config as config_lib
from vlgrpo import paths
from vlgrpo import trainer as trainer_mod
from vlgrpo.batch import PromptBatch
from vlgrpo.bench import base_model, ensure_filtered
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.policy import resolve_device
from vlgrpo.rewards import load_reward_function, score_responses
from vlgrpo.rollout import SamplingParams
from vlgrpo.rollout.sampling import keyed_sample, sample_key

out: dict = {}


def say(*args):
    print(*args, flush=True)


def kernel_seconds(prof) -> tuple[float, list]:
    """Sum of GPU kernel time (s) and the top kernels (name, calls, ms) of a finished profile."""
    rows = []
    for e in prof.key_averages():
        if str(e.device_type).endswith("CUDA"):
            t = getattr(e, "self_device_time_total", None)
            t = getattr(e, "self_cuda_time_total", 0) if t is None else t
            rows.append((e.key, e.count, t / 1e3))
    rows.sort(key=lambda r: -r[2])
    return sum(r[2] for r in rows) / 1e3, rows[:12]


@contextlib.contextmanager
def profiled_timer(timing: dict, name: str):
    if name == "gen":  # CUDA graph replays: timed without the profiler (section 3 times the decode step)
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        timing[name] = time.perf_counter() - start
        say(f"== gen: wall {timing[name]:.2f} s (not profiled)")
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        timing[name] = time.perf_counter() - start
    try:
        gpu, top = kernel_seconds(prof)
        out.setdefault("profiled_step", {})[name] = {"wall_s": timing[name], "kernel_s": gpu, "top": top}
        say(f"== {name}: wall {timing[name]:.2f} s, GPU kernels {gpu:.2f} s")
        for key, count, ms in top:
            say(f"   {ms:9.1f} ms {count:7d}x  {key[:110]}")
    except Exception:
        traceback.print_exc()


def time_replays(dec, reps: int = 40) -> float:
    """ms per decode-step graph replay, the cache filled with random values."""
    rows, width = dec.mask.shape
    prompt = width - dec.out_tokens.shape[1]
    dec.k.normal_()
    dec.v.normal_()
    dec.mask.zero_()
    dec.mask[:, :prompt] = True
    dec.keys.copy_(torch.arange(rows, device=dec.keys.device))
    dec.tokens.random_(0, 150000)
    dec.position.fill_(prompt)
    dec.prompt_width.fill_(prompt)
    dec.step_index.zero_()
    for _ in range(3):
        dec.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dec.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def script_args(argv, default_out: str, sections: str | None = None):
    """The diagnosis scripts' command line (--config, --out, and --sections when they have sections):
    returns (args, the sections asked for, a function writing `out` as JSON to --out)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/bench_h200.yaml")
    parser.add_argument("--out", default=default_out)
    if sections:
        parser.add_argument("--sections", default=sections, help=f"comma-separated subset of {sections}")
    args = parser.parse_args(argv)

    def write():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    return args, set((args.sections if sections else "").split(",")), write


def section(name, fn):
    say(f"--- {name}")
    try:
        fn()
    except Exception:
        traceback.print_exc()
        out.setdefault("errors", []).append(name)


def main(argv=None):
    args, _, write = script_args(argv, "diag.json")
    logging.basicConfig(level=logging.WARNING)

    cfg = config_lib.load(args.config)
    device = resolve_device(cfg["trainer"]["device"])
    ensure_filtered(cfg)
    model, _ = base_model(cfg, device)
    trainer = trainer_mod.GRPOTrainer(cfg)
    trainer.load(0, base=model)
    t0 = time.perf_counter()
    record = trainer.step(1)
    out["warmup_step_s"] = time.perf_counter() - t0
    out["warmup_phase_s"] = {k[9:]: v for k, v in record.items() if k.startswith("timing_s/")}
    say("warm-up step 1:", {k: round(v, 2) for k, v in out["warmup_phase_s"].items()})
    write()

    def profiled_step():
        plain_timer, trainer_mod.timer = trainer_mod.timer, profiled_timer
        try:
            t = time.perf_counter()
            trainer.step(2)
            out["profiled_step_wall_s"] = time.perf_counter() - t
        finally:
            trainer_mod.timer = plain_timer
        stats = torch.cuda.memory_stats()
        out["allocator"] = {k: stats.get(k) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")}
        say("allocator:", out["allocator"])

    section("step 2, each phase profiled", profiled_step)
    write()
    engine = trainer.engine

    def decode():
        res = {}
        shapes = {
            "train_128x1152_T1": (128, 1152, SamplingParams(1.0, 1.0, 512, True)),
            "eval_601x1280_T0.6_topp0.95": (601, 1280, SamplingParams(0.6, 0.95, 512)),
            "eval_601x1280_T0.6_topp1": (601, 1280, SamplingParams(0.6, 1.0, 512)),
        }
        for name, (rows, width, params) in shapes.items():
            t = time.perf_counter()
            dec = engine._decoder_for(rows, width, params)
            setup = time.perf_counter() - t
            res[name] = {"ms_per_step": time_replays(dec), "alloc_and_capture_s": setup}
            say(name, res[name])
        engine._decoder = engine._shape = None
        torch.cuda.empty_cache()
        vocab = trainer.policy.lm_head.weight.shape[0]
        logits = torch.randn(601, vocab, device=device, dtype=torch.bfloat16)
        keys = torch.arange(601, device=device)
        pos = torch.zeros(1, device=device, dtype=torch.long)
        banned = engine.banned.to(device)
        for top_p in (0.95, 1.0):
            res[f"keyed_sample_601_topp{top_p}_ms"] = cuda_ms(lambda: keyed_sample(logits, keys, pos, 0.6, top_p, banned))
        say({k: v for k, v in res.items() if k.endswith("_ms")})
        out["decode"] = res

    section("decode step (graph replay) and sampling", decode)
    write()

    def eval_pieces():
        exp = config_lib.experiment_dir(cfg)
        rows = load_filtered(paths.path(paths.FILTERED, exp, split="val"))
        t = time.perf_counter()
        enc = encode_prompts(trainer.processor, rows)
        encode_s = time.perf_counter() - t
        prompts = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows])
        keys = torch.tensor([sample_key(cfg["seed"], 0x5A17, r["index"], 0) for r in rows])
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, keys, SamplingParams(0.6, 0.95, 1), batch_size=len(prompts))
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t
        engine._decoder = engine._shape = None
        texts = trainer.processor.tokenizer.batch_decode(
            torch.randint(0, len(trainer.processor.tokenizer), (len(rows), 512)).tolist(), skip_special_tokens=True)
        reward = cfg["worker"]["reward"]
        fn = load_reward_function(reward["reward_function"], reward["format_weight"])
        t = time.perf_counter()
        score_responses(fn, texts, [r["answer"] for r in rows])
        score_s = time.perf_counter() - t
        out["eval_pieces"] = {"items": len(rows), "prompt_width": prompts.input_ids.shape[1], "encode_s": encode_s,
                              "prefill_s (transfer, prefill, 1 token)": prefill_s, "score_random_texts_s": score_s}
        say(out["eval_pieces"])

    section("evaluator pieces", eval_pieces)
    write()

    def bigger_update():
        trainer.cfg["worker"]["actor"]["micro_batch_size_per_device_for_update"] = 16
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        rec = trainer.step(3)
        out["step3_update_micro16"] = {"step_s": time.perf_counter() - t,
                                       "phase_s": {k[9:]: v for k, v in rec.items() if k.startswith("timing_s/")},
                                       "peak_allocated_gb": rec["perf/max_memory_allocated_gb"],
                                       "peak_reserved_gb": rec["perf/max_memory_reserved_gb"]}
        say(out["step3_update_micro16"])

    section("step 3, update token budget x2", bigger_update)
    write()


if __name__ == "__main__":
    main()

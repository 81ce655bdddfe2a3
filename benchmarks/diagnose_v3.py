"""Where the update's and the evaluator's time goes, without a whole step (issue 7, after v3).

    python benchmarks/diagnose_v3.py --config configs/bench_h200.yaml --out diag_v3.json

Same model (random weights), data and trainer as `vlgrpo bench`, but no rollout: 32 train prompts x
4 samples with random 512-token responses, then
  1. one update micro-batch (forward, loss, backward) at token budgets of 8, 16 and 24 rows: host
     seconds (until backward returns), wall seconds (after a device sync) and peak memory; the host
     running as long as the wall means the GPU waits on it;
  2. one micro-batch of 8 rows under torch.profiler: GPU kernel seconds, the host ops with the most
     self time, and how often the host waited (synchronize / item / blocking copies);
  3. the evaluator's generation split: host->device copy, prefill of 601 prompts, decode-step replay
     at 601 rows (T 0.6, top-p 0.95) and keyed sampling alone.
With --sections eval,prefill_profile, the evaluator's prefill also runs under torch.profiler (wall,
kernel seconds in and outside the vision tower, top kernels). Prints as it goes; writes JSON after
each section. --sections picks a subset.
"""

from __future__ import annotations

import time

import torch

from vlgrpo import config as config_lib
from vlgrpo import grpo, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.bench import base_model, ensure_filtered, free, sync
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.policy import resolve_device, response_logprobs
from vlgrpo.rollout import SamplingParams
from vlgrpo.rollout.sampling import keyed_sample
from vlgrpo.trainer import GRPOTrainer

# The first diagnosis's printing, per-section error capture and CUDA-event timing, and `out`, the
# dict written as JSON (this folder is on sys.path when a script in it runs).
from diagnose_h200 import cuda_ms, out, say, script_args, section


def micro_step(trainer, prompts, responses, mask, rows) -> float:
    """Forward, loss and backward of one micro-batch; returns the host seconds until backward returns."""
    start = time.perf_counter()
    logp = response_logprobs(trainer.policy, prompts.select(rows), responses[rows], mask[rows], 1.0, trainer.forward)
    rmask = mask[rows].to(logp.device).float()
    loss, _ = grpo.policy_loss(logp, logp.detach(), torch.ones(len(rows), device=logp.device), rmask, 0.2, 0.3, 3.0)
    loss.backward()
    return time.perf_counter() - start


def profile_prefill(engine, sub, dec, model) -> dict:
    """The evaluator's prefill under torch.profiler: wall, GPU kernel seconds inside and outside the
    vision tower, and the kernels with the most GPU time."""
    visual = model.model.visual
    forward = visual.forward

    def labelled(*args, **kwargs):
        with torch.profiler.record_function("vlgrpo::visual"):
            return forward(*args, **kwargs)

    visual.forward = labelled
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=acts) as prof, torch.no_grad():
            start = time.perf_counter()
            engine._prefill(sub, dec)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        visual.forward = forward
    events = prof.key_averages()
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    visual_range = [e for e in events if e.key == "vlgrpo::visual"]
    res = {
        "wall_s": wall,
        "kernel_s": sum(e.self_device_time_total for e in kernels) / 1e6,
        "visual_kernel_s": sum(e.device_time_total for e in visual_range) / 1e6,
        "kernel_launches": sum(e.count for e in kernels),
        "top_kernels": [(e.key[:120], e.count, e.self_device_time_total / 1e6) for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]],
    }
    say({k: v for k, v in res.items() if k != "top_kernels"})
    for row in res["top_kernels"]:
        say("  ", row)
    return res


def main(argv=None):
    args, wanted, write = script_args(argv, "diag_v3.json", "budgets,profiled,eval")  # and prefill_profile

    cfg = config_lib.load(args.config)
    device = resolve_device(cfg["trainer"]["device"])
    cuda = device.type == "cuda"
    ensure_filtered(cfg)
    model, _ = base_model(cfg, device)
    trainer = GRPOTrainer(cfg)
    trainer.load(0, base=model)
    n, length = cfg["worker"]["rollout"]["n"], cfg["data"]["max_response_length"]
    rows = [trainer.rows[i] for i in trainer.batch_indices(2)]
    enc = encode_prompts(trainer.processor, rows, device)  # as the trainer: pixel values on the model's device
    prompts = PromptBatch.from_processor(enc, [len(r["images"]) for r in rows]).repeat_interleave(n)
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(0, len(trainer.processor.tokenizer), (len(prompts), length), generator=generator)
    mask = torch.ones_like(responses)
    trainer.policy.train()

    def budgets():
        res = {}
        for micro in (8, 16, 24):
            batch = trainer._micro_batches(prompts, mask, list(range(len(prompts) // 2)), micro)[0]
            sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                walls, hosts = [], []
                for _ in range(3):
                    start = time.perf_counter()
                    hosts.append(micro_step(trainer, prompts, responses, mask, batch))
                    sync(device)
                    walls.append(time.perf_counter() - start)
                res[micro] = {"rows": len(batch), "host_s": hosts, "wall_s": walls}
                if cuda:  # resident: weights, reference, gradients (no optimizer state, no decode cache here)
                    res[micro] |= {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
                                   "resident_gb": torch.cuda.memory_allocated() / 2**30}
            except torch.OutOfMemoryError as e:
                res[micro] = {"rows": len(batch), "error": str(e)[:200]}
            trainer.policy.zero_grad(set_to_none=True)
            free(device)
            say(micro, res[micro])
        out["micro_batch"] = res

    if "budgets" in wanted:
        section("update micro-batches by token budget", budgets)
        write()

    def profiled():
        batch = trainer._micro_batches(prompts, mask, list(range(len(prompts) // 2)), 8)[0]
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            host = micro_step(trainer, prompts, responses, mask, batch)
            sync(device)
            wall = time.perf_counter() - start
        trainer.policy.zero_grad(set_to_none=True)
        events = prof.key_averages()
        kernels = sum(getattr(e, "self_device_time_total", 0) for e in events if str(e.device_type).endswith("CUDA"))
        host_ops = sorted((e for e in events if str(e.device_type).endswith("CPU")), key=lambda e: -e.self_cpu_time_total)
        waits = {e.key: e.count for e in events if any(w in e.key for w in ("Synchronize", "aten::item", "aten::_local_scalar_dense", "Memcpy", "aten::nonzero"))}
        out["profiled_micro_batch"] = {
            "rows": len(batch), "host_s": host, "wall_s": wall, "kernel_s": kernels / 1e6,
            "cpu_ops": sum(e.count for e in host_ops if e.key.startswith("aten::")),
            "top_host": [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in host_ops[:25]],
            "waits": waits,
        }
        say({k: v for k, v in out["profiled_micro_batch"].items() if k != "top_host"})
        for row in out["profiled_micro_batch"]["top_host"]:
            say("  ", row)

    if "profiled" in wanted:
        section("one micro-batch of 8 rows under the profiler", profiled)
        write()
    trainer.policy.eval()

    def eval_pieces():
        engine = trainer.engine
        val = load_filtered(paths.path(paths.FILTERED, config_lib.experiment_dir(cfg), split="val"))
        start = time.perf_counter()
        enc = encode_prompts(trainer.processor, val, device)  # as the evaluator
        sync(device)
        res = {"items": len(val), "encode_s": time.perf_counter() - start}
        batch = PromptBatch.from_processor(enc, [len(r["images"]) for r in val])
        params = SamplingParams(0.6, 0.95, length)
        sync(device)
        start = time.perf_counter()
        sub = batch.select(list(range(len(batch)))).to(device, model.dtype)
        sync(device)
        res["select_and_copy_s"] = time.perf_counter() - start
        rows_, width = sub.input_ids.shape
        cache_width = -(-(width + length - 1) // 128) * 128
        start = time.perf_counter()
        dec = engine._decoder_for(rows_, cache_width, params)
        sync(device)
        res["alloc_and_capture_s"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            logits = engine._prefill(sub, dec)
        sync(device)
        res["prefill_s"] = time.perf_counter() - start
        if "prefill_profile" in wanted and cuda:
            res["prefill_profile"] = profile_prefill(engine, sub, dec, model)
        if not cuda:  # no graph to replay
            out["eval"] = res
            say(res)
            return
        keys = torch.arange(rows_, device=device)
        dec.keys.copy_(keys)
        dec.prompt_width.fill_(width)
        dec.step_index.zero_()
        res["decode_step_ms"] = cuda_ms(dec.graph.replay, reps=40)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        position = torch.zeros(1, device=device, dtype=torch.long)
        for top_p in (0.95, 1.0):
            begin.record()
            for _ in range(20):
                keyed_sample(logits, keys, position, 0.6, top_p, dec.banned)
            end.record()
            torch.cuda.synchronize()
            res[f"keyed_sample_ms_top_p_{top_p}"] = begin.elapsed_time(end) / 20
        out["eval"] = res
        say(res)

    if "eval" in wanted:
        section("evaluator pieces", eval_pieces)
        write()


if __name__ == "__main__":
    main()

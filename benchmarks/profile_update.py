"""Where the update phase's host time goes, inside whole GRPO steps (issue 7, after v5).

    python benchmarks/profile_update.py --config configs/bench_h200.yaml --out profile_update.json

Same model (random weights), data and trainer as `vlgrpo bench`. Step 1 warms up (graph capture,
compilation); step 2 runs as the bench does, with the update's host functions labelled; step 3's
update runs under torch.profiler. Reports, for the update of step 2: its wall seconds and how long
the GPU still worked after the host had queued the last operation (near 0: the GPU waited on the
host); for step 3: the GPU kernels' seconds, the inclusive host milliseconds of each labelled
function (prompt runs, selects, transfers, rope/vision indices, forward pieces, loss, backward, clip,
optimizer), the host ops with the most self time, and allocator and wait counts.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from vlgrpo import config as config_lib
from vlgrpo import grpo, policy
from vlgrpo import trainer as trainer_mod
from vlgrpo.batch import PromptBatch
from vlgrpo.bench import base_model, ensure_filtered, sync
from vlgrpo.policy import resolve_device

LABELS = [
    (policy, "prompt_runs"), (PromptBatch, "select"), (PromptBatch, "to"), (policy, "multimodal_index"),
    (policy, "prefix_forward"), (policy, "_shared_prefix_hidden"), (policy, "token_logprobs"),
    (trainer_mod, "response_logprobs"), (grpo, "policy_loss"), (grpo, "kl_penalty"), (torch.Tensor, "backward"),
    (torch.nn.utils, "clip_grad_norm_"),
]


def label(owner, name: str) -> None:
    """Run owner.name inside a profiler range named after it (also for callers that looked it up by module)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(f"vlgrpo::{name}"):
            return fn(*args, **kwargs)

    setattr(owner, name, wrapped)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/bench_h200.yaml")
    parser.add_argument("--out", default="profile_update.json")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config)
    device = resolve_device(cfg["trainer"]["device"])
    cuda = device.type == "cuda"
    ensure_filtered(cfg)
    model, _ = base_model(cfg, device)
    trainer = trainer_mod.GRPOTrainer(cfg)
    trainer.load(0, base=model)
    for owner, name in LABELS:
        label(owner, name)
    trainer.optimizer.step = torch.profiler.record_function("vlgrpo::optimizer_step")(trainer.optimizer.step)
    update = trainer.update_actor
    out: dict = {}

    def timed_update(*a, **k):  # host time to queue the update, then the GPU's remaining work
        sync(device)
        start = time.perf_counter()
        result = update(*a, **k)
        queued = time.perf_counter()
        sync(device)
        out["update_step2"] = {"wall_s": time.perf_counter() - start, "gpu_after_host_s": time.perf_counter() - queued}
        return result

    def profiled_update(*a, **k):
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            result = update(*a, **k)
            sync(device)
            wall = time.perf_counter() - start
        events = prof.key_averages()
        kernels = sum(getattr(e, "self_device_time_total", 0) for e in events if str(e.device_type).endswith("CUDA"))
        host = [e for e in events if str(e.device_type).endswith("CPU")]
        out["update_step3_profiled"] = {
            "wall_s": wall,
            "kernel_s": kernels / 1e6,
            # per label: calls, host ms inclusive, GPU ms of the kernels launched inside
            "labelled_ms": {e.key: (e.count, round(e.cpu_time_total / 1e3, 1), round(getattr(e, "device_time_total", 0) / 1e3, 1))
                            for e in host if e.key.startswith("vlgrpo::")},
            "top_self_ms": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 1))
                            for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:30]],
            "counts": {e.key: e.count for e in host if any(w in e.key for w in (
                "Synchronize", "aten::item", "_local_scalar_dense", "cudaMalloc", "cudaFree", "cudaHostAlloc",
                "aten::nonzero", "pin_memory", "cudaMemcpyAsync"))},
        }
        return result

    trainer.step(1)
    trainer.update_actor = timed_update
    record = trainer.step(2)
    out["step2"] = {k: v for k, v in record.items() if k.startswith(("timing_s/", "perf/cuda", "perf/max_memory"))}
    print(json.dumps(out, indent=1), flush=True)
    trainer.update_actor = profiled_update
    trainer.step(3)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["update_step3_profiled"], indent=1), flush=True)
    return out


if __name__ == "__main__":
    main()

"""Optimizer step benchmark: time and memory of one optimizer.step() over Qwen2.5-VL-3B's parameters.

    PYTHONPATH=src python3 scripts/bench_optim.py --out benchmarks/results/bench_optim.json
    PYTHONPATH=src python3 scripts/bench_optim.py --tiny --device cpu --out /tmp/bench_optim.json  # a smoke run

Builds the model on the "meta" device from the config folder (--model-config; where it is missing, the
architecture numbers of Qwen/Qwen2.5-VL-3B-Instruct's config.json written below), then gives each of
its parameters random values N(0, 0.02) and a random gradient on --device, and times optimizer.step()
(--warmup steps, then the median of --steps, each synchronized) for:
  torch_adamw_bf16  torch AdamW (fused on CUDA) on bf16 weights: vlgrpo's adamw_bf16 before optim.py
  adamw_bf16        optim.KahanAdamW on bf16 weights (bf16 moments and compensation)
  adamw             optim.MasterAdamW on bf16 weights (fp32 master weights and moments)
  adamw_fp32        torch AdamW (fused on CUDA) on fp32 weights: EasyR1's adamw (fp32 FSDP parameters)
For each: ms/step, the weights', gradients' and optimizer state's GB, and on CUDA the peak allocated
memory during the steps and what the step needs beyond weights, gradients and state. Writes JSON.
Needs only torch, transformers and this repository.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2_5_VLConfig

from vlgrpo.optim import KahanAdamW, MasterAdamW

ROOT = Path(__file__).resolve().parents[1]
# From Qwen/Qwen2.5-VL-3B-Instruct's config.json (also at ../shared/data/qwen2_5_vl_3b/config.json).
QWEN2_5_VL_3B = {
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}
TINY = {  # a few MB of parameters with the same structure, for the CPU smoke run
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1,
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "fullatt_block_indexes": [1]},
}
VARIANTS = ("torch_adamw_bf16", "adamw_bf16", "adamw", "adamw_fp32")
HYPER = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def model_config(args) -> tuple[transformers.PretrainedConfig, str]:
    if args.tiny:
        return Qwen2_5_VLConfig(**TINY), "tiny"
    folder = Path(args.model_config)
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder), str(folder)
    return Qwen2_5_VLConfig(**QWEN2_5_VL_3B), "built-in Qwen2.5-VL-3B numbers"


def parameter_shapes(config) -> list[torch.Size]:
    """Shapes of the model's trainable parameters (tied embeddings once), from a model on "meta"."""
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    return [p.shape for p in model.parameters()]


def make_optimizer(variant: str, params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
    fused = True if device.type == "cuda" else None
    if variant in ("torch_adamw_bf16", "adamw_fp32"):
        return torch.optim.AdamW(params, **HYPER, fused=fused)
    return {"adamw_bf16": KahanAdamW, "adamw": MasterAdamW}[variant](params, **HYPER)


def gigabytes(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(variant: str, shapes: list[torch.Size], device: torch.device, warmup: int, steps: int) -> dict:
    dtype = torch.float32 if variant == "adamw_fp32" else torch.bfloat16
    generator = torch.Generator(device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype).normal_(0, 0.02, generator=generator))
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=generator)
        params.append(p)
    optimizer = make_optimizer(variant, params, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        optimizer.step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]  # step: one scalar each
    out = {
        "ms_per_step": 1e3 * statistics.median(times),
        "ms_per_step_min": 1e3 * min(times),
        "weights_gb": gigabytes(params),
        "grads_gb": gigabytes(p.grad for p in params),
        "state_gb": gigabytes(state),
        "state_dtypes": sorted({f"{k}:{str(v.dtype).removeprefix('torch.')}" for s in optimizer.state.values()
                                for k, v in s.items() if k != "step"}),
        "checkpoint_gb": gigabytes(params) + gigabytes(state),  # weights + optimizer state, as saved
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        out["peak_allocated_gb"] = peak
        out["step_temporaries_gb"] = peak - out["weights_gb"] - out["grads_gb"] - out["state_gb"]
    del optimizer, params, state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--model-config", default=str(ROOT.parent / "shared" / "data" / "qwen2_5_vl_3b"),
                        help="folder with the model's config.json (default: ../shared/data/qwen2_5_vl_3b)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error("--steps: at least 5 timed steps (the median is reported)")
    device = torch.device(args.device)
    config, source = model_config(args)
    shapes = parameter_shapes(config)
    result = {
        "model_config": source,
        "parameters": sum(s.numel() for s in shapes),
        "tensors": len(shapes),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "warmup": args.warmup,
        "steps": args.steps,
        "hyperparameters": {**HYPER, "betas": list(HYPER["betas"])},
        "variants": {},
    }
    for variant in args.variants:
        result["variants"][variant] = bench(variant, shapes, device, args.warmup, args.steps)
        print(f"{variant:<18}" + "  ".join(f"{k} {v:.3f}" for k, v in result["variants"][variant].items() if isinstance(v, float)),
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

"""The fused sampling kernel against keyed_sample_torch on a GPU: same tokens? how much faster?

    python scripts/sampler_h200.py --out benchmarks/results/sampler_h200.json

CUDA only (the Triton kernel runs compiled there; tests/test_fused_sampling.py runs it on the CPU).

bf16 logits of Qwen2.5-VL's vocabulary (151,936) at the decode shapes of the benchmark (128 rows:
a training rollout; 601 rows: the evaluation), flat to peaked rows, the vision placeholders and the
ids past the tokenizer banned as the engines ban them. For each setting (training T 1 / top-p 1,
validation T 0.6 / top-p 0.95, greedy, a small nucleus) and 8 positions (8 noise draws): rows whose
tokens agree, the largest log-prob difference, and the milliseconds of one call of each form (CUDA
events, mean of 20 after 3 warm-ups).
"""

from __future__ import annotations

import argparse
import json

import torch

from vlgrpo.rollout.fused_sampling import keyed_sample_fused
from vlgrpo.rollout.sampling import keyed_sample_torch, row_hash, sample_key

VOCAB = 151936
BANNED = [*range(151652, 151657), *range(151665, VOCAB)]  # vision placeholders, ids past the tokenizer
SETTINGS = {"train": (1.0, 1.0), "validation": (0.6, 0.95), "greedy": (0.0, 1.0), "nucleus_0.3": (1.0, 0.3)}


def cuda_ms(fn, reps: int = 20) -> float:
    """Milliseconds of one call of `fn`: CUDA events around `reps` calls, after 3 warm-ups."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/sampler_h200.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    banned = torch.zeros(VOCAB, dtype=torch.bool, device=device)
    banned[BANNED] = True
    result = {"device": torch.cuda.get_device_name(), "vocab": VOCAB, "cases": []}
    for rows in (128, 601):
        sharpness = torch.logspace(-1, 1.5, rows, device=device)[:, None]  # 0.1 .. 31.6: nuclei of all sizes
        logits = (torch.randn(rows, VOCAB, device=device, generator=generator) * sharpness).bfloat16()
        keys = torch.tensor([sample_key(1, 2, i, 0) for i in range(rows)], device=device)
        for name, (temperature, top_p) in SETTINGS.items():
            same, logp_diff = 0, 0.0
            for position in range(8):
                a, la = keyed_sample_torch(logits, keys, position, temperature, top_p, banned)
                b, lb = keyed_sample_fused(logits, row_hash(keys, position), temperature, top_p, banned)
                same += int((a == b).sum())
                logp_diff = max(logp_diff, float((la - lb).abs().max()))
            hashes = row_hash(keys, 3)
            case = {
                "rows": rows, "setting": name, "temperature": temperature, "top_p": top_p,
                "same_tokens": same, "draws": 8 * rows, "max_logp_diff": logp_diff,
                "torch_ms": cuda_ms(lambda: keyed_sample_torch(logits, keys, 3, temperature, top_p, banned)),
                "fused_ms": cuda_ms(lambda: keyed_sample_fused(logits, hashes, temperature, top_p, banned)),
            }
            result["cases"].append(case)
            print(json.dumps(case), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

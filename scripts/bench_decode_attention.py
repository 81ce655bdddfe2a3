"""Time the static decode step's attention alone on one GPU: the Triton kernel over each row's own keys
(rollout.decode_attention, with a few tile settings) against SDPA over the whole cache under the rows'
masks (cuDNN, as the captured step ran it before, and memory-efficient), at Qwen2.5-VL-3B's shapes.

    python scripts/bench_decode_attention.py --out benchmarks/results/decode_attention_h100.json

Rows are right-aligned at the prompt width with prompt lengths drawn around --mean-prompt (the
validation's Geometry3K prompts average ~460 tokens; the longest sets the width); each case is timed at
the start, the middle and the end of a 512-token response. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vlgrpo.rollout import decode_attention


def cache_case(rows: int, prompt_width: int, mean_prompt: int, kv_heads=2, group=8, dim=128, response=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-(prompt_width + response - 1) // 128) * 128
    lengths = (torch.randn(rows, generator=g) * 120 + mean_prompt).clamp(64, prompt_width).int()
    lengths[0] = prompt_width
    q = torch.randn(rows, kv_heads, group, dim, generator=g).cuda().bfloat16()
    k, v = (torch.randn(rows, kv_heads, width, dim, generator=g).cuda().bfloat16() for _ in range(2))
    return q, k, v, lengths.cuda(), width


def timed(fn, repeats=50) -> float:
    """Milliseconds a call, CUDA-graph replayed (as the decode step runs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[601, 128])
    parser.add_argument("--prompt-width", type=int, default=897)
    parser.add_argument("--mean-prompt", type=int, default=460)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for rows in args.rows:
        q, k, v, lengths, width = cache_case(rows, args.prompt_width, args.mean_prompt)
        kv_heads, group, dim = q.shape[1:]
        pairs = torch.arange(rows * kv_heads, device="cuda", dtype=torch.int32)
        starts = pairs * width + args.prompt_width - lengths.repeat_interleave(kv_heads)
        for fed in (1, 256, 511):  # response tokens fed: the first step, the middle, the last (cache width >= prompt width + 511)
            counts = (lengths + fed).repeat_interleave(kv_heads)
            columns = torch.arange(width, device="cuda")
            mask = ((columns >= args.prompt_width - lengths[:, None]) & (columns < args.prompt_width + fed))[:, None, None, :]
            case = {"rows": rows, "width": width, "fed": fed, "keys_read_fraction": float(counts.sum()) / (rows * kv_heads * width)}
            for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
                with sdpa_kernel([backend]):
                    case[name] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5))
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        out = torch.empty_like(q)

                        def kernel():
                            decode_attention._rows_kernel[(rows * kv_heads,)](
                                q, k, v, out, starts, counts, dim**-0.5, GROUP=group, GROUP_PAD=16, D=dim, BLOCK_N=block_n,
                                num_warps=warps, num_stages=stages)

                        case[f"kernel_n{block_n}_w{warps}_s{stages}"] = timed(kernel)
            reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=dim**-0.5)
            case["kernel_max_diff"] = float((decode_attention.rows_attention(q, k, v, starts, counts, dim**-0.5).float() - reference).abs().max())
            result["cases"].append(case)
            best = min((key for key in case if key.startswith("kernel_n")), key=case.get)
            print(f"rows {rows} fed {fed}: cudnn {case['sdpa_cudnn']:.3f} ms, efficient {case['sdpa_efficient']:.3f}, "
                  f"kernel default {case['kernel_n64_w4_s3']:.3f}, best {best} {case[best]:.3f} (reads {case['keys_read_fraction']:.2f}; "
                  f"max diff {case['kernel_max_diff']:.4f})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

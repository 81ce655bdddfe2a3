"""The static decode step's attention kernel (rollout.decode_attention) gives SDPA's output over the
whole right-aligned cache under the rows' masks: on the CPU under Triton's interpreter (in a child
process: TRITON_INTERPRET must be set before Triton compiles anything), on a GPU compiled and captured
in a CUDA graph."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# (rows, kv_heads, group, head_dim, prompt width, cache width, prompt lengths, response tokens fed):
# Qwen2.5-VL-3B's 8 query heads a key head and Qwen2-VL-2B's 6 (padded to 16 in the kernel); rows
# with one prompt token, a full prompt, and key counts on and off the kernel's 64-key blocks
CASES = [(4, 2, 8, 128, 100, 256, [100, 1, 37, 64], 28), (3, 2, 6, 64, 70, 192, [70, 5, 36], 1),
         (2, 1, 4, 32, 64, 128, [63, 64], 64)]


def decode_case(case, device, dtype, seed=0):
    """q, k, v of a static cache whose rows are right-aligned at the prompt width, the kernel's starts
    and counts, and SDPA's output over the whole cache under the rows' masks (float32)."""
    rows, kv_heads, group, dim, prompt_width, width, lengths, fed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads, group, dim, generator=g).to(device, dtype)
    k, v = (torch.randn(rows, kv_heads, width, dim, generator=g).to(device, dtype) for _ in range(2))
    prompt = torch.tensor(lengths, device=device, dtype=torch.int32).repeat_interleave(kv_heads)  # per row and head
    pairs = torch.arange(rows * kv_heads, device=device, dtype=torch.int32)
    starts, counts = pairs * width + prompt_width - prompt, prompt + fed
    columns = torch.arange(width, device=device)
    lengths = torch.tensor(lengths, device=device)
    mask = (columns >= prompt_width - lengths[:, None]) & (columns < prompt_width + fed)  # (rows, width)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :],
                                                                scale=dim**-0.5)
    return q, k, v, starts, counts, expected


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_decode_attention import CASES, decode_case
from vlgrpo.rollout import decode_attention

assert decode_attention.serves("cpu", torch.float16, 128) and not decode_attention.serves("cpu", torch.float32, 128)
assert not decode_attention.serves("cpu", torch.float16, 80)
diffs = []
for case in CASES:
    q, k, v, starts, counts, expected = decode_case(case, "cpu", torch.float16)
    out = decode_attention.rows_attention(q, k, v, starts, counts, q.shape[-1] ** -0.5)
    diffs.append(float((out.float() - expected).abs().max()))
print(json.dumps(diffs))
"""


def test_the_kernel_attends_each_rows_own_keys_under_the_interpreter():
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(diffs) == len(CASES) and max(diffs) < 2e-3, diffs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_attends_each_rows_own_keys_on_cuda_and_replays_new_counts():
    """bf16 on the card, within its rounding; captured in a CUDA graph, a replay reads the counts
    written since (the decode step's counts grow each step)."""
    from vlgrpo.rollout import decode_attention

    assert decode_attention.serves("cuda", torch.bfloat16, 128)
    for case in CASES:
        q, k, v, starts, counts, expected = decode_case(case, "cuda", torch.bfloat16)
        out = decode_attention.rows_attention(q, k, v, starts, counts, q.shape[-1] ** -0.5)
        assert (out.float() - expected).abs().max() < 2e-2, (case, (out.float() - expected).abs().max())
    q, k, v, starts, counts, early = decode_case(CASES[0], "cuda", torch.bfloat16)
    *_, later = decode_case(CASES[0][:-1] + (100,), "cuda", torch.bfloat16)  # the same cache, 100 tokens fed
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention.rows_attention(q, k, v, starts, counts, 128**-0.5)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = decode_attention.rows_attention(q, k, v, starts, counts, 128**-0.5)
    counts += 100 - CASES[0][-1]
    graph.replay()
    assert (captured.float() - later).abs().max() < 2e-2
    assert (later - early).abs().max() > 0.1  # the replay read the new counts

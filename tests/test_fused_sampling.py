"""The Triton sampling kernel gives keyed_sample_torch's tokens (Triton's interpreter, on the CPU).

TRITON_INTERPRET must be set before Triton compiles anything, so the comparisons run in a child
process. On a GPU the same kernel runs compiled; scripts/sampler_h200.py compares it there.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, math, torch
from vlgrpo.rollout.fused_sampling import keyed_sample_fused
from vlgrpo.rollout.sampling import keyed_sample_torch, row_hash, sample_key

def compare(logits, keys, position, temperature, top_p, banned):
    a, la = keyed_sample_torch(logits, keys, position, temperature, top_p, banned)
    b, lb = keyed_sample_fused(logits, row_hash(keys, position), temperature, top_p, banned)
    return {"same_tokens": int((a == b).sum()), "rows": len(a), "logp_diff": float((la - lb).abs().max())}

g = torch.Generator().manual_seed(11)
rows, vocab = 12, 1500  # vocab not a multiple of the kernel's block
sharpness = torch.linspace(0.3, 8.0, rows)[:, None]  # flat to peaked rows: nuclei of thousands down to one token
banned = torch.zeros(vocab, dtype=torch.bool)
banned[40:60] = True
banned[-7:] = True
keys = torch.tensor([sample_key(5, 2, i, 0) for i in range(rows)])
out = {"cases": []}
for dtype in ("bfloat16", "float32"):
    logits = (torch.randn(rows, vocab, generator=g) * sharpness).to(getattr(torch, dtype))
    settings = ((0.6, 0.95, 0, banned), (1.0, 1.0, torch.tensor([37]), None), (0.0, 1.0, 3, banned),
                (0.7, 0.3, torch.tensor([37]), banned), (1.0, 0.02, 5, None))
    for temperature, top_p, position, ban in settings:
        case = compare(logits, keys, position, temperature, top_p, ban)
        out["cases"].append({"dtype": dtype, "temperature": temperature, "top_p": top_p, **case})

# ties at the nucleus edge all stay: 0.4 / 0.2 / 0.2 / 0.2 with top_p 0.5 keeps all four, 0.3 keeps one
tied = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2])).expand(200, 4).contiguous()
many = torch.tensor([sample_key(9, i) for i in range(200)])
for top_p in (0.5, 0.3):
    tokens, _ = keyed_sample_fused(tied, row_hash(many, 0), 1.0, top_p)
    out[f"tied_{top_p}"] = sorted(set(tokens.tolist()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernel_samples_the_same_tokens_as_the_pytorch_form(child):
    assert len(child["cases"]) == 10
    for case in child["cases"]:
        assert case["same_tokens"] == case["rows"], case
        assert case["logp_diff"] < 2e-6, case


def test_kernel_keeps_every_token_tied_at_the_nucleus_edge(child):
    assert child["tied_0.5"] == [0, 1, 2, 3]
    assert child["tied_0.3"] == [0]


def test_kernels_compile_for_an_h200_without_a_gpu():
    """The interpreter runs what the compiler may reject (a loop-carried value changing shape, say):
    compile each kernel variant for sm_90 ahead of time, as the H200 would, down to its machine code."""
    import triton
    from triton.backends.compiler import GPUTarget

    from vlgrpo.rollout import fused_sampling

    pointers = {"logits_ptr": "*bf16", "row_stride": "i32", "banned_ptr": "*u8", "row_hash_ptr": "*i64",
                "tokens_ptr": "*i64", "logp_ptr": "*fp32", "V": "i32", "temperature": "fp32", "top_p": "fp32"}
    common = {"HAS_BANNED": True, "KEY_BITS": 16, "BLOCK": fused_sampling.BLOCK, "INTERPRET": False}
    variants = [(fused_sampling._sample_kernel, common | {"GREEDY": g, "TOP_P": t}) for g, t in ((False, False), (False, True), (True, False))]
    variants.append((fused_sampling._nucleus_kernel, common))
    for kernel, constants in variants:
        source = triton.compiler.ASTSource(fn=kernel, signature=pointers | dict.fromkeys(constants, "constexpr"), constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], (kernel.fn.__name__, constants)

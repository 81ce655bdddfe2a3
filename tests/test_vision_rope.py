"""The vision rope kernel (vlgrpo.vision_rope) rotates q and k as transformers' apply_rotary_pos_emb_vision
does, to the bit, forward and backward: on the CPU under Triton's interpreter in fp16 (in a child
process: TRITON_INTERPRET must be set before Triton compiles anything; the interpreter rounds to
bf16 its own way), on a GPU compiled, in bf16. A tower with the kernel bound gives the tower's own
output and gradients, for every family whose tower rotates that way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_shared

pytest.importorskip("triton")

# (patches, heads, head_dim): Qwen2(.5)-VL's 80 (not a power of two), Qwen3-VL's 72, and 64;
# patch counts on and off the kernel's 16-patch blocks
SHAPES = [(37, 3, 80), (20, 2, 72), (16, 4, 64)]
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"]  # every family with a tower


def rope_case(shape, device, dtype, seed=0):
    """The qkv GEMM's output (as a leaf), rope angles as a tower makes them, and gradients for q and k."""
    patches, heads, dim = shape
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(patches, 3 * heads * dim, generator=g).to(device, dtype).requires_grad_()
    angles = torch.randn(patches, dim // 2, generator=g) * 5
    emb = torch.cat([angles, angles], -1).to(device)
    grads = [torch.randn(patches, heads, dim, generator=g).to(device, dtype) for _ in range(2)]
    return weight, emb.cos(), emb.sin(), grads


def rope_outputs(shape, device, dtype, fused: bool):
    """q, k and the gradient of sum(q gq + k gk + v) with respect to the qkv output, either way."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    from vlgrpo import vision_rope

    weight, cos, sin, (gq, gk) = rope_case(shape, device, dtype)
    qkv = (weight * 1).view(shape[0], 3, shape[1], shape[2])
    if fused:
        q, k = vision_rope.rotate_qk(qkv, cos, sin)
    else:
        q, k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    grad, = torch.autograd.grad((q * gq).sum() + (k * gk).sum() + qkv[:, 2].float().sum(), weight)
    return q.detach(), k.detach(), grad


def tiny_model(model_type, folder, dtype):
    """A tiny random `model_type` model (tests/families.py's config), the same weights each call."""
    from transformers import AutoConfig

    from families import build
    from vlgrpo import models

    build(model_type, folder, weights=False)
    torch.manual_seed(0)
    return models.model_class(models.family(model_type)).from_config(AutoConfig.from_pretrained(folder), dtype=dtype)


def tower_outputs(model_type, folder, dtype, fused: bool, packed: bool):
    """A tiny `model_type` tower's output and its parameters' gradients, with the kernel bound or not."""
    from vlgrpo import models
    from vlgrpo.attention import PACKED_VISION_ATTENTION
    from vlgrpo.policy import set_fused_vision_rope

    model = tiny_model(model_type, folder, dtype)
    tower = models.vision_tower(model)
    if packed:
        tower.config._attn_implementation = PACKED_VISION_ATTENTION
    set_fused_vision_rope(model, fused)
    bound = sum("forward" in m.__dict__ for m in tower.modules())
    m = tower.spatial_merge_size  # two images of patches, the first over several of Qwen2.5-VL's 8 x 8 windows
    device = next(tower.parameters()).device
    grid = torch.tensor([[1, 6 * m, 4 * m], [1, 2 * m, 3 * m]], device=device)
    width = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(1), device="cpu").to(device, dtype)
    out = tower(pixels, grid_thw=grid).pooler_output
    out.float().square().sum().backward()
    return bound, out.detach(), {n: p.grad for n, p in tower.named_parameters() if p.grad is not None}


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_vision_rope import FAMILIES, SHAPES, rope_outputs, tower_outputs
from vlgrpo import vision_rope
from pathlib import Path

assert vision_rope.serves("cpu", torch.float16) and not vision_rope.serves("cpu", torch.float32)
report = {"rope": [], "towers": []}
for shape in SHAPES:
    plain, fused = (rope_outputs(shape, "cpu", torch.float16, f) for f in (False, True))
    report["rope"].append([torch.equal(a, b) for a, b in zip(plain, fused)] + [fused[0].is_contiguous()])
for model_type in FAMILIES:
    for packed in ((False, True) if model_type == "qwen2_5_vl" else (False,)):
        (_, out, grads), (bound, fast_out, fast_grads) = (
            tower_outputs(model_type, Path(sys.argv[2]) / model_type, torch.float16, f, packed) for f in (False, True))
        report["towers"].append([model_type, packed, bound, torch.equal(out, fast_out), sorted(grads) == sorted(fast_grads),
                                 all(torch.equal(grads[n], fast_grads[n]) for n in grads)])
print(json.dumps(report))
"""


@needs_shared("qwen2_vl_2b", "qwen2_5_vl_7b", "qwen3_vl_4b", "qwen3_5_0_8b")
def test_the_kernel_rotates_as_transformers_to_the_bit_under_the_interpreter(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(tmp_path)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rope"] == [[True] * 4] * len(SHAPES)  # q, k, the gradient equal; q contiguous as transformers'
    # every tower's 2 attention modules bound; its output and every parameter's gradient equal
    assert report["towers"] == [[f, p, 2, True, True, True] for f in FAMILIES for p in ((False, True) if f == "qwen2_5_vl" else (False,))]


def test_the_kernel_compiles_for_an_h100_without_fused_multiply_adds():
    """Compiled for sm_90 ahead of time, as a GPU would (the interpreter runs what the compiler may reject):
    its float32 products and sums stay separate instructions, each rounded, as PyTorch's kernels round them."""
    import triton
    from triton.backends.compiler import GPUTarget

    from vlgrpo import vision_rope

    pointers = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"}
    sizes = dict.fromkeys(["patches", "heads", "x_row", "x_part", "x_head", "out_row", "out_part", "out_head", "cs_row"], "i32")
    for backward in (False, True):
        constants = {"D": 80, "BLOCK_D": 128, "BLOCK_S": vision_rope.BLOCK_S, "BACKWARD": backward}
        source = triton.compiler.ASTSource(fn=vision_rope._rope_kernel, signature=pointers | sizes | dict.fromkeys(constants, "constexpr"),
                                           constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
        assert compiled.asm["cubin"] and "mul.rn.f32" in compiled.asm["ptx"] and "fma.rn.f32" not in compiled.asm["ptx"], backward


@needs_shared("qwen2_5_vl_7b")
def test_the_towers_rotate_as_transformers_does_where_the_kernel_does_not_serve(tmp_path):
    """On the CPU (no interpreter) the switch binds nothing, and leaves nothing bound."""
    from vlgrpo import models, vision_rope
    from vlgrpo.policy import set_fused_vision_rope

    model = tiny_model("qwen2_5_vl", tmp_path, torch.bfloat16)
    tower = models.vision_tower(model)
    assert not vision_rope.serves("cpu", torch.bfloat16)
    set_fused_vision_rope(model, True)
    assert not any("forward" in m.__dict__ for m in tower.modules())
    attention = next(m for m in tower.modules() if type(m).__name__.endswith("VisionAttention"))
    attention.forward = "left from before"  # a stale binding is removed where the switch is off
    set_fused_vision_rope(model, False)
    assert "forward" not in attention.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_shared("qwen2_vl_2b", "qwen2_5_vl_7b", "qwen3_vl_4b", "qwen3_5_0_8b")
def test_the_kernel_rotates_as_transformers_to_the_bit_on_cuda(tmp_path):
    """bf16, compiled: the seed tower's shape (16 heads of 80) at ~0.1 M patches, and the tiny towers."""
    for shape in SHAPES + [(100_003, 16, 80)]:
        plain, fused = (rope_outputs(shape, "cuda", torch.bfloat16, f) for f in (False, True))
        assert all(torch.equal(a, b) for a, b in zip(plain, fused)), shape
    for model_type in FAMILIES:
        with torch.device("cuda"):
            (_, out, grads), (bound, fast_out, fast_grads) = (
                tower_outputs(model_type, tmp_path / model_type, torch.bfloat16, f, model_type == "qwen2_5_vl") for f in (False, True))
        assert bound == 2 and torch.equal(out, fast_out) and all(torch.equal(grads[n], fast_grads[n]) for n in grads), model_type

"""Shared fixtures: a small demo experiment (synthetic data, tiny Qwen2.5-VL, filtered splits)."""

import contextlib
import shutil
from pathlib import Path

import pytest
import torch

from vlgrpo import config, models, paths

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def needs_shared(*parts: str):
    """Skip a test whose data under ../shared/data (the real Geometry3K, Qwen files, EasyR1 logs) is absent."""
    missing = [p for p in parts if not (SHARED / p).exists()]
    return pytest.mark.skipif(bool(missing), reason=f"shared data absent: {', '.join(missing)}")

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def demo_base(tmp_path_factory):
    """The demo's data and model, built once per session at test size; an experiment with filtered splits."""
    from vlgrpo.data.filtering import filter_split
    from vlgrpo.demo import make_dataset, make_model

    root = tmp_path_factory.mktemp("demo")
    synth = root / "_demo" / "geometry_synth"
    cfg = config.load(
        ROOT / "config.yaml",
        overrides={
            "results_dir": str(root / "results"),
            "demo": {"out_dir": str(root / "_demo"), "n_train": 64, "n_val": 16, "n_test": 16, "warmup_steps": 30},
            # The tower trains, as in the 3B recipe, so the tests cover its gradients (the demo freezes it).
            "model": {"path": str(root / "_demo" / "tiny_qwen2_5_vl"), "freeze_vision_tower": False},
            "data": {"train": str(synth / "train.parquet"), "val": str(synth / "test.parquet")},
            "trainer": {"max_steps": 10, "save_freq": 5, "val_freq": 5, "stall_timeout_s": 30},
        },
    )
    make_dataset(cfg, synth)
    make_model(cfg, Path(cfg["model"]["path"]))
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split))
    config.write_resolved(cfg, paths.path(paths.RESOLVED, exp))
    return cfg


def make_experiment(base: dict, results_dir: Path, overrides: dict | None = None) -> dict:
    """A fresh experiment folder that shares the base's model and filtered data."""
    cfg = config.validate(config.deep_merge(base, {"results_dir": str(results_dir), **(overrides or {})}))
    src, dst = config.experiment_dir(base) / "data", config.experiment_dir(cfg) / "data"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config.write_resolved(cfg, paths.path(paths.RESOLVED, config.experiment_dir(cfg)))
    return cfg


@contextlib.contextmanager
def text_attention(model, name: str):
    """The language model's attention function set to `name` meanwhile (as prepare_model sets it)."""
    text = models.text_model(model).config
    before, text._attn_implementation = text._attn_implementation, name
    try:
        yield
    finally:
        text._attn_implementation = before


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn's meaning, segment by segment with SDPA (the CPU has no flash
    kernel): (T, heads, D) packed tokens; window (-1, 0) is causal aligned at the end, as FlashAttention's."""
    out = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (x[a:b].transpose(0, 1) for x, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1])))
        assert qi.shape[1] <= max_q and ki.shape[1] <= max_k
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool)
        if window_size == (-1, 0):
            mask = mask.tril(diagonal=ki.shape[1] - qi.shape[1])
        out.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


def reference_rows_attention(query, key, value, starts, counts, scale):
    """rollout.decode_attention.rows_attention's meaning in PyTorch: each row and key/value head's query
    heads (rows, kv_heads, group, D) over the `count` flattened cache places from `start`."""
    group, dim = query.shape[-2:]
    k, v = (x.reshape(-1, dim) for x in (key, value))
    out = [torch.nn.functional.scaled_dot_product_attention(q, k[a:a + n], v[a:a + n], scale=scale)
           for q, a, n in zip(query.reshape(-1, group, dim), starts.tolist(), counts.tolist())]
    return torch.stack(out).view_as(query)


@contextlib.contextmanager
def own_keys_decode():
    """The static decode step as on a GPU in bf16: each row's own keys (the kernel's layout), attended
    meanwhile by reference_rows_attention."""
    from vlgrpo.rollout import decode_attention

    before = decode_attention.serves, decode_attention.rows_attention
    decode_attention.serves, decode_attention.rows_attention = (lambda *args: True), reference_rows_attention
    try:
        yield
    finally:
        decode_attention.serves, decode_attention.rows_attention = before


@contextlib.contextmanager
def varlen_layout():
    """Packed prefix rows laid out for flash varlen calls (as on CUDA in bf16), run meanwhile by reference_varlen."""
    from vlgrpo import attention

    before = attention.flash_varlen_serves, attention.varlen_attn
    attention.flash_varlen_serves, attention.varlen_attn = (lambda device_type, dtype: True), reference_varlen
    try:
        yield
    finally:
        attention.flash_varlen_serves, attention.varlen_attn = before

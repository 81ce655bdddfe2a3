"""The optimizer strategies learn at lr 1e-6 in bf16, resume bitwise, and the warm-up equals EasyR1's."""

import copy
import io
import json
import math

import pytest
import torch

from vlgrpo import optim
from vlgrpo.optim import KahanAdamW, MasterAdamW, build_optimizer, lr_at

HYPER = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}  # EasyR1's examples/config.yaml


def optim_cfg(**optim_overrides) -> dict:
    optim_cfg = {"strategy": "adamw_bf16", "lr": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2,
                 "lr_warmup_steps": None, "lr_warmup_ratio": 0.0, "lr_scheduler_type": "constant", "min_lr_ratio": None,
                 **optim_overrides}
    return {"worker": {"actor": {"optim": optim_cfg}}}


def run(make_optimizer, weights: torch.Tensor, grad: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` updates of a copy of `weights` with the same gradient each step; the final weights."""
    param = torch.nn.Parameter(weights.clone())
    optimizer = make_optimizer([param])
    for _ in range(steps):
        param.grad = grad.to(param.dtype)
        optimizer.step()
    return param.detach()


@pytest.fixture(scope="module")
def lr_1e6_runs() -> dict:
    """A bf16 tensor ~ N(0, 0.02) after 200 steps at lr 1e-6 with a fixed gradient, per optimizer."""
    generator = torch.Generator().manual_seed(0)
    w0 = (torch.randn(65536, generator=generator) * 0.02).to(torch.bfloat16)
    grad = torch.randn(65536, generator=generator)
    return {
        "w0": w0,
        "fp32": run(lambda p: torch.optim.AdamW(p, **HYPER), w0.float(), grad, 200),
        "adamw": run(lambda p: MasterAdamW(p, **HYPER), w0, grad, 200),
        "adamw_bf16": run(lambda p: KahanAdamW(p, **HYPER), w0, grad, 200),
        "torch_bf16": run(lambda p: torch.optim.AdamW(p, **HYPER), w0, grad, 200),
    }


def test_adamw_master_weights_end_within_half_a_bf16_ulp_of_fp32(lr_1e6_runs):
    fp32, bf16 = lr_1e6_runs["fp32"], lr_1e6_runs["adamw"]
    assert bf16.dtype == torch.bfloat16
    nearest = fp32.to(torch.bfloat16)
    half_ulp = (torch.nextafter(nearest.abs(), torch.tensor(float("inf"), dtype=torch.bfloat16)) - nearest.abs()).float() / 2
    assert ((bf16.float() - fp32).abs() <= half_ulp).all()


def relative_change_error(run: torch.Tensor, runs: dict) -> float:
    delta32 = runs["fp32"] - runs["w0"].float()
    return float((run.float() - runs["w0"].float() - delta32).norm() / delta32.norm())


def test_adamw_bf16_keeps_the_change_that_plain_bf16_adamw_rounds_away(lr_1e6_runs):
    delta32 = lr_1e6_runs["fp32"] - lr_1e6_runs["w0"].float()
    assert delta32.abs().mean() > 1.5e-4  # Adam moves each weight ~lr per step: 200 steps ~ 2e-4
    assert relative_change_error(lr_1e6_runs["adamw_bf16"], lr_1e6_runs) <= 0.25
    # torch's AdamW on bf16 weights: the update is below half an ulp for nearly every weight, so
    # only weights near 0 move (by whole ulps) and along the fp32 change less than 10% remains.
    plain = lr_1e6_runs["torch_bf16"].float() - lr_1e6_runs["w0"].float()
    assert (plain != 0).float().mean() < 0.05
    assert (plain * delta32).sum() / delta32.square().sum() < 0.1
    assert relative_change_error(lr_1e6_runs["torch_bf16"], lr_1e6_runs) > 0.9


def test_chunked_steps_equal_one_launch(monkeypatch):
    """Chunking (CHUNK_NUMEL) and grouping by dtype change nothing: bitwise the same weights and state."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32,), (16, 16, 4), (8,)]
    weights = [torch.randn(s, generator=generator).to(torch.bfloat16) for s in shapes]
    weights[1] = weights[1].float()  # a mixed-dtype model: a float32 norm among bf16 weights
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]

    def final(cls, chunk):
        monkeypatch.setattr(optim, "CHUNK_NUMEL", chunk)
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = cls(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(p.dtype)
            opt.step()
        return params, opt.state_dict()["state"]

    for cls in (KahanAdamW, MasterAdamW):
        (p_one, s_one), (p_many, s_many) = final(cls, 2**28), final(cls, 100)
        assert all(torch.equal(a, b) for a, b in zip(p_one, p_many))
        assert all(torch.equal(s_one[i][k], s_many[i][k]) for i in s_one for k in s_one[i])


def bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(torch.bfloat16)


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(100 + step)  # the batch is a function of the step, as in the trainer
        model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("strategy, state_dtypes", [
    ("adamw", {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master": torch.float32}),
    ("adamw_bf16", {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "compensation": torch.bfloat16}),
])
def test_resume_from_state_dict_is_bitwise_exact(strategy, state_dtypes):
    """6 steps straight == 3 steps, save weights and optimizer.state_dict() (torch.save), load both into
    a new model and optimizer, 3 more steps: bitwise equal weights and optimizer state, state dtypes kept."""
    cfg = optim_cfg(strategy=strategy, lr=1e-3)
    straight = bf16_model()
    straight_opt = build_optimizer(cfg, straight)
    train(straight, straight_opt, range(6))

    first = bf16_model()
    first_opt = build_optimizer(cfg, first)
    train(first, first_opt, range(3))
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed = bf16_model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = build_optimizer(cfg, resumed)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    for state in resumed_opt.state.values():
        assert {k: v.dtype for k, v in state.items() if k != "step"} == state_dtypes
    train(resumed, resumed_opt, range(3, 6))

    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(straight_opt.state.values(), resumed_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Something moved, and the master weights are more than their bf16 rounding.
    assert not torch.equal(straight[0].weight, bf16_model()[0].weight)
    if strategy == "adamw":
        master = straight_opt.state[straight[0].weight]["master"]
        assert torch.equal(master.to(torch.bfloat16), straight[0].weight) and not torch.equal(master, straight[0].weight.float())


def test_distributed_checkpoint_state_dict_keeps_the_extra_state():
    """torch.distributed.checkpoint's state-dict helpers (what DCP saves) carry the master weights
    and compensation by parameter name and restore them, fp32 stays fp32."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for strategy, extra in (("adamw", "master"), ("adamw_bf16", "compensation")):
        cfg = optim_cfg(strategy=strategy, lr=1e-3)
        model = bf16_model()
        opt = build_optimizer(cfg, model)
        train(model, opt, range(2))
        state = get_optimizer_state_dict(model, opt)
        assert extra in state["state"]["0.weight"]
        other = copy.deepcopy(model)
        other_opt = build_optimizer(cfg, other)
        set_optimizer_state_dict(other, other_opt, copy.deepcopy(state))
        for a, b in zip(opt.state.values(), other_opt.state.values()):
            assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_build_optimizer_picks_the_strategy():
    bf16 = bf16_model()
    assert type(build_optimizer(optim_cfg(strategy="adamw_bf16"), bf16)) is KahanAdamW
    assert type(build_optimizer(optim_cfg(strategy="adamw"), bf16)) is MasterAdamW
    fp32 = bf16_model().float()
    assert type(build_optimizer(optim_cfg(strategy="adamw"), fp32)) is torch.optim.AdamW  # master = the weights
    group = build_optimizer(optim_cfg(strategy="adamw", eps=1e-6, betas=[0.8, 0.9], weight_decay=0.5), fp32).param_groups[0]
    assert (group["eps"], group["betas"], group["weight_decay"]) == (1e-6, (0.8, 0.9), 0.5)
    frozen = bf16_model()
    frozen[1].requires_grad_(False)
    assert len(build_optimizer(optim_cfg(), frozen).param_groups[0]["params"]) == 4


def easyr1_schedule(factor, steps: int, lr: float) -> list[float]:
    """EasyR1's lr per training step: a LambdaLR with `factor`, read (get_last_lr) for the update, then
    stepped once per training step (verl/workers/fsdp_workers.py)."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    return out


def easyr1_lrs(warmup: int, steps: int, lr: float) -> list[float]:
    """get_constant_schedule_with_warmup's factor."""
    return easyr1_schedule(lambda k: min(1.0, k / max(1, warmup)) if k < warmup else 1.0, steps, lr)


@pytest.mark.parametrize("warmup_steps, warmup_ratio, total", [(None, 0.0, 10), (0, 0.0, 10), (1, 0.0, 10), (4, 0.0, 10),
                                                               (None, 0.1, 30), (None, 0.25, 30), (None, 0.5, 7)])
def test_warmup_equals_easyr1_to_the_step(warmup_steps, warmup_ratio, total):
    cfg = optim_cfg(lr=1e-6, lr_warmup_steps=warmup_steps, lr_warmup_ratio=warmup_ratio)
    warmup = warmup_steps if warmup_steps is not None else int(warmup_ratio * total)  # EasyR1's rule
    assert optim.warmup_steps(cfg, total) == warmup
    assert [lr_at(cfg, step, total) for step in range(1, total + 1)] == easyr1_lrs(warmup, total, 1e-6)
    if warmup:
        assert lr_at(cfg, 1, total) == 0.0  # the first update's factor counts from 0


def easyr1_cosine_lrs(warmup: int, steps: int, lr: float, min_lr_ratio: float) -> list[float]:
    """get_cosine_schedule_with_warmup's factor (num_cycles 0.5, init_lr_ratio 0), worked out from its lambda."""

    def factor(k):
        if k < warmup:
            return k / max(1, warmup)
        progress = (k - warmup) / max(1, steps - warmup)
        return max(min_lr_ratio, math.cos(math.pi * 0.5 * 2.0 * progress) * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)

    return easyr1_schedule(factor, steps, lr)


@pytest.mark.parametrize("warmup_ratio, total, min_lr_ratio", [(0.0, 10, None), (0.2, 10, 0.1), (0.5, 7, 0.5), (0.0, 1, 0.0)])
def test_cosine_schedule_equals_easyr1_to_the_step(warmup_ratio, total, min_lr_ratio):
    cfg = optim_cfg(lr=1e-6, lr_warmup_ratio=warmup_ratio, lr_scheduler_type="cosine", min_lr_ratio=min_lr_ratio)
    expected = easyr1_cosine_lrs(int(warmup_ratio * total), total, 1e-6, min_lr_ratio or 0.0)
    assert [lr_at(cfg, step, total) for step in range(1, total + 1)] == pytest.approx(expected, rel=1e-12, abs=0)
    # By hand, 10 steps, no warm-up, floor 0: step k's factor is (1 + cos(pi (k - 1) / 10)) / 2
    if (warmup_ratio, total, min_lr_ratio) == (0.0, 10, None):
        assert lr_at(cfg, 1, 10) == 1e-6 and lr_at(cfg, 6, 10) == pytest.approx(0.5e-6) and lr_at(cfg, 10, 10) == pytest.approx(
            1e-6 * (1 + math.cos(math.pi * 0.9)) / 2)


def test_bench_optim_runs_on_the_cpu(tmp_path):
    """scripts/bench_optim.py (the H200 benchmark) on a tiny model: every variant, its state in bytes per parameter."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_optim", ROOT / "scripts" / "bench_optim.py")
    bench_optim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_optim)
    out = tmp_path / "bench_optim.json"
    result = bench_optim.main(["--tiny", "--device", "cpu", "--warmup", "1", "--steps", "5", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    n = result["parameters"]
    variants = result["variants"]
    assert list(variants) == ["torch_adamw_bf16", "adamw_bf16", "adamw", "adamw_fp32"]
    bytes_per_param = {name: v["state_gb"] * 1e9 / n for name, v in variants.items()}
    assert bytes_per_param == pytest.approx({"torch_adamw_bf16": 4, "adamw_bf16": 6, "adamw": 12, "adamw_fp32": 8})
    assert variants["adamw_bf16"]["checkpoint_gb"] * 1e9 == pytest.approx(8 * n)
    assert all(v["ms_per_step"] > 0 for v in variants.values())

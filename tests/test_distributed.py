"""Training on several processes (torchrun, gloo, FSDP2) against one process, on the tiny demo model:
the same gradients, metrics and weights; checkpoints that resume on either count; a rank that dies.

Each multi-process run is torchrun with 2 CPU processes, as a segment on 2 GPUs would run (nccl)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import ROOT, make_experiment
from test_resume import deterministic, weights
from vlgrpo import config, paths
from vlgrpo.checkpoint import CheckpointStore
from vlgrpo.tracking import read_metrics

# Two mini-batches a step, several micro-batches each; Adam's eps large enough that an update is
# linear in the tiny gradients, whose rounding (summed in another order over ranks) could otherwise
# flip the sign of a whole lr-sized step.
OVERRIDES = {"worker": {"actor": {"global_batch_size": 2, "micro_batch_size_per_device_for_update": 6,
                                  "micro_batch_size_per_device_for_experience": 5, "optim": {"eps": 1.0e-4}}}}
WALL_CLOCK_OR_PER_RANK = ("global_seqlen/",)  # tokens per rank: halved on two ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(fault: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}
    return {**clean, "OMP_NUM_THREADS": "1", **(fault or {})}


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]


def train(cfg: dict, end_step: int, nproc: int):
    """One segment of `cfg` to end_step on nproc processes (1: no torchrun, today's path)."""
    exp = config.experiment_dir(cfg)
    args = ["-m", "vlgrpo.segment", "--config", str(paths.path(paths.RESOLVED, exp)), "--end-step", str(end_step),
            "--marker", str(paths.path(paths.MARKER, exp, step=end_step))]
    cmd = [sys.executable, *args] if nproc == 1 else [*torchrun(nproc), *args]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def records(cfg: dict) -> list[dict]:
    return [{k: v for k, v in deterministic(r).items() if not k.startswith(WALL_CLOCK_OR_PER_RANK)}
            for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(cfg))) if r.get("kind") != "val"]


def assert_close_records(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)
        for key in ra:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


def assert_close_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), (name, (a[name] - b[name]).abs().max())


def copy_experiment(cfg: dict, results_dir: Path) -> dict:
    """A copy of an experiment (checkpoints and metrics included) under another results folder."""
    out = config.validate(config.deep_merge(cfg, {"results_dir": str(results_dir)}))
    shutil.copytree(config.experiment_dir(cfg), config.experiment_dir(out))
    config.write_resolved(out, paths.path(paths.RESOLVED, config.experiment_dir(out)))
    return out


def test_gradients_per_parameter_equal_one_process(demo_base, tmp_path):
    """One step, two mini-batches of micro-batches sized by a token budget (so the ranks run different
    numbers of them, padded with zero-weight ones): every parameter's gradient, the root unit's
    (embeddings tied to lm_head, final norm, patch embedding, merger) included, equals 1 process's.
    lr ~0: both mini-batches see the same weights, so only the gradient computation is compared."""
    tiny_lr = {"model": {"gradient_checkpointing": True},  # as the recipe: layers recomputed in backward, gathered again
               # and as on a GPU: prefixes shared, the update's packed rows attended segment by segment
               "worker": {"actor": {**OVERRIDES["worker"]["actor"], "dynamic_batching": True, "prefix_sharing": True,
                                    "optim": {"lr": 1.0e-12, "weight_decay": 0.0}}}}
    cfg = make_experiment(demo_base, tmp_path, tiny_lr)
    resolved = str(paths.path(paths.RESOLVED, config.experiment_dir(cfg)))
    worker = str(ROOT / "tests" / "distributed_worker.py")
    for nproc, out in ((1, tmp_path / "one.pt"), (2, tmp_path / "two.pt")):
        cmd = [sys.executable] if nproc == 1 else torchrun(nproc)
        done = subprocess.run([*cmd, worker, resolved, str(out)], env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert len(one["grads"]) == len(two["grads"]) == 2  # mini-batches
    for a, b in zip(one["grads"], two["grads"]):
        assert set(a) == set(b) and "model.language_model.embed_tokens.weight" in a
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-7), (name, (b[name].norm() / a[name].norm()).item())
    assert two["record"]["global_seqlen/mean"] * 2 == one["record"]["global_seqlen/mean"]


@pytest.mark.slow
def test_two_processes_train_as_one_and_checkpoints_resume_on_either_count(demo_base, tmp_path):
    """3 steps on 2 processes == 3 steps on 1 (metrics and weights within float tolerance); the
    2-process checkpoint continues in 1 process as it does in 2, and the 1-process one in 2."""
    one = make_experiment(demo_base, tmp_path / "one", OVERRIDES)
    two = make_experiment(demo_base, tmp_path / "two", OVERRIDES)
    train(one, 3, 1)
    train(two, 3, 2)
    assert_close_records(records(two), records(one))
    assert_close_weights(weights(two, 3), weights(one, 3))
    balance = read_metrics(paths.path(paths.METRICS, config.experiment_dir(two)))[0]
    assert balance["global_seqlen/balanced_max"] - balance["global_seqlen/balanced_min"] <= balance["global_seqlen/minmax_diff"]

    two_then_one = copy_experiment(two, tmp_path / "two_then_one")
    one_then_two = copy_experiment(one, tmp_path / "one_then_two")
    train(two, 5, 2)  # step 5 is validated in-process: every rank its share of the items
    train(two_then_one, 5, 1)
    train(one_then_two, 5, 2)
    for other in (two_then_one, one_then_two):
        assert_close_records(records(other), records(two))
        assert_close_weights(weights(other, 5), weights(two, 5))
    exp = config.experiment_dir(two)
    assert paths.path(paths.VAL_IN_PROCESS, exp, step=5).is_file()
    assert paths.path(paths.MARKER, exp, step=5).is_file()


@pytest.mark.slow
def test_two_processes_train_lora_adapters_as_one(demo_base, tmp_path):
    """LoRA under FSDP2: 3 steps on 2 processes == 3 steps on 1 (metrics, adapter weights and their
    optimizer state, written by each rank's rows into peft's adapter file); the policy with its
    adapters off is the reference on every rank."""
    from safetensors.torch import load_file

    lora = config.deep_merge(OVERRIDES, {"worker": {"actor": {"model": {"lora": {"rank": 8, "alpha": 16}},
                                                               "optim": {"lr": 1.0e-2}}}})
    one = make_experiment(demo_base, tmp_path / "one", lora)
    two = make_experiment(demo_base, tmp_path / "two", lora)
    train(one, 3, 1)
    train(two, 3, 2)
    assert_close_records(records(two), records(one))
    files = [{f.relative_to(s.path(3)): load_file(f) for f in s.path(3).rglob("*.safetensors")}
             for s in (CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(c))) for c in (one, two))]
    assert set(files[0]) == set(files[1]) and Path("model/adapter_model.safetensors") in files[0]
    for f in files[0]:
        assert_close_weights({k: v for k, v in files[1][f].items() if k != "rng/torch"},
                             {k: v for k, v in files[0][f].items() if k != "rng/torch"})
    adapters = files[0][Path("model/adapter_model.safetensors")]
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())  # they learned


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_job_and_the_retry_finishes_the_same(demo_base, tmp_path):
    """`vlgrpo train` (the rule's command) on 2 CPU processes: rank 1 killed inside step 3 fails the
    job; the retry resumes from checkpoint 1 and ends where an uninterrupted run ends."""
    two = {**OVERRIDES, "trainer": {"n_gpus_per_node": 2}}
    straight = make_experiment(demo_base, tmp_path / "straight", two)
    faulty = make_experiment(demo_base, tmp_path / "faulty", two)

    def vlgrpo_train(cfg, end_step, fault=None):
        resolved = paths.path(paths.RESOLVED, config.experiment_dir(cfg))
        return subprocess.run(["vlgrpo", "train", "--config", str(resolved), "--end-step", str(end_step)],
                              env=env(fault), capture_output=True, text=True, timeout=600)

    assert vlgrpo_train(straight, 3).returncode == 0
    assert vlgrpo_train(faulty, 1).returncode == 0
    killed = vlgrpo_train(faulty, 3, {"VLGRPO_FAULT": "kill@3", "VLGRPO_FAULT_RANK": "1"})
    assert killed.returncode != 0 and "failed" in killed.stderr
    assert f"exitcode  : -{int(signal.SIGKILL)}" in killed.stderr  # torchrun's report: rank 1 was killed
    store = CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(faulty)))
    assert store.latest() == 1 and not paths.path(paths.MARKER, config.experiment_dir(faulty), step=3).exists()
    retried = vlgrpo_train(faulty, 3)
    assert retried.returncode == 0, retried.stderr[-3000:]
    assert_close_records(records(faulty), records(straight))
    assert_close_weights(weights(faulty, 3), weights(straight, 3))


@pytest.mark.slow
def test_a_rank_that_hangs_stalls_the_heartbeat_and_the_watchdog_kills_every_rank(demo_base, tmp_path):
    """Rank 1 stopped (alive, no progress): rank 0 waits for it at the next collective, the heartbeat
    (rank 0's) goes stale, and `vlgrpo train` kills torchrun and both ranks."""
    cfg = make_experiment(demo_base, tmp_path, {**OVERRIDES, "trainer": {"n_gpus_per_node": 2, "stall_timeout_s": 15}})
    resolved = paths.path(paths.RESOLVED, config.experiment_dir(cfg))
    wrapper = subprocess.Popen(["vlgrpo", "train", "--config", str(resolved), "--end-step", "5"],
                               env=env(), stderr=subprocess.PIPE, text=True)
    metrics = paths.path(paths.METRICS, config.experiment_dir(cfg))
    deadline = time.time() + 300
    while time.time() < deadline and not metrics.exists():
        time.sleep(0.5)  # the first step is done: both ranks are really running
    tree = psutil.Process(wrapper.pid).children(recursive=True)
    (rank1,) = [p for p in tree if p.environ().get("RANK") == "1" and "vlgrpo.segment" in " ".join(p.cmdline())]
    rank1.send_signal(signal.SIGSTOP)
    stopped = time.time()
    _, err = wrapper.communicate(timeout=120)
    assert wrapper.returncode != 0 and "no progress" in err
    assert time.time() - stopped < 15 + 30
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["adamw", "adamw_bf16"])
def test_bf16_optimizers_step_on_the_shards(demo_base, tmp_path, strategy):
    """A bf16 model (FSDP2 bf16 parameters, fp32 gradient reduction): fp32 master weights or Kahan
    compensation step each rank's shard, and 2 steps on 2 processes end within bf16 rounding of 1."""
    overrides = config.deep_merge(OVERRIDES, {"model": {"dtype": "bfloat16"}, "worker": {"actor": {"optim": {"strategy": strategy}}}})
    one = make_experiment(demo_base, tmp_path / "one", overrides)
    two = make_experiment(demo_base, tmp_path / "two", overrides)
    train(one, 2, 1)
    train(two, 2, 2)
    a, b = weights(one, 2), weights(two, 2)
    assert next(iter(b.values())).dtype == torch.bfloat16
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=1e-3, rtol=0), name
    for ra, rb in zip(records(one), records(two)):
        assert ra["reward/overall"] == rb["reward/overall"] and ra["response_length/mean"] == rb["response_length/mean"]


@pytest.mark.slow
def test_bench_runs_the_fsdp2_path_under_torchrun_with_one_rank(demo_base, tmp_path):
    """`vlgrpo bench` under torchrun (1 rank: the model sharded with FSDP2 over one process) computes
    the step that the single-process bench computes, with as many static decoders (each gathering
    places the weights anew): the GPU comparison of the two paths runs as is."""
    cfg = yaml.safe_load((ROOT / "configs" / "bench_cpu.yaml").read_text())
    cfg["model"]["path"] = demo_base["model"]["path"]
    cfg["data"]["train"], cfg["data"]["val"] = demo_base["data"]["train"], demo_base["data"]["val"]
    results = {}
    for name, launch in (("single", [sys.executable]), ("torchrun", torchrun(1))):
        cfg["results_dir"] = str(tmp_path / name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        out = tmp_path / f"{name}.json"
        done = subprocess.run([*launch, "-m", "vlgrpo.cli", "bench", "--config", str(path), "--out", str(out),
                               "--warmup", "1", "--steps", "1", "--plain-steps", "1"], env=env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    single, fsdp = results["single"], results["torchrun"]
    assert fsdp["pg_loss"] == pytest.approx(single["pg_loss"], rel=1e-4, abs=1e-6)
    assert fsdp["plain"]["pg_loss"] == pytest.approx(single["plain"]["pg_loss"], rel=1e-4, abs=1e-6)
    assert fsdp["greedy_vs_hf"]["identical_rows"] == fsdp["greedy_vs_hf"]["rows"]
    assert fsdp["eval"]["items"] == single["eval"]["items"] == 16
    # the sharded model's decoder reads its own copy of the weights: no new decoder for their new places
    assert fsdp["static_engine"]["own_weights"] and not single["static_engine"]["own_weights"]
    assert fsdp["static_engine"]["decoders"] == single["static_engine"]["decoders"]


def test_the_segment_command_is_torchrun_for_several_processes():
    from vlgrpo.cli import trainer_command

    base = {"experiment": "x", "trainer": {"n_gpus_per_node": 1, "nnodes": 1, "rdzv_endpoint": None, "always_torchrun": False}}
    args = ["--config", "c.yaml", "--end-step", "5"]
    assert trainer_command(base, args)[1:] == ["-m", "vlgrpo.segment", *args]  # today's single process
    one_rank = trainer_command(config.deep_merge(base, {"trainer": {"always_torchrun": True}}), args)
    assert one_rank[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                            "-m", "vlgrpo.segment", *args]
    one_node = trainer_command(config.deep_merge(base, {"trainer": {"n_gpus_per_node": 4}}), args)
    assert one_node[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "0",
                            "-m", "vlgrpo.segment", *args]
    two_nodes = trainer_command(config.deep_merge(base, {"trainer": {"n_gpus_per_node": 8, "nnodes": 2, "rdzv_endpoint": "n1:29400"}}), args)
    assert two_nodes[3:13] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", "x-5",
                               "--nproc-per-node", "8"]


SAVE_WORKER = """
import sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from test_checkpoint import model_and_optimizer, train
from vlgrpo.checkpoint import CheckpointStore

dist.init_process_group("gloo")
model, optimizer = model_and_optimizer()
train(model, optimizer, 1)
store = CheckpointStore(sys.argv[1])
store.save(5, model, optimizer, None, {"config_hash": "x"})

def disk_full():
    raise OSError("disk full")

saving = store.save_behind(10, model, optimizer, None, {"config_hash": "x"}, before_publish=disk_full)
try:
    saving.result()
except Exception as e:
    print(f"rank {dist.get_rank()} {type(e).__name__}: {e}", flush=True)
dist.barrier()  # both ranks still in step: none waits for rank 0's write
"""


def test_a_failed_write_on_rank_0_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    """Rank 0 writes behind (the other ranks have nothing to write): when its write fails, every rank
    hears so at result() and raises, instead of waiting at a barrier for a rank 0 that left."""
    script = tmp_path / "save_worker.py"
    script.write_text(SAVE_WORKER)
    done = subprocess.run([*torchrun(2), str(script), str(tmp_path / "store"), str(ROOT / "tests")],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 OSError: disk full" in done.stdout
    assert "rank 1 CheckpointError: rank 0 could not write the checkpoint" in done.stdout
    store = CheckpointStore(tmp_path / "store")
    assert store.latest() == 5 and not store.path(10).exists()


SHARDED_WORKER = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
sys.path.insert(0, sys.argv[2])
from test_distributed import sharded_model, sharded_optimizer
from vlgrpo.checkpoint import CheckpointStore

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))

def sharded(seed):
    model = fully_shard(sharded_model(seed, sys.argv[4]), mesh=mesh)
    return model, sharded_optimizer(model, sys.argv[4])

def full(model, optimizer):
    whole = lambda v: v.full_tensor() if isinstance(v, DTensor) else v
    return ({n: whole(p.detach()) for n, p in model.named_parameters()},
            {n: {k: whole(optimizer.state[p][k]) for k in sorted(optimizer.state[p])} for n, p in model.named_parameters()})

model, optimizer = sharded(0)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.arange(12).reshape(3, 4)).square().mean().backward()
    optimizer.step()
store = CheckpointStore(sys.argv[1], threads=2)
store.save(2, model, optimizer, None, {"config_hash": "x"})
saved = full(model, optimizer)
if dist.get_rank() == 0:
    torch.save(saved, sys.argv[3])
other, other_optimizer = sharded(1)
store.load(2, other, other_optimizer)
loaded = full(other, other_optimizer)
same = all(torch.equal(saved[0][n], loaded[0][n]) for n in saved[0]) and all(
    torch.equal(saved[1][n][k], loaded[1][n][k]) for n in saved[1] for k in saved[1][n])
# torch's AdamW casts loaded state to the parameter's dtype; vlgrpo's optimizers keep what was saved.
same = same and (sys.argv[4] != "master" or all(saved[1][n][k].dtype == loaded[1][n][k].dtype for n in saved[1] for k in saved[1][n]))
print(f"rank {dist.get_rank()} reloaded exactly: {same}", flush=True)
"""


def sharded_model(seed: int, optimizer: str) -> torch.nn.Module:
    """Rows that two ranks split unevenly (50: 25 + 25; 3: 2 + 1; 1: 1 + none), lm_head tied to the
    embeddings; bf16 for vlgrpo's MasterAdamW (fp32 master weights in its state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50), torch.nn.Linear(50, 3), torch.nn.Linear(3, 1))
    model[1].weight = model[0].weight
    return model.to(torch.bfloat16) if optimizer == "master" else model


def sharded_optimizer(model, optimizer: str) -> torch.optim.Optimizer:
    from test_checkpoint import KahanAdamW
    from vlgrpo.optim import MasterAdamW

    if optimizer == "master":
        return MasterAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    return KahanAdamW(model.parameters(), lr=1e-2)  # torch's AdamW with a bf16 tensor more


@pytest.mark.parametrize("optimizer", ["torch", "master"])
def test_each_rank_writes_and_reads_its_own_rows_of_the_whole_tensors(tmp_path, optimizer):
    """2 ranks save an FSDP2-sharded model and its optimizer, each writing only its rows (no gather),
    into files of whole tensors: one process loads them bit for bit as the ranks held them (fp32
    master weights of bf16 parameters stay fp32), and the 2 ranks read them back exactly."""
    script = tmp_path / "sharded_worker.py"
    script.write_text(SHARDED_WORKER)
    done = subprocess.run([*torchrun(2), str(script), str(tmp_path / "store"), str(ROOT / "tests"), str(tmp_path / "full.pt"),
                           optimizer], env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 reloaded exactly: True" in done.stdout and "rank 1 reloaded exactly: True" in done.stdout
    store = CheckpointStore(tmp_path / "store")
    assert store.verify(2) is None  # the manifest's CRC-32s, combined from both ranks' pieces, are the files'
    weights, state = torch.load(tmp_path / "full.pt")
    model = sharded_model(1, optimizer)
    one = sharded_optimizer(model, optimizer)
    store.load(2, model, one)
    assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        assert one.state[p].keys() == state[n].keys()
        for k in state[n]:
            assert torch.equal(one.state[p][k], state[n][k]), (n, k)
            assert one.state[p][k].dtype == state[n][k].dtype or optimizer == "torch", (n, k)  # torch casts to the parameter's
    if optimizer == "master":
        assert state["0.weight"]["master"].dtype == torch.float32 and weights["0.weight"].dtype == torch.bfloat16


def test_checkpoint_benchmark_saves_and_loads_on_two_ranks(tmp_path):
    """scripts/bench_checkpoint.py under torchrun: both ranks save and load; rank 0's JSON has the figures."""
    out = tmp_path / "bench.json"
    done = subprocess.run([*torchrun(2), str(ROOT / "scripts" / "bench_checkpoint.py"), "--dir", str(tmp_path / "store"),
                           "--layers", "3", "--width", "64", "--reps", "2", "--out", str(out)],
                          env={**env(), "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["torchrun"] and len(result["reps"]) == 2
    assert all(0 <= r["save_foreground_s"] <= r["save_s"] and r["load_s"] > 0 for r in result["reps"])
    assert result["checkpoint_bytes"] > 3 * 64 * 64 * 2 * 3  # weights and both moments, bf16
    assert CheckpointStore(tmp_path / "store").verify(1) is None

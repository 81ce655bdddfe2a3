"""Segments, checkpoints and faults on the tiny demo model: exact resume, atomic checkpoints, watchdog,
non-finite updates."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from vlgrpo import val_results

from conftest import make_experiment
from vlgrpo import config, evaluate, locks, paths
from vlgrpo.checkpoint import CheckpointStore, model_tensors
from vlgrpo.policy import load_model
from vlgrpo.tracking import read_metrics
from vlgrpo import trainer as trainer_module
from vlgrpo.trainer import GRPOTrainer, NonFiniteError, run_segment


def train(cfg, end_step, fault=None):
    """Run one segment in its own process, as the workflow does; return its exit status."""
    exp = config.experiment_dir(cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}
    if fault:
        env["VLGRPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "vlgrpo.trainer", "--config", str(paths.path(paths.RESOLVED, exp)),
           "--end-step", str(end_step), "--marker", str(paths.path(paths.MARKER, exp, step=end_step))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def deterministic(record):
    """A step's metrics without wall-clock figures."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


def weights(cfg, step):
    folder = CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(cfg))).model_dir(step)
    return {k: v for f in sorted(folder.glob("model-*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_resume_is_exact(demo_base, tmp_path):
    """10 steps straight == 5 + 5 in two processes == killed inside step 7 (and again while saving
    step 10) and rerun: identical per-step metrics and bitwise identical final weights."""
    straight = make_experiment(demo_base, tmp_path / "straight", {"trainer": {"save_freq": 10}})
    assert train(straight, 10).returncode == 0

    halves = make_experiment(demo_base, tmp_path / "halves")
    assert train(halves, 5).returncode == 0
    assert train(halves, 10).returncode == 0

    faulty = make_experiment(demo_base, tmp_path / "faulty")
    assert train(faulty, 5).returncode == 0
    killed = train(faulty, 10, fault="kill@7")
    assert killed.returncode == -signal.SIGKILL
    store = CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(faulty)))
    assert store.latest() == 5
    killed = train(faulty, 10, fault="kill_in_save@10")
    assert killed.returncode == -signal.SIGKILL
    # The half-written checkpoint is invisible: tracker and step 5 are intact.
    assert json.loads((store.root / "latest.json").read_text())["step"] == 5
    assert store.verify(5) is None and store.latest() == 5
    assert not store.path(10).exists()
    assert train(faulty, 10).returncode == 0
    assert store.latest() == 10

    runs = [straight, halves, faulty]
    metrics = [[deterministic(r) for r in read_metrics(paths.path(paths.METRICS, config.experiment_dir(c)))] for c in runs]
    assert [r["step"] for r in metrics[0]] == list(range(1, 11))
    assert metrics[1] == metrics[0]
    assert metrics[2] == metrics[0]
    final = [weights(c, 10) for c in runs]
    for name, tensor in final[0].items():
        assert torch.equal(final[1][name], tensor), name
        assert torch.equal(final[2][name], tensor), name
    # Something was learned: the weights moved from the base model.
    cpu = torch.device("cpu")
    base = model_tensors(load_model(straight["model"]["path"], config.for_device(straight, cpu)["model"], cpu, trainable=False))
    assert any(not torch.equal(base[n], t) for n, t in final[0].items())

    # A forced rerun of a finished segment does not retrain.
    before = paths.path(paths.METRICS, config.experiment_dir(halves)).read_text()
    assert train(halves, 5).returncode == 0
    assert paths.path(paths.METRICS, config.experiment_dir(halves)).read_text() == before
    marker = json.loads(paths.path(paths.MARKER, config.experiment_dir(halves), step=10).read_text())
    assert marker["end_step"] == 10 and marker["start_step"] == 5
    assert set(marker["timing_s"]) == {"startup", "build_model", "load_checkpoint", "train", "save_checkpoint", "save_checkpoint_behind",
                                       "validation", "prune"}  # step 10 ends the run: it prunes after its save
    assert marker["validated_in_process"]
    timed = read_metrics(paths.path(paths.METRICS, config.experiment_dir(halves)))[-1]
    assert timed["step"] == 10 and timed["timing_s/save_checkpoint"] == marker["timing_s"]["save_checkpoint"]
    assert timed["timing_s/validation_generation"] > 0


def test_checkpoint_write_is_atomic_and_retention_keeps_what_validation_needs(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"save_freq": 2, "val_freq": 4, "keep_checkpoints": 1, "max_steps": 6}})
    t = GRPOTrainer(cfg)
    t.load(0)
    store = t.store
    assert store.latest() is None
    for step in (2, 4, 6):
        t.save(step, "run").result()
    assert store.latest() == 6 and store.state(6)["wandb_run_id"] == "run"
    from vlgrpo.checkpoint import apply_retention

    def retain():
        apply_retention(cfg, 6, lambda s: val_results.is_validated(cfg, s))

    retain()
    # keep 1 whole checkpoint (6); step 4 awaits validation: its weights stay; step 2 is never validated.
    assert store.steps() == [4, 6]
    assert any(store.model_dir(4).glob("model-*.safetensors")) and not (store.path(4) / "optim").exists()
    assert store.verify(6) is None
    # An in-process validation made with other settings does not count; one made with these does.
    exp = config.experiment_dir(cfg)
    stash = paths.path(paths.VAL_IN_PROCESS, exp, step=4)
    stash.parent.mkdir(parents=True)
    paths.path(paths.GENERATIONS_IN_PROCESS, exp, step=4).write_text("")
    stash.write_text(json.dumps({"eval_key": "other"}))
    retain()
    assert store.steps() == [4, 6]
    stash.write_text(json.dumps({"eval_key": val_results.eval_key(cfg)}))
    retain()
    assert store.steps() == [6]
    assert val_results.adopt(cfg, 4) == {"eval_key": val_results.eval_key(cfg)}
    assert paths.path(paths.VAL, exp, step=4).is_file() and not stash.exists()
    # The saved model loads back through from_pretrained (validation and export use it).
    from vlgrpo.policy import load_model

    model = load_model(store.model_dir(6), t.cfg["model"], torch.device("cpu"), trainable=False)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in t.policy.parameters())


def test_a_segment_prunes_what_the_last_one_left_while_it_trains_and_the_last_segment_after_its_save(demo_base, tmp_path, monkeypatch):
    """keep_checkpoints 1: the checkpoint a segment resumed from stays on disk when it ends (beside its
    own), and is deleted while the next segment trains, before that one saves; the run's last segment
    prunes after its save (timing_s/prune)."""
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"max_steps": 3, "save_freq": 1, "val_freq": 5, "keep_checkpoints": 1}})
    exp = config.experiment_dir(cfg)
    store = CheckpointStore(paths.path(paths.CHECKPOINTS, exp))
    at_save = []
    save = GRPOTrainer.save
    monkeypatch.setattr(GRPOTrainer, "save", lambda self, step, run_id: at_save.append(store.steps()) or save(self, step, run_id))
    markers = {}
    for end in (1, 2, 3):
        markers[end] = run_segment(cfg, end, paths.path(paths.MARKER, exp, step=end))
        if end < 3:
            assert store.steps() == list(range(1, end + 1))[-2:]  # the one resumed from is still there
    assert at_save == [[], [1], [2]]  # each segment's save found only the checkpoint it resumed from
    assert store.steps() == [3] and store.verify(3) is None
    assert "prune" in markers[3]["timing_s"] and not any("prune" in markers[e]["timing_s"] for e in (1, 2))


def test_a_retention_that_fails_behind_the_training_loses_no_step(demo_base, tmp_path, monkeypatch, caplog):
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"max_steps": 3, "save_freq": 1, "val_freq": 5, "keep_checkpoints": 1}})
    exp = config.experiment_dir(cfg)
    run_segment(cfg, 1, paths.path(paths.MARKER, exp, step=1))

    def fail(*args):
        raise PermissionError("read-only store")

    monkeypatch.setattr(trainer_module, "apply_retention", fail)
    marker = run_segment(cfg, 2, paths.path(paths.MARKER, exp, step=2))
    assert marker["end_step"] == 2 and CheckpointStore(paths.path(paths.CHECKPOINTS, exp)).latest() == 2
    assert "retention failed (PermissionError: read-only store)" in caplog.text


def test_in_process_validation_is_keyed_on_the_resolved_file_not_the_device_values(demo_base, tmp_path, monkeypatch):
    # The trainer sets `auto` switches for its device; on a GPU those differ from the file's `auto`, and
    # a result keyed on them was never adopted by the evaluate rule (which reads the file): every
    # checkpoint was validated twice and its weights kept for it.
    cfg = make_experiment(demo_base, tmp_path, {})
    assert val_results.eval_key(config.for_device(cfg, "cuda")) != val_results.eval_key(cfg)
    t = GRPOTrainer(cfg)
    t.load(0)
    seen = []
    monkeypatch.setattr(evaluate, "evaluate", lambda c, step, **kw: seen.append(c))
    t.step(1)
    t.validate(5)
    assert seen == [cfg]  # the settings as the file holds them, `auto` kept
    # Generation gets the memory the segment no longer needs; the optimizer state stays for the
    # checkpoint being written behind the validation.
    assert t.ref is None and t.optimizer.state and all(p.grad is None for p in t.policy.parameters())


def test_nonfinite_update_is_skipped_then_aborts(demo_base, tmp_path, monkeypatch):
    monkeypatch.setenv("VLGRPO_FAULT", "nonfinite@1")
    cfg = make_experiment(demo_base, tmp_path / "a", {"trainer": {"max_nonfinite_steps": 2}})
    t = GRPOTrainer(cfg)
    t.load(0)
    before = {n: p.detach().clone() for n, p in t.policy.named_parameters()}
    record = t.step(1)
    assert record["actor/nonfinite_skipped"] == 1
    assert all(torch.equal(p, before[n]) for n, p in t.policy.named_parameters())
    assert t.step(2)["actor/nonfinite_skipped"] == 0

    monkeypatch.setenv("VLGRPO_FAULT", "nonfinite@1")
    cfg = make_experiment(demo_base, tmp_path / "b", {"trainer": {"max_nonfinite_steps": 1}})
    with pytest.raises(NonFiniteError, match="1 non-finite updates in a row"):
        run_segment(cfg, 5, paths.path(paths.MARKER, config.experiment_dir(cfg), step=5))
    assert not paths.path(paths.MARKER, config.experiment_dir(cfg), step=5).exists()


def test_watchdog_kills_a_stalled_segment(demo_base, tmp_path):
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"stall_timeout_s": 15}})
    resolved = paths.path(paths.RESOLVED, config.experiment_dir(cfg))
    wrapper = subprocess.Popen(
        ["vlgrpo", "train", "--config", str(resolved), "--end-step", "5"], stderr=subprocess.PIPE, text=True
    )
    heartbeat = paths.path(paths.HEARTBEAT, config.experiment_dir(cfg))
    deadline = time.time() + 120
    while time.time() < deadline and not paths.path(paths.METRICS, config.experiment_dir(cfg)).exists():
        time.sleep(0.5)  # wait for the first finished step: the trainer is really running
    (child,) = psutil.Process(wrapper.pid).children()
    child.send_signal(signal.SIGSTOP)  # a hung process: alive, no progress
    stopped = time.time()
    _, err = wrapper.communicate(timeout=60)
    assert wrapper.returncode != 0
    assert "no progress" in err and "stall_timeout_s=15" in err
    assert time.time() - stopped < 15 + 10
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE
    assert heartbeat.exists()


def test_one_trainer_per_experiment_and_none_outlives_its_watchdog(demo_base, tmp_path, monkeypatch):
    """kill -9 of `vlgrpo train` used to leave its trainer running beside the retry's."""
    cfg = make_experiment(demo_base, tmp_path)
    exp = config.experiment_dir(cfg)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}, "VLGRPO_FAULT": "stall@1"}
    wrapper = subprocess.Popen(["vlgrpo", "train", "--config", str(paths.path(paths.RESOLVED, exp)), "--end-step", "5"],
                               env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and locks.trainer_holder(exp) is None:
        time.sleep(0.5)
    (child,) = psutil.Process(wrapper.pid).children()
    assert locks.trainer_holder(exp)["pid"] == child.pid
    monkeypatch.setattr(locks, "TRAINER_LOCK_WAIT_S", 1.0)
    with pytest.raises(locks.TrainerBusyError, match=f"another trainer of {exp} runs: process {child.pid}"):
        run_segment(cfg, 5, paths.path(paths.MARKER, exp, step=5))
    wrapper.kill()
    wrapper.wait()
    child.wait(timeout=10)  # the trainer died with its watchdog (psutil raises TimeoutExpired otherwise)
    assert locks.trainer_holder(exp) is None
    assert not paths.path(paths.MARKER, exp, step=5).exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["adamw", "adamw_bf16"])
def test_bf16_resume_is_exact_with_each_optimizer(demo_base, tmp_path, strategy):
    """A bf16 model: 4 steps straight == 2 steps, checkpoint, a new trainer resumed from it, 2 more:
    bitwise identical weights and optimizer state (master weights or Kahan compensation included)."""
    overrides = {"model": {"dtype": "bfloat16"}, "worker": {"actor": {"optim": {"strategy": strategy}}}}
    straight = GRPOTrainer(make_experiment(demo_base, tmp_path / "straight", overrides))
    straight.load(0)
    records = [deterministic(straight.step(step)) for step in range(1, 5)]

    first = GRPOTrainer(make_experiment(demo_base, tmp_path / "halves", overrides))
    first.load(0)
    resumed_records = [deterministic(first.step(step)) for step in (1, 2)]
    first.save(2, "run").result()
    resumed = GRPOTrainer(first.cfg)
    resumed.load(2)
    resumed_records += [deterministic(resumed.step(step)) for step in (3, 4)]

    assert resumed_records == records
    assert next(resumed.policy.parameters()).dtype == torch.bfloat16
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name
    extra = {"adamw": "master", "adamw_bf16": "compensation"}[strategy]
    trained = [(pa, pb) for pa, pb in zip(straight.policy.parameters(), resumed.policy.parameters()) if pa.requires_grad]
    for pa, pb in trained:  # state by parameter, not by the dicts' insertion order
        a, b = straight.optimizer.state[pa], resumed.optimizer.state[pb]
        assert extra in b and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)

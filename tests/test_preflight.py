"""Mistakes stop a run before any job, with one line; a job that fails on a user error fails once;
small input problems say what they are (issue 28, items 7 and 8)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import make_experiment
from vlgrpo import config, locks, paths
from vlgrpo.data import sources
from vlgrpo.data.sources import DataError, load_split
from vlgrpo.trainer import run_segment

ROOT = Path(__file__).resolve().parents[1]


def resolved(tmp_path, **overrides) -> Path:
    """A resolved demo config in tmp_path (no data or model made: the checks need neither)."""
    cfg = config.load(ROOT / "config.yaml", overrides={"results_dir": str(tmp_path / "results"), **overrides})
    path = paths.path(paths.RESOLVED, config.experiment_dir(cfg))
    config.write_resolved(cfg, path)
    return path


def check(path: Path, *extra: str):
    return subprocess.run([sys.executable, "-m", "vlgrpo.cli", "check", "--config", str(path), *extra],
                          capture_output=True, text=True)


def reward(tmp_path, text: str) -> str:
    file = tmp_path / "my_reward.py"
    file.write_text(text)
    return f"{file}:score"


def test_a_reward_file_with_a_syntax_error_or_without_the_function_stops_with_one_line(tmp_path):
    broken = reward(tmp_path, "def score(response, ground_truth:\n    return {}\n")
    out = check(resolved(tmp_path, worker={"reward": {"reward_function": broken}}))
    assert out.returncode == 1
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("vlgrpo check: ")]
    assert f"'{broken}': SyntaxError" in line and "my_reward.py, line 1" in line
    named = reward(tmp_path, "def other(response, ground_truth):\n    return {}\n")
    out = check(resolved(tmp_path, worker={"reward": {"reward_function": named}}))
    assert out.returncode == 1 and "no function 'score'; functions there: other" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_reward_is_called_on_real_answers_at_the_check(tmp_path):
    (tmp_path / "data").mkdir()
    pd.DataFrame({"images": [[]], "problem": ["p"], "answer": ["42"]}).to_parquet(tmp_path / "data" / "train.parquet")
    seen = tmp_path / "seen.txt"
    spec = reward(tmp_path, f"def score(response, ground_truth):\n    open({str(seen)!r}, 'a').write(ground_truth + '\\n')\n"
                            "    return {'overall': 1.0, 'format': 1.0, 'accuracy': 1.0}\n")
    out = check(resolved(tmp_path, worker={"reward": {"reward_function": spec}},
                         data={"train": str(tmp_path / "data" / "train.parquet")}))
    assert out.returncode == 0, out.stderr
    assert seen.read_text().split() == ["42"]


def test_engine_and_device_are_checked(tmp_path, monkeypatch):
    import importlib.util

    import torch

    from vlgrpo import preflight

    cfg = config.read_resolved(resolved(tmp_path, worker={"rollout": {"engine": "vllm"}}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(config.ConfigError, match="engine is vllm, but vLLM is not installed"):
        preflight.check(cfg)
    preflight.check(cfg, engine=False)  # jobs that run in their own environment check it themselves
    cfg = config.read_resolved(resolved(tmp_path, trainer={"device": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(config.ConfigError, match="trainer.device is 'cuda' but no CUDA device is visible here"):
        preflight.check(cfg)
    preflight.check(cfg, device=False)  # an executor places jobs on GPU nodes


@pytest.mark.slow
def test_the_workflow_stops_before_any_job(tmp_path):
    broken = reward(tmp_path, "def score(response, ground_truth):\n    return {}\n")  # misses the keys
    out = subprocess.run(
        ["snakemake", "--cores", "1", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
         "--config", "experiment=pf", f"demo={{out_dir: {tmp_path}/demo}}", f"model={{path: {tmp_path}/demo/tiny}}",
         f"data={{train: {tmp_path}/demo/geometry_synth/train.parquet, val: {tmp_path}/demo/geometry_synth/test.parquet}}",
         f"worker={{reward: {{reward_function: '{broken}'}}}}"],
        capture_output=True, text=True,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vlgrpo check: reward function {broken}") and "lacks keys ['overall']" in last
    assert not (tmp_path / "demo").exists() and not (tmp_path / "results" / "pf" / "logs").exists()  # no job ran
    assert not (tmp_path / ".snakemake" / "locks").exists() or not any((tmp_path / ".snakemake" / "locks").iterdir())


def test_a_user_error_of_a_trainer_fails_once_with_one_line(demo_base, tmp_path, monkeypatch):
    from vlgrpo import failures

    spec = reward(tmp_path, "def other(response, ground_truth):\n    return {}\n")
    cfg = make_experiment(demo_base, tmp_path, {"worker": {"reward": {"reward_function": spec}}})
    exp = config.experiment_dir(cfg)
    env = {**os.environ, locks.RUN_ENV: "run-a"}
    cmd = ["vlgrpo", "train", "--config", str(paths.path(paths.RESOLVED, exp)), "--end-step", "5"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert first.returncode == 1
    last = first.stderr.strip().splitlines()[-1]
    assert last.startswith("vlgrpo train: worker.reward.reward_function") and "no function 'score'" in last
    assert "Traceback" in first.stderr  # the traceback is in the job log, above the line
    started = time.monotonic()
    retry = subprocess.run(cmd, env=env, capture_output=True, text=True)  # Snakemake's retry, same run
    assert retry.returncode == 1 and "(not retried: a user error fails the same way again)" in retry.stderr
    assert "Traceback" not in retry.stderr and time.monotonic() - started < 30  # no trainer started
    assert failures.summary(exp) == []  # another run's notes are not this one's
    monkeypatch.setenv(locks.RUN_ENV, "run-a")
    assert failures.summary(exp) == [f"train_000005 failed on a user error (not retried): {last}"]
    retries = failures.RetriesUnlessUserError(2, exp, "train_")
    assert retries == 2 and not retries > 0 and not 0 < retries  # Snakemake asks `retries > attempt - 1`
    monkeypatch.setenv(locks.RUN_ENV, "run-b")  # the next workflow run tries again
    assert retries > 1 and failures.earlier(exp, "train_000005") is None


def test_an_edited_reward_file_is_noticed(demo_base, tmp_path):
    from vlgrpo import preflight

    spec = reward(tmp_path, "from vlgrpo.rewards import r1v as score\n")
    cfg = make_experiment(demo_base, tmp_path, {"worker": {"reward": {"reward_function": spec}},
                                                "trainer": {"max_steps": 1, "save_freq": 1, "val_freq": 2}})
    exp = config.experiment_dir(cfg)
    marker = run_segment(cfg, 1, paths.path(paths.MARKER, exp, step=1))
    assert len(marker["reward_sha256"]) == 64
    assert preflight.reward_changes(cfg) == []
    Path(spec.rpartition(":")[0]).write_text("from vlgrpo.rewards import math as score\n")
    (note,) = preflight.reward_changes(cfg)
    assert f"the reward file of {spec} changed" in note and "segments/step_000001.json" in note and "new experiment name" in note


def test_an_empty_parquet_says_no_rows(tmp_path):
    file = tmp_path / "empty.parquet"
    pd.DataFrame({"images": [], "problem": [], "answer": []}).to_parquet(file)
    with pytest.raises(DataError, match=f"no rows in {file}"):
        load_split(str(file), "images", "problem", "answer")


def test_an_offline_hub_id_fails_fast_saying_to_give_a_folder(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(DataError, match="'nobody/no-such-model' is not a local folder, HF_HUB_OFFLINE is set.*give a local model folder"):
        sources.load_processor("nobody/no-such-model")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the sandbox has no network
    with pytest.raises(DataError, match="the hub cannot be reached from here.*give a local model folder"):
        sources.load_processor("nobody/no-such-model")
    assert time.monotonic() - started < 30


def test_a_missing_required_key_is_one_line_naming_it():
    with pytest.raises(config.ConfigError) as error:
        config.validate({"experiment": "e", "model": {}, "data": {"train": "a.parquet", "val": "b.parquet"}})
    assert str(error.value).splitlines()[1:] == ["  missing required key 'model.path' (hub id (Qwen/Qwen2.5-VL-3B-Instruct) "
                                                 "or a local folder with model + processor)"]
    with pytest.raises(config.ConfigError) as error:
        config.validate({"model": {"path": "m"}, "data": {"train": "a.parquet", "val": "b.parquet"}})
    assert "missing required key 'experiment'" in str(error.value) and "vlgrpo experiment config" not in str(error.value)

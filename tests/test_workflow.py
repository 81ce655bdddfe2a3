"""The whole workflow on the demo: a failed segment reruns alone (with what depends on it) and the
run ends where an uninterrupted one ends; a killed Snakemake resumes after `vlgrpo unlock-stale`."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlgrpo.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def overrides(demo: Path) -> list[str]:
    return [
        "experiment=wf",
        f"demo={{out_dir: {demo}, n_train: 64, n_val: 16, n_test: 16, warmup_steps: 30}}",
        f"model={{path: {demo}/tiny}}",
        f"data={{train: {demo}/geometry_synth/train.parquet, val: {demo}/geometry_synth/test.parquet}}",
        "trainer={max_steps: 6, save_freq: 2, val_freq: 2, retries: 0}",
    ]


def snakemake(workdir: Path, demo: Path, *extra: str, env=None, check=True, background=False):
    cmd = ["snakemake", "--cores", "2", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
           *extra, "--config", *overrides(demo)]
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}, **(env or {})}
    if background:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def jobs_run(log: str) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job Snakemake started, from its log."""
    jobs, rule = set(), None
    for line in log.splitlines():
        if m := re.match(r"^(?:local)?(?:rule|checkpoint) (\w+):$", line.strip()):
            rule = m.group(1)
            jobs.add((rule, ""))
        elif rule and (m := re.match(r"^wildcards: (.*)$", line.strip())):
            jobs.discard((rule, ""))
            jobs.add((rule, m.group(1)))
    return jobs


WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/")  # metric groups measured in wall-clock time


def final_state(workdir: Path):
    exp = workdir / "results" / "wf"
    metrics = [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK) and k != "val/tokens_per_s"}
               for r in read_metrics(exp / "metrics.jsonl")]
    vals = {p.name: {k: v for k, v in json.loads(p.read_text()).items() if k.startswith("val/") and k != "val/tokens_per_s"}
            for p in sorted((exp / "val").glob("step_*.json"))}
    summary = json.loads((exp / "report" / "summary.json").read_text())
    summary.pop("efficiency")  # wall-clock figures
    return metrics, vals, summary


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("wf")
    demo = root / "demo"
    snakemake(root / "straight", demo)
    return root, demo


def test_a_failed_segment_reruns_alone_and_the_run_ends_the_same(reference):
    root, demo = reference
    work = root / "faulty"
    first = snakemake(work, demo, env={"VLGRPO_FAULT": "kill@3", "VLGRPO_FAULT_ONCE": str(root / "fired")}, check=False)
    assert first.returncode != 0 and (root / "fired").exists()
    assert not (work / "results/wf/segments/step_000004.json").exists()
    assert (work / "results/wf/val/step_000002.json").exists()  # keep-going: independent jobs ran

    second = snakemake(work, demo)
    ran = {j for j in jobs_run(second.stdout + second.stderr) if j[0] != "all"}
    assert ran == {
        ("train_segment", "step=000004"), ("train_segment", "step=000006"),
        ("evaluate", "step=000004"), ("evaluate", "step=000006"), ("report", ""),
    }
    assert final_state(work) == final_state(root / "straight")
    folders = [d / "results/wf/checkpoints/global_step_000006/model" for d in (work, root / "straight")]
    weights = [{k: v for f in sorted(d.glob("model-*.safetensors")) for k, v in load_file(f).items()} for d in folders]
    assert weights[0]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_snakemake_killed_mid_run_finishes_on_the_next_run(reference):
    root, demo = reference
    work = root / "killed"
    proc = snakemake(work, demo, background=True)
    marker = work / "results/wf/segments/step_000002.json"
    deadline = time.time() + 600
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert marker.exists()
    os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and its jobs, as when a node is lost
    proc.wait()
    assert snakemake(work, demo, check=False).returncode != 0  # its lock is left behind
    unlock = subprocess.run(["vlgrpo", "unlock-stale", "--directory", str(work)], capture_output=True, text=True)
    assert "released the lock" in unlock.stdout, unlock.stderr
    snakemake(work, demo)
    assert final_state(work) == final_state(root / "straight")

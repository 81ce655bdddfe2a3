"""The workflow as SLURM jobs (profiles/slurm) on a real SLURM: a train segment's job cancelled while it
runs is resubmitted, resumes from the last checkpoint, and the run ends with the metrics, validations,
report and weights of a local run. Needs a running SLURM with a GPU (fake ones will do:
scripts/slurm_local.sh start, as .ci/run does) and snakemake-executor-plugin-slurm; skipped otherwise.

Also, without SLURM: the train watchdog judges progress by its own clock, so a heartbeat whose mtime
comes from a shared file system's server with another clock does not kill a healthy segment."""

import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_experiment
from test_workflow import final_state, overrides
from vlgrpo import config, paths
from vlgrpo.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEP = "000004"  # the segment whose job is cancelled: steps 3 and 4
TIMEOUT_S = 1500  # the SLURM run alone; 8 min on a 2-core machine at load 15


def slurm_missing() -> str | None:
    """Why the SLURM test cannot run here, or None."""
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (pip install -e '.[slurm]')"
    if shutil.which("sinfo") is None:
        return "no SLURM client (sinfo) on this machine"
    try:  # without a slurm.conf sinfo retries for a minute
        out = subprocess.run(["sinfo", "-h", "-o", "%T %G"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "no SLURM controller answers within 15 s (start one: scripts/slurm_local.sh start)"
    if out.returncode != 0:
        return f"no SLURM controller answers (start one: scripts/slurm_local.sh start): {out.stderr.strip()[:200]}"
    if not re.search(r"^(idle|mixed)\S* \S*gpu", out.stdout, re.M):
        return f"no SLURM node with free GPUs (sinfo: {out.stdout.strip()[:200]})"
    return None


def config_args(demo: Path) -> list[str]:
    """The workflow tests' demo with the recipe's `device: auto`: its jobs ask SLURM for one (fake) GPU
    each and train on the CPU, as this machine has no CUDA (`device: cpu` would ask for none)."""
    trainer = "trainer={max_steps: 6, save_freq: 2, val_freq: 2, retries: 1, n_gpus_per_node: 1, device: auto}"
    return [o for o in overrides(demo) if not o.startswith("trainer=")] + [trainer]


def snakemake_cmd(workdir: Path, demo: Path, *extra: str) -> list[str]:
    return ["snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir), *extra,
            "--config", *config_args(demo)]


def slurm_jobs() -> list[tuple[str, str, str]]:
    """(job id, comment, state) of the jobs SLURM knows, finished ones included."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%k|%T"], capture_output=True, text=True, check=True)
    return [tuple(line.split("|")) for line in out.stdout.splitlines()]


def gpus_asked(job_id: str) -> str:
    """What the job asked for per job (sbatch --gpus=N gives gres:gpu:N)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-O", "tres-per-job"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def segment_jobs(step: str) -> list[tuple[str, str, str]]:
    return [j for j in slurm_jobs() if j[1] == f"rule_train_segment_wildcards_{step}"]


@pytest.mark.slow
@pytest.mark.slurm
def test_a_cancelled_segment_is_resubmitted_and_the_run_ends_as_a_local_one(tmp_path):
    if why := slurm_missing():
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}
    demo = tmp_path / "demo"
    local = subprocess.run(snakemake_cmd(tmp_path / "local", demo, "--cores", "2", "--resources", "gpu=1"),
                           env=env, capture_output=True, text=True)
    assert local.returncode == 0, local.stderr[-3000:]

    work = tmp_path / "slurm"
    log = tmp_path / "snakemake_slurm.log"
    before = {j[0] for j in slurm_jobs()}
    # This SLURM has no accounting: status from squeue (profiles/slurm/config.yaml), polled soon.
    cmd = ["timeout", "-k", "10", str(TIMEOUT_S), *snakemake_cmd(
        work, demo, "--profile", str(ROOT / "profiles/slurm"),
        "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2")]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        metrics = work / "results/wf/metrics.jsonl"
        cancelled = None
        while proc.poll() is None and cancelled is None:
            running = [j for j in segment_jobs(STEP) if j[2] == "RUNNING" and j[0] not in before]
            if running and metrics.exists() and any(r["step"] == 3 for r in read_metrics(metrics)):
                cancelled = running[0] + (gpus_asked(running[0][0]),)
                subprocess.run(["scancel", cancelled[0]], check=True)  # mid-segment: step 3 done, step 4 not
            time.sleep(0.5)
        proc.wait(timeout=TIMEOUT_S + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for job in slurm_jobs():  # nothing of this run left in the queue
            if job[0] not in before and job[2] in ("PENDING", "RUNNING"):
                subprocess.run(["scancel", job[0]])
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert cancelled is not None, "the segment to step 4 finished before its job could be cancelled"
    assert cancelled[3] == "gres:gpu:1", f"the train segment's job asked for {cancelled[3]!r}, not one GPU"

    # The cancelled job failed in Snakemake's eyes, and a second job ran the segment to its end.
    states = {job_id: state for job_id, _comment, state in segment_jobs(STEP) if job_id not in before}
    assert states.pop(cancelled[0]) == "CANCELLED" and list(states.values()) == ["COMPLETED"], states
    assert re.search(rf"SLURM-job '{cancelled[0]}' failed, SLURM status is: 'CANCELLED'", text)

    # The same run as the local one: every step's metrics, every validation, the report, the weights.
    assert final_state(work) == final_state(tmp_path / "local")
    folders = [d / "results/wf/checkpoints/global_step_000006/model" for d in (work, tmp_path / "local")]
    weights = [{k: v for f in sorted(folder.glob("model-*.safetensors")) for k, v in load_file(f).items()} for folder in folders]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_watchdog_trusts_its_own_clock_not_the_heartbeat_mtime(demo_base, tmp_path):
    """The heartbeat's mtime is set an hour behind (a file server whose clock lags), advancing as the
    trainer beats: the segment must finish. Judging by `now - mtime` killed it at once."""
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"stall_timeout_s": 60}})
    exp = config.experiment_dir(cfg)
    heartbeat = paths.path(paths.HEARTBEAT, exp)
    done = threading.Event()

    def lagging_server():
        last = None
        while not done.is_set():
            if heartbeat.exists() and (mtime := heartbeat.stat().st_mtime) != last:  # the trainer beat
                os.utime(heartbeat, (mtime - 3600, mtime - 3600))
                last = mtime - 3600
            time.sleep(0.05)

    thread = threading.Thread(target=lagging_server, daemon=True)
    thread.start()
    try:
        out = subprocess.run(["vlgrpo", "train", "--config", str(paths.path(paths.RESOLVED, exp)), "--end-step", "2"],
                             capture_output=True, text=True, timeout=300)
    finally:
        done.set()
        thread.join()
    assert out.returncode == 0, out.stderr[-2000:]
    assert paths.path(paths.MARKER, exp, step=2).is_file()

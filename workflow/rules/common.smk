import os
import sys
import shutil
import subprocess
from pathlib import Path

from vlgrpo import config as config_lib
from vlgrpo import paths, plan
from vlgrpo.config import ConfigError

try:
    CFG = config_lib.validate(config)
except ConfigError as e:
    raise WorkflowError(str(e)) from None

EXP = str(config_lib.experiment_dir(CFG))
RESOLVED = paths.path(paths.RESOLVED, EXP)
DEMO = CFG["demo"]["out_dir"]
DEMO_DATA = f"{DEMO}/geometry_synth"
DEMO_SPLITS = ["train", "validation", "test"]
STEP = r"\d{6}"
CONDA_ENV = str(Path(workflow.basedir) / "envs" / "vlgrpo.yaml")  # snakemake --use-conda

# Written at parse time, and only when it changes: jobs read it, but the rerun decision rests on the
# `params` hashes below, so raising max_steps only adds segments.
if not RESOLVED.is_file() or config_lib.read_resolved(RESOLVED) != CFG:
    config_lib.write_resolved(CFG, RESOLVED)


def _pick(dotted):
    node = CFG
    for part in dotted.split("."):
        node = node[part]
    return node


def config_key(*dotted):
    """A hash of the config parts a rule depends on; a rule reruns when it changes."""
    return config_lib.config_hash(config_lib.expand_dotted({k: _pick(k) for k in dotted}))


TRAIN_KEYS = ("seed", "model", "data", "algorithm", "worker")
EVAL_KEYS = ("seed", "model", "data", "worker.rollout.engine", "worker.rollout.val_override_config",
             "worker.reward", "trainer.device", "trainer.val_generations_to_log")


def visible_gpus():
    """GPUs on this machine (CUDA_VISIBLE_DEVICES wins), so that GPU jobs never oversubscribe them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


# On a cluster (an executor plugin: --jobs N sets nodes) the scheduler places GPU jobs, not this count.
if "gpu" not in workflow.global_resources and workflow.nodes is None:
    workflow.register_resource("gpu", visible_gpus())

TRAIN_GPUS = CFG["trainer"]["n_gpus_per_node"] * CFG["trainer"]["nnodes"]
EVAL_GPUS = min(1, TRAIN_GPUS)


def local_inputs(*specs):
    """Local files among data/model specs (hub ids are not files), so rules that make them run first."""
    out = []
    for spec in specs:
        if spec.startswith(DEMO) or Path(spec).exists():
            out.append(spec)
    return out


def step_of(wildcards):
    return int(wildcards.step)


def planned_total():
    """Total training steps: needs the filtered train split's size (a checkpoint rule)."""
    stats = checkpoints.filter_data.get(split="train").output.stats
    import json

    return plan.total_steps(CFG, json.loads(Path(stats).read_text())["steps_per_epoch"])


def val_file(step):
    return paths.path(paths.VAL, EXP, step=step)


def marker_file(step):
    return paths.path(paths.MARKER, EXP, step=step)


# A Snakemake killed hard (SIGKILL, a lost node) leaves its lock behind, and the next run would
# refuse to start. The lock is released here when the process that took it is gone.
LOCK_OWNER = Path(".snakemake/vlgrpo_lock_owner")


def release_stale_lock():
    import psutil

    locks = Path(".snakemake/locks")
    if not (locks.is_dir() and any(locks.iterdir()) and LOCK_OWNER.is_file()):
        return
    pid = int(LOCK_OWNER.read_text())
    try:
        alive = "snakemake" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        alive = False
    if not alive:
        shutil.rmtree(locks)
        LOCK_OWNER.unlink()
        print(f"vlgrpo: released the lock left by Snakemake process {pid}, which is gone", file=sys.stderr)


release_stale_lock()


onstart:
    LOCK_OWNER.parent.mkdir(exist_ok=True)
    LOCK_OWNER.write_text(str(os.getpid()))

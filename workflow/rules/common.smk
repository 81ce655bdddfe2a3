import json
import subprocess
import sys
from pathlib import Path

from vlgrpo import config as config_lib
from vlgrpo import demo_folders, failures, fingerprint, locks, paths, plan, val_results
from vlgrpo.config import ConfigError
from vlgrpo.report.cli import input_warnings
from vlgrpo.report.plots import FIGURES

try:
    # The demo's dataset and model resolve to folders keyed by their settings (vlgrpo/demo_folders.py).
    CFG = demo_folders.keyed(config_lib.validate(config))
except ConfigError as e:
    raise WorkflowError(str(e)) from None

EXP = str(config_lib.experiment_dir(CFG))
RESOLVED = paths.path(paths.RESOLVED, EXP)
DEMO = CFG["demo"]["out_dir"]
DEMO_DATA = str(demo_folders.data_dir(CFG))
DEMO_SPLITS = ["train", "validation", "test"]
STEP = r"\d{6}"
CONDA_ENV = str(Path(workflow.basedir) / "envs" / "vlgrpo.yaml")  # snakemake --use-conda


def _pick(dotted):
    node = CFG
    for part in dotted.split("."):
        node = node[part]
    return node


def config_key(*dotted):
    """A hash of the config parts a rule depends on; a rule reruns when it changes."""
    return config_lib.config_hash(config_lib.expand_dotted({k: _pick(k) for k in dotted}))


EVAL_KEYS = ("seed", "model", "data", "worker.rollout.engine", "worker.rollout.val_override_config", "worker.rollout.top_k",
             "worker.reward", "trainer.device", "trainer.val_generations_to_log")


# Snakemake's local executor does not pin jobs to GPUs: two GPU jobs side by side would share the
# first one. So unless --resources gpu=N says otherwise, a node is taken to have the GPUs one job
# uses (trainer.n_gpus_per_node), and GPU jobs run one at a time. Read from the config, not probed:
# parsing the workflow starts no program. On a cluster (an executor plugin: --jobs N sets nodes) the
# scheduler places GPU jobs, and no such limit applies.
if "gpu" not in workflow.global_resources and workflow.nodes is None:
    workflow.register_resource("gpu", CFG["trainer"]["n_gpus_per_node"])

# A segment's processes each hold a GPU (torchrun when more than one); on the CPU they hold none.
TRAIN_GPUS = 0 if CFG["trainer"]["device"] == "cpu" else CFG["trainer"]["n_gpus_per_node"] * CFG["trainer"]["nnodes"]
EVAL_GPUS = min(1, TRAIN_GPUS)


def local_inputs(*specs):
    """Local files among data/model specs (hub ids are not files), so rules that make them run first.
    Marked ancient: their timestamps decide nothing (a touched or re-copied file reruns nothing);
    their content does, through filter_data's `inputs` (content_key), which every rule that reads
    them follows."""
    out = []
    for spec in specs:
        if spec.startswith(DEMO) or Path(spec).exists():
            out.append(ancient(spec))
    return out


def content_key(*specs):
    """Content hashes of the local files among specs; the demo's are left out (their folders are
    keyed by the settings that make them, and may not exist before their rule runs)."""
    return {spec: fingerprint.digest(spec) for spec in map(str, local_inputs(*specs)) if not spec.startswith(DEMO)}


def step_of(wildcards):
    return int(wildcards.step)


def planned_total():
    """Total training steps: needs the filtered train split's size (a checkpoint rule)."""
    stats = checkpoints.filter_data.get(split="train").output.stats
    return plan.total_steps(CFG, json.loads(Path(stats).read_text())["steps_per_epoch"])


def val_file(step):
    return paths.path(paths.VAL, EXP, step=step)


def marker_file(step):
    return paths.path(paths.MARKER, EXP, step=step)


# Input functions of the stages' rules.


def previous_segment(wildcards):
    """The previous segment's marker; the first segment needs the filtered data and the base model."""
    ends = plan.segment_ends(CFG, planned_total())
    end = step_of(wildcards)
    if end not in ends:
        raise WorkflowError(f"step {end} is not a segment end of this run ({ends[:3]}...)")
    i = ends.index(end)
    if i:
        return [marker_file(ends[i - 1])]
    return [paths.path(paths.FILTERED, EXP, split="train")] + local_inputs(CFG["model"]["path"])


def evaluated_model(wildcards):
    step = step_of(wildcards)
    deps = [paths.path(paths.FILTERED, EXP, split="val"), paths.path(paths.STATS, EXP, split="train")]
    return deps + ([marker_file(step)] if step else local_inputs(CFG["model"]["path"]))


def report_inputs(wildcards):
    total = planned_total()
    return [val_file(s) for s in plan.validation_steps(CFG, total)] + [
        marker_file(plan.segment_ends(CFG, total)[-1])
    ]


def report_outputs():
    out = paths.REPORT.format(exp=EXP)
    return [f"{out}/report.html", f"{out}/summary.json"] + [f"{out}/{name}" for name in FIGURES]


# Only when jobs are about to run (onstart: never for a dry run, a lint or a report). The resolved
# config is what jobs read, rewritten only when it changes: the rerun decision rests on the `params`
# hashes, so raising max_steps only adds segments. The run gets an id that its jobs inherit, and the
# lock's owner is recorded, for `vlgrpo unlock-stale` (vlgrpo/locks.py).
# Then `vlgrpo check` (vlgrpo/preflight.py): the reward function, the engine, the device and a hub
# model, so a mistake stops the run here with one line; its notes (a changed reward file) are shown.
onstart:
    if not Path(RESOLVED).is_file() or config_lib.read_resolved(RESOLVED) != CFG:
        config_lib.write_resolved(CFG, RESOLVED)
    locks.start_run(EXP)
    _checked = subprocess.run(
        [sys.executable, "-m", "vlgrpo.cli", "check", "--config", RESOLVED]
        + ([] if workflow.nodes is None else ["--no-device"])  # an executor runs jobs on other nodes
        + (["--no-engine"] if workflow.deployment_settings.deployment_method else []),  # jobs run in their own env
        stderr=subprocess.PIPE,
        text=True,
    )
    if _checked.returncode:
        lines = [l for l in _checked.stderr.splitlines() if l.startswith("vlgrpo check: ")]
        sys.exit(lines[-1] if lines else _checked.stderr)


# The last words of a run: warnings about its data (also in the report), and the line of each job that
# failed on a user error (not retried).
onsuccess:
    for line in input_warnings(Path(EXP)):
        print(f"warning: {line}", file=sys.stderr)


onerror:
    for line in [f"warning: {w}" for w in input_warnings(Path(EXP))] + failures.summary(EXP):
        print(line, file=sys.stderr)

"""A segment job's start: what it imports, what its grading processes import, when it counts from."""

import json
import subprocess
import sys
import time

from vlgrpo import config, paths
from vlgrpo.cli import trainer_command

# Imported by the job's start before, used by no segment until its save (torch.distributed.checkpoint)
# or by no segment at all (pandas, through pyarrow's dataset layer reading the filtered split).
NOT_AT_START = ["torch.distributed.checkpoint", "pyarrow.dataset", "pandas"]
# Never on a segment's path (each imported where its option is used); guarded so none creeps back in.
NEVER = ["datasets", "matplotlib", "vllm", "wandb", "peft", "qwen_vl_utils", "vlgrpo.report"]


def run_python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_segment_starts_without_the_modules_it_does_not_use(demo_base):
    train = paths.path(paths.FILTERED, config.experiment_dir(demo_base), split="train")
    loaded = run_python(
        "import json, sys\n"
        "import vlgrpo.segment, vlgrpo.trainer\n"
        "from vlgrpo.data.filtering import load_filtered\n"
        f"rows = load_filtered({str(train)!r})\n"
        f"print(json.dumps({{'rows': len(rows), 'loaded': [m for m in {NOT_AT_START + NEVER!r} if m in sys.modules]}}))"
    )
    assert loaded == {"rows": 64, "loaded": []}


def test_grading_processes_do_not_import_the_trainer():
    """A spawned process imports its parent's main module first: the segment's (vlgrpo.segment) holds
    nothing, so the grading processes import the reward code only, not torch or transformers."""
    assert trainer_command({"trainer": {"n_gpus_per_node": 1, "nnodes": 1, "always_torchrun": False}}, [])[1:] == [
        "-m", "vlgrpo.segment"]
    seen = run_python(
        "import importlib.util, json, sys\n"
        "sys.modules['__main__'].__spec__ = importlib.util.find_spec('vlgrpo.segment')  # as `python -m vlgrpo.segment` leaves it\n"
        "from vlgrpo import rewards\n"
        "pool = rewards._pool(1)\n"
        "pool.submit(rewards._ready).result()  # as start_workers: the worker imports the reward code\n"
        "worker = pool.submit(eval, \"sorted(__import__('sys').modules)\").result()\n"
        "print(json.dumps([m for m in ('torch', 'transformers', 'torchvision', 'vlgrpo.trainer', 'vlgrpo.rewards') if m in worker]))"
    )
    assert seen == ["vlgrpo.rewards"]


def test_the_job_start_is_the_process_start():
    """clock.process_start against the wall clock around the process's creation (psutil's create_time
    came out up to 1 s early: the boot time it adds to is cut to whole seconds)."""
    before = time.time()
    seen = run_python("import json, time\nfrom vlgrpo import clock\nprint(json.dumps([clock.process_start(), time.time()]))")
    started, then = seen
    assert before - 0.011 <= started <= then  # to a clock tick (10 ms)
    assert started - before < 0.5  # the interpreter's own start


def test_bench_startup_names_the_costliest_first_imports():
    from test_scripts import load_script

    lines = [  # python -X importtime prints a module after its own imports, indented by depth
        "import time: self [us] | cumulative | imported package",
        "import time:       100 |        100 |     torch._C",
        "import time:       400 |        500 |   torch",
        "import time:        50 |         50 |     torchvision.ops",
        "import time:       150 |        200 |   torchvision",
        "import time:        10 |        710 | vlgrpo.trainer",
    ]
    assert load_script("bench_startup").first_imports(lines) == [
        {"module": "vlgrpo.trainer", "cumulative_s": 7.1e-4, "imported_by": None},
        {"module": "torch", "cumulative_s": 5e-4, "imported_by": "vlgrpo.trainer"},
        {"module": "torchvision", "cumulative_s": 2e-4, "imported_by": "vlgrpo.trainer"},
    ]

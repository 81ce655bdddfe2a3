"""Segment job startup benchmark: how long a segment job takes to reach its work, in fresh processes.

Three figures, each repeated (--repeats, default 3):
  import_s   seconds to import what a segment job imports (`import vlgrpo.trainer` in a fresh
             interpreter, timed inside it), and process_s the whole `python -c` run;
  cli_import_s  the same for the `vlgrpo` command (vlgrpo.cli), the watchdog that starts the job;
  startup_s  a real segment's timing_s/startup as its marker records it (job start to data and
             processor ready: interpreter, imports, data), one step of the tiny demo through
             `python -m vlgrpo.cli train`; imports_done_s is when its trainer said its imports were done.
Once: the 15 costliest packages by `python -X importtime` (cumulative seconds at their first import,
and the module that imported them), and how early psutil's create_time puts a process's start
(the job start before it was read from the boot clock).

--src DIR measures the vlgrpo package under DIR (default: this checkout's), --compare DIR another one in
turns with it (e.g. an earlier commit's: `git archive 79b9083 src | tar -x -C /tmp/before`, then
`--compare /tmp/before/src`); the jobs run with PYTHONPATH=DIR. The demo experiment (data, tiny model,
filtered splits) is made once under --workdir, with this checkout's code.

CPU (the 2-core host; a few minutes):
    python scripts/bench_startup.py --out benchmarks/results/bench_startup_cpu.json
GPU (the demo model on the GPU: CUDA's share of the startup counts too; wheels as in
scripts/bench_segments.py, e.g. `python3 -m pip install -q --no-index --no-deps --target /tmp/site
.benchdata/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src`):
    python3 scripts/bench_startup.py --device cuda --out $OUT/bench_startup_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEGMENT_IMPORTS = "import vlgrpo.trainer"  # vlgrpo.segment, the job's main module, imports only this
TIMED = "import time; t = time.perf_counter(); {}; print(time.perf_counter() - t)"


def make_demo(work: Path, device: str) -> Path:
    """A one-step-per-segment demo experiment (64 train rows, the tiny model); its resolved config."""
    from vlgrpo import config, paths
    from vlgrpo.data.filtering import filter_split
    from vlgrpo.demo import make_dataset, make_model

    demo = work / "_demo"
    cfg = config.load(ROOT / "config.yaml", overrides={
        "experiment": f"bench_startup_{device}", "results_dir": str(work / "results"),
        "demo": {"out_dir": str(demo), "n_train": 64, "n_val": 16, "n_test": 16, "warmup_steps": 30},
        "model": {"path": str(demo / "tiny_qwen2_5_vl")},
        "data": {"train": str(demo / "geometry_synth/train.parquet"), "val": str(demo / "geometry_synth/test.parquet")},
        # Step 1 is saved and not validated (max_steps 2, val_freq 2): the job is startup, build, one step, save.
        "trainer": {"max_steps": 2, "save_freq": 1, "val_freq": 2, "val_before_train": False, "logger": ["file"],
                    "device": device},
    })
    resolved = paths.path(paths.RESOLVED, config.experiment_dir(cfg))
    if resolved.exists():
        return resolved
    make_dataset(cfg, demo / "geometry_synth")
    make_model(cfg, Path(cfg["model"]["path"]))
    exp = config.experiment_dir(cfg)
    for split in ("train", "val"):
        filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split))
    config.write_resolved(cfg, resolved)
    return resolved


def python(code: str, env: dict, *flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"python -c {code!r} failed:\n{done.stderr[-3000:]}")
    return done


def timed_import(statement: str, env: dict) -> dict:
    start = time.perf_counter()
    inside = float(python(TIMED.format(statement), env).stdout.split()[-1])
    return {"import_s": inside, "process_s": time.perf_counter() - start}


def segment_startup(resolved: Path, env: dict) -> dict:
    """One segment to step 1 from scratch; the startup its marker records."""
    exp = resolved.parent
    shutil.rmtree(exp / "checkpoints", ignore_errors=True)
    shutil.rmtree(exp / "segments", ignore_errors=True)
    (exp / "metrics.jsonl").unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vlgrpo.cli", "train", "--config", str(resolved), "--end-step", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"the segment failed:\n{done.stderr[-3000:]}")
    marker = json.loads((exp / "segments" / "step_000001.json").read_text())
    said = re.search(r"imports done ([0-9.]+) s after the job started", done.stderr)
    return {"startup_s": marker["timing_s"]["startup"], "imports_done_s": float(said[1]) if said else None,
            "build_model_s": marker["timing_s"]["build_model"], "job_s": time.perf_counter() - start}


def costliest(env: dict, n: int = 15) -> list[dict]:
    """The n costliest first imports of a fresh `import vlgrpo.trainer` (python -X importtime)."""
    return first_imports(python(SEGMENT_IMPORTS, env, "-X", "importtime").stderr.splitlines())[:n]


def first_imports(lines: list[str]) -> list[dict]:
    """From `python -X importtime` lines: each module whose importer is of another package (or none),
    with its cumulative seconds and its importer, costliest first."""
    rows = [m for line in lines if (m := re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line))]
    out, stack = [], []  # importtime prints a module after its imports: read backwards, an importer comes first
    for m in reversed(rows):
        depth, name = len(m[3]) // 2, m[4]
        del stack[depth:]
        parent = stack[-1] if stack else None
        stack.append(name)
        if parent is None or parent.split(".")[0] != name.split(".")[0]:
            out.append({"module": name, "cumulative_s": int(m[2]) / 1e6, "imported_by": parent})
    return sorted(out, key=lambda r: -r["cumulative_s"])


def create_time_error(env: dict) -> float:
    """Seconds by which psutil's create_time puts a fresh process's start before its start by the boot clock."""
    code = ("import os, time, psutil; from pathlib import Path\n"
            "ticks = int(Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[19])\n"
            "start = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf('SC_CLK_TCK'))\n"
            "print(start - psutil.Process().create_time())")
    return float(python(code, env).stdout.split()[-1])


def summary(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if runs[0][k] is not None]
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in keys}


def measure(src: Path, resolved: Path | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = {**timed_import(SEGMENT_IMPORTS, env), **{f"cli_{k}": v for k, v in timed_import("import vlgrpo.cli", env).items()}}
    return {**run, **(segment_startup(resolved, env) if resolved is not None else {})}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="the demo segment's trainer.device (cpu or cuda)")
    parser.add_argument("--src", help="measure the vlgrpo package under this folder (default: this checkout's src)")
    parser.add_argument("--compare", metavar="DIR", help="also measure the package under DIR, in turns with --src")
    parser.add_argument("--workdir", default="/tmp/vlgrpo_bench_startup", help="where the demo experiment is made (kept)")
    parser.add_argument("--no-segment", dest="segment", action="store_false", help="imports only, no demo segment")
    args = parser.parse_args(argv)
    trees = {"src": Path(args.src or ROOT / "src").resolve(), **({"compare": Path(args.compare).resolve()} if args.compare else {})}
    resolved = make_demo(Path(args.workdir), args.device) if args.segment else None
    runs = {name: [] for name in trees}
    for i in range(args.repeats):  # in turns: a slow spell of the shared host touches every tree alike
        for name, src in trees.items():
            runs[name].append(measure(src, resolved))
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items() if v is not None), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trees["src"]), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = {
        "device": args.device, "python": sys.version.split()[0], "host_cpus": os.cpu_count(),
        **{name: {"path": str(src), "runs": runs[name], "summary": summary(runs[name])} for name, src in trees.items()},
        "costliest_imports": costliest(env), "psutil_create_time_early_s": create_time_error(env),
    }
    for name in trees:
        print(name, ", ".join(f"{k} {v['median']:.2f}" for k, v in result[name]["summary"].items()), "(medians)")
    for row in result["costliest_imports"]:
        print(f"{row['cumulative_s']:6.2f} s  {row['module']:40s} (imported by {row['imported_by']})")
    print(f"psutil's create_time puts a process's start {result['psutil_create_time_early_s']:.2f} s early here")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

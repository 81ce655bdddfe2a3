"""Segment overhead benchmark: the 3B recipe through Snakemake, N segments of S steps, on one GPU.

Per segment it reports the time of the training steps, of the validation's generation, and the
overhead: everything else the segment costs (scheduling gap, job start, model build, checkpoint
load, checkpoint save, the rest of validation, the rest of the job), from the timings each segment
job records in metrics.jsonl and its marker (trainer.run_segment).

GPU (one H200; random bf16 weights with Qwen2.5-VL-3B's config, raw Geometry3K rows filtered by the
workflow, the recipe with its CUDA fast paths on by default, every response 512 tokens):
    bash scripts/device_wheels.sh     # here, once: wheels, model config and data into .benchdata/
    python3 scripts/bench_segments.py --out benchmarks/results/bench_segments_h200.json
CPU (the tiny demo model and synthetic task the workflow builds; minutes):
    python scripts/bench_segments.py --cpu --out /tmp/bench_segments_cpu.json
The experiment runs under --workdir (default /tmp/vlgrpo_bench_segments, deleted first unless
--resume: then Snakemake carries on with what is there). Where one device call cannot hold every
segment, `--upto K` runs the first K and a later `--resume` call (same --segments) the rest; the
scheduling gap of a segment counts from the later of the previous segment's end and the launch
that ran it. The JSON names the disk it wrote to. On a lent H200 (carry .benchdata; ~8-9 minutes):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .benchdata/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1
    python3 scripts/bench_segments.py --out $OUT/bench_segments_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "bench_segments"


def make_random_model(src: Path, dst: Path) -> None:
    """Qwen2.5-VL-3B's config and processor from `src` with random bf16 weights (seeded), saved at `dst`."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    shutil.copytree(src, dst)
    torch.manual_seed(1)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
    model.save_pretrained(dst)


def overlay(args, work: Path) -> tuple[list[Path], dict]:
    """Config files for snakemake --configfile (the last one written here) and the overlay itself."""
    total = args.segments * args.steps
    trainer = {"max_steps": total, "save_freq": args.steps, "val_freq": args.steps, "val_before_train": False,
               "keep_checkpoints": 1, "logger": ["file"], "stall_timeout_s": 1800, "always_torchrun": args.torchrun}
    if args.cpu:
        demo = work / "_demo"
        cfg = {
            "experiment": EXPERIMENT, "results_dir": str(work / "results"),
            "demo": {"out_dir": str(demo), "n_train": 64, "n_val": 16, "n_test": 16, "warmup_steps": 30},
            "model": {"path": str(demo / "tiny_qwen2_5_vl")},
            "data": {"train": str(demo / "geometry_synth/train.parquet"), "val": str(demo / "geometry_synth/test.parquet")},
            "trainer": trainer,
        }
        files = [ROOT / "config.yaml"]
    else:
        data = Path(args.data).resolve()
        model = Path(args.model_dir).resolve() if args.model_dir else work / "qwen2_5_vl_3b_random"
        if not any(model.glob("*.safetensors")):
            shutil.rmtree(model, ignore_errors=True)
            subprocess.run([sys.executable, __file__, "--make-model", str(data / "qwen2_5_vl_3b"), str(model)], check=True)
        cfg = {
            "experiment": EXPERIMENT, "results_dir": str(work / "results"),
            "model": {"path": str(model)},
            "data": {"train": str(data / "geometry3k/train.parquet"), "val": str(data / "geometry3k/test.parquet")},
            "worker": {"rollout": {"ignore_eos": True}},
            "trainer": {**trainer, "device": "cuda", "n_gpus_per_node": 1},
        }
        files = [ROOT / "configs/qwen2_5_vl_3b_geo3k.yaml"]
    from vlgrpo.config import deep_merge, parse_assignments

    cfg = deep_merge(cfg, parse_assignments(args.set))
    path = work / "overlay.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return files + [path], cfg


def cli_on_path(work: Path) -> dict:
    """The environment for Snakemake: a `vlgrpo` command on PATH even where the package is not installed."""
    env = dict(os.environ)
    if shutil.which("vlgrpo") is None:
        shim = work / "bin" / "vlgrpo"
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vlgrpo.cli "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}:{env['PATH']}"
    return env


def segment_table(exp: Path, ends: list[int], steps: int, launches: list[float]) -> list[dict]:
    from vlgrpo import paths
    from vlgrpo.tracking import read_metrics

    metrics = {r["step"]: r for r in read_metrics(paths.path(paths.METRICS, exp))}
    rows, previous_end = [], launches[0]
    for end in ends:
        marker = json.loads(paths.path(paths.MARKER, exp, step=end).read_text())
        previous_end = max([previous_end] + [t for t in launches if t <= marker["job_start"]])
        # The job's own phases from its marker: the step's merged record also holds the evaluate job's
        # timing_s/validation where that job validated the checkpoint itself (in-process validation failed).
        t = marker["timing_s"]
        steps_s = sum(metrics[s]["timing_s/step"] for s in range(end - steps + 1, end + 1))
        generation = metrics[end].get("timing_s/validation_generation", 0.0) if marker["validated_in_process"] else 0.0
        job = marker["job_end"] - marker["job_start"]
        timed = sum(t.get(k, 0.0) for k in ("startup", "build_model", "load_checkpoint", "train", "save_checkpoint", "validation", "prune"))
        parts = {
            "scheduling_gap": marker["job_start"] - previous_end,
            "startup": t["startup"],
            "build_model": t["build_model"],
            "load_checkpoint": t["load_checkpoint"],
            "save_checkpoint": t["save_checkpoint"],
            "validation_other": t.get("validation", 0.0) - generation,
            "prune": t.get("prune", 0.0),  # the run's last segment only: the others prune behind their training
            "train_loop_other": t["train"] - steps_s,
            "job_other": job - timed,
        }
        rows.append({
            "end_step": end, "steps_s": steps_s, "validation_s": t.get("validation", 0.0),
            "save_checkpoint_behind_s": t.get("save_checkpoint_behind", 0.0),  # the whole write, mostly hidden
            "validation_generation_s": generation, "validated_in_process": marker["validated_in_process"],
            "job_s": job, "overhead_s": sum(parts.values()), "overhead_parts_s": parts,
            "graph_captures": sum(metrics[s].get("perf/cuda_graph_captures", 0) for s in range(end - steps + 1, end + 1)),
        })
        previous_end = marker["job_end"]
    return rows


def print_table(rows: list[dict]) -> None:
    names = list(rows[0]["overhead_parts_s"])
    print(f"{'segment':>8}{'steps':>8}{'val gen':>8}{'overhead':>9}  " + "".join(f"{n[:12]:>13}" for n in names))
    for r in rows:
        print(f"{r['end_step']:>8}{r['steps_s']:>8.1f}{r['validation_generation_s']:>8.1f}{r['overhead_s']:>9.1f}  "
              + "".join(f"{r['overhead_parts_s'][n]:>13.1f}" for n in names))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file to write (required)")
    parser.add_argument("--cpu", action="store_true", help="the tiny demo model on the CPU")
    parser.add_argument("--workdir", default="/tmp/vlgrpo_bench_segments")
    parser.add_argument("--data", default=str(ROOT / ".benchdata"), help="what scripts/device_wheels.sh prepared")
    parser.add_argument("--resume", action="store_true", help="keep --workdir and what was done in it")
    parser.add_argument("--model-dir", help="where the random 3B model is made (default: in --workdir); e.g. on "
                        "another disk when two checkpoints and the model do not fit on one")
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per segment")
    parser.add_argument("--torchrun", action="store_true",
                        help="trainer.always_torchrun: each segment as one FSDP2 rank under torchrun")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--upto", type=int, help="run only the first K segments of the plan (the rest with a later --resume)")
    parser.add_argument("--make-model", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_model:
        return make_random_model(Path(args.make_model[0]), Path(args.make_model[1]))
    if not args.out:
        parser.error("--out is required")

    work = Path(args.workdir).resolve()
    if not args.resume:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    files, cfg = overlay(args, work)
    exp = work / "results" / EXPERIMENT
    ends = [args.steps * (i + 1) for i in range(args.segments)][: args.upto or args.segments]
    targets = [str(exp / f"segments/step_{e:06d}.json") for e in ends] + [str(exp / f"val/step_{e:06d}.json") for e in ends]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work), "--cores", "all",
           "--resources", f"gpu={0 if args.cpu else 1}", "--configfile", *map(str, files), "--", *targets]
    launched = time.time()
    launch_log = work / "launches.json"
    launches = (json.loads(launch_log.read_text()) if launch_log.exists() else []) + [launched]
    launch_log.write_text(json.dumps(launches))
    with open(work / "snakemake.log", "a") as log:
        status = subprocess.run(cmd, env=cli_on_path(work), stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - launched
    if status:
        sys.exit(f"snakemake failed ({status}); see {work / 'snakemake.log'} and {exp / 'logs'}")
    rows = segment_table(exp, ends, args.steps, launches)
    disk = subprocess.run(["df", "-h", "--output=source,fstype,size,avail,target", str(work)], capture_output=True, text=True).stdout
    checkpoint = max((exp / "checkpoints").glob("global_step_*"))
    result = {
        "device": "cpu" if args.cpu else subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                        capture_output=True, text=True).stdout.strip(),
        "config_files": [str(f) for f in files], "overlay": cfg,
        "segments": rows, "snakemake_wall_s": wall, "snakemake_launches": len(launches),
        "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
        "disk": disk.strip(), "workdir": str(work), "model_path": cfg["model"]["path"],
        "adopted_validations": [json.loads((exp / f"val/step_{e:06d}.json").read_text())["validated_in_process"] for e in ends],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    print(f"snakemake wall {wall:.1f} s; checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB; disk:\n{disk}")
    return result


if __name__ == "__main__":
    main()

"""`vlgrpo <command>`: the entry points the workflow rules call; each also runs by hand.

    vlgrpo resolve config.yaml [configs/x.yaml ...] [--set key.sub=value ...]
    vlgrpo make-demo-data  --config results/<exp>/config.resolved.yaml
    vlgrpo make-demo-model --config results/<exp>/config.resolved.yaml
    vlgrpo filter   --config results/<exp>/config.resolved.yaml --split train|val
    vlgrpo evaluate --config results/<exp>/config.resolved.yaml --step N
    vlgrpo train    --config results/<exp>/config.resolved.yaml --end-step N
    vlgrpo report   --experiment-dir results/<exp> --out results/<exp>/report [--config ...]
    vlgrpo report   --from-easyr1 LOG [LOG ...] --out DIR
    vlgrpo bench    --config configs/bench_cpu.yaml --out benchmarks/results/x.json
    vlgrpo unlock-stale [--directory DIR]    before snakemake, after a Snakemake was killed hard
    vlgrpo from-easyr1 CONFIG.yaml [key=value ...] --out RECIPE.yaml    an EasyR1 config + script -> a recipe
    vlgrpo check    --config results/<exp>/config.resolved.yaml [--no-device] [--no-engine]
                                             before any job (the workflow's onstart runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from vlgrpo import config as config_lib
from vlgrpo import clock, console, failures, locks, paths


def cmd_resolve(args) -> None:
    from vlgrpo import demo_folders

    cfg = demo_folders.keyed(config_lib.load(*args.configs, overrides=config_lib.parse_assignments(args.set or [])))
    out = paths.path(paths.RESOLVED, config_lib.experiment_dir(cfg))
    config_lib.write_resolved(cfg, out)
    print(out)


def cmd_make_demo_data(args) -> None:
    from vlgrpo import demo_folders
    from vlgrpo.demo import make_dataset

    cfg = config_lib.read_resolved(args.config)
    stats = make_dataset(cfg, demo_folders.data_dir(cfg))
    print(json.dumps(stats, indent=1))


def cmd_make_demo_model(args) -> None:
    from vlgrpo.demo import make_model

    cfg = config_lib.read_resolved(args.config)
    stats = make_model(cfg, Path(cfg["model"]["path"]))
    print(json.dumps(stats, indent=1))


def cmd_filter(args) -> None:
    from vlgrpo.data.filtering import filter_split

    cfg = config_lib.read_resolved(args.config)
    exp = config_lib.experiment_dir(cfg)
    stats = filter_split(
        cfg, args.split, paths.path(paths.FILTERED, exp, split=args.split), paths.path(paths.STATS, exp, split=args.split)
    )
    print(json.dumps(stats, indent=1))


def cmd_evaluate(args) -> None:
    from vlgrpo import evaluate

    record = evaluate.main(args.config, args.step)
    print(json.dumps({k: v for k, v in record.items() if k != "samples"}, indent=1))


def trainer_command(cfg: dict, args: list[str]) -> list[str]:
    """The segment's command: the trainer (vlgrpo.segment), under torchrun when the segment has several processes
    (trainer.n_gpus_per_node x nnodes) or trainer.always_torchrun asks for it. --max-restarts 0: one rank that
    dies fails the whole job, and Snakemake's retry resumes it from the last checkpoint."""
    trainer = cfg["trainer"]
    if config_lib.processes(cfg) == 1 and not trainer["always_torchrun"]:
        return [sys.executable, "-m", "vlgrpo.segment", *args]
    nodes = ["--standalone"] if trainer["nnodes"] == 1 else [
        "--nnodes", str(trainer["nnodes"]), "--rdzv-backend", "c10d", "--rdzv-endpoint", trainer["rdzv_endpoint"],
        "--rdzv-id", f"{cfg['experiment']}-{args[args.index('--end-step') + 1]}",
    ]
    return [sys.executable, "-m", "torch.distributed.run", *nodes, "--nproc-per-node", str(max(1, trainer["n_gpus_per_node"])),
            "--max-restarts", "0", "-m", "vlgrpo.segment", *args]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts each rank in a session of its own)."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)


def cmd_train(args) -> None:
    """Run one segment in a child process (torchrun and its ranks, with several processes) under a
    watchdog: a heartbeat older than trainer.stall_timeout_s (a hung GPU, a deadlock, a rank that
    hangs: rank 0 then waits at its next collective) kills the child's process tree and fails the
    job, so Snakemake's retry resumes from the last checkpoint."""
    cfg = config_lib.read_resolved(args.config)
    exp = config_lib.experiment_dir(cfg)
    marker = paths.path(paths.MARKER, exp, step=args.end_step)
    heartbeat = paths.path(paths.HEARTBEAT, exp)
    heartbeat.parent.mkdir(parents=True, exist_ok=True)
    heartbeat.touch()
    timeout = cfg["trainer"]["stall_timeout_s"]
    started = clock.process_start()  # the segment's startup time counts from the job's start
    child = subprocess.Popen(
        trainer_command(cfg, ["--config", str(args.config), "--end-step", str(args.end_step),
                              "--marker", str(marker), "--heartbeat", str(heartbeat)]),
        start_new_session=True,
        preexec_fn=functools.partial(locks.die_with_parent, os.getpid()),  # no trainer outlives this watchdog
        env={**os.environ, "VLGRPO_JOB_START": str(started), **locks.watchdog_env()},
        pass_fds=console.pass_fds(),  # the trainer's recoveries are said on the console too
    )
    forward = lambda signum, _frame: os.killpg(child.pid, signum)  # noqa: E731 Snakemake's or scancel's SIGTERM
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # Progress is a change of the file's mtime, timed by this host's clock: on a shared file system
    # the mtime may come from the file server's clock, which need not agree with ours.
    seen, changed = heartbeat.stat().st_mtime_ns, time.monotonic()
    while child.poll() is None:
        try:
            child.wait(min(5.0, timeout / 4))  # returns as the segment ends: the next job starts at once
        except subprocess.TimeoutExpired:
            pass
        if (mtime := heartbeat.stat().st_mtime_ns) != seen:
            seen, changed = mtime, time.monotonic()
        age = time.monotonic() - changed
        if child.poll() is None and age > timeout:
            kill_tree(child.pid)
            child.wait()
            sys.exit(f"vlgrpo train: no progress for {age:.0f} s (trainer.stall_timeout_s={timeout}); killed the segment")
    if child.returncode != 0:
        if (line := failures.earlier(exp, _job(args)[1], any_run=True)) is not None:
            sys.exit(line)  # the trainer's user error: one line, its traceback above in the log
        sys.exit(f"vlgrpo train: the segment to step {args.end_step} failed (exit status {child.returncode})")


def cmd_check(args) -> None:
    from vlgrpo import preflight

    for note in preflight.check(config_lib.read_resolved(args.config), device=args.device, engine=args.engine):
        print(note)


def cmd_unlock_stale(args) -> None:
    print(locks.release_stale(Path(args.directory) / ".snakemake"))


def cmd_report(argv) -> None:
    from vlgrpo.report import main as report_main

    report_main(argv)


def cmd_bench(argv) -> None:
    from vlgrpo.bench import main as bench_main

    bench_main(argv)


def cmd_from_easyr1(argv) -> None:
    from vlgrpo.from_easyr1 import main as from_easyr1_main

    sys.exit(from_easyr1_main(argv))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Tensors of many sizes near the GPU's capacity: with expandable segments a new size extends a
    # segment instead of a cudaMalloc, and a full cache is not flushed and retried (a device sync).
    # Read when CUDA is first used; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # report, bench and from-easyr1 own their argument parsers.
    if argv and argv[0] in ("report", "bench", "from-easyr1"):
        return {"report": cmd_report, "bench": cmd_bench, "from-easyr1": cmd_from_easyr1}[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="vlgrpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("resolve", help="validate configs and write results/<exp>/config.resolved.yaml")
    p.add_argument("configs", nargs="+")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_resolve)
    for name, func, help_text in [
        ("make-demo-data", cmd_make_demo_data, "make the synthetic geometry dataset"),
        ("make-demo-model", cmd_make_demo_model, "make the tiny Qwen2.5-VL (with its supervised warm-up)"),
        ("filter", cmd_filter, "filter and render a split"),
        ("evaluate", cmd_evaluate, "validate a checkpoint (step 0 = the base model)"),
        ("train", cmd_train, "train one segment, resuming from the latest checkpoint"),
    ]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="results/<exp>/config.resolved.yaml")
        p.set_defaults(func=func)
        if name == "filter":
            p.add_argument("--split", choices=["train", "val"], required=True)
        if name == "evaluate":
            p.add_argument("--step", type=int, required=True)
        if name == "train":
            p.add_argument("--end-step", type=int, required=True)
    p = sub.add_parser("check", help="check the reward function, the engine, the device and the model before any job")
    p.add_argument("--config", required=True, help="results/<exp>/config.resolved.yaml")
    p.add_argument("--no-device", dest="device", action="store_false", help="jobs run on other nodes: skip the GPU check")
    p.add_argument("--no-engine", dest="engine", action="store_false", help="jobs run in another environment: skip the vLLM check")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("unlock-stale", help="release the lock of a Snakemake that was killed hard on this host")
    p.add_argument("--directory", default=".", help="the Snakemake working directory")
    p.set_defaults(func=cmd_unlock_stale)
    sub.add_parser("report", help="the analysis report (see vlgrpo report --help)")
    sub.add_parser("bench", help="the GRPO step benchmark (see vlgrpo bench --help)")
    sub.add_parser("from-easyr1", help="an EasyR1 config and a script's overrides -> a recipe (see vlgrpo from-easyr1 --help)")
    args = parser.parse_args(argv)
    exp, job = _job(args)
    if job:
        failures.stop_if_failed_before(exp, job)  # a retry of a job that failed on a user error in this run
    try:
        args.func(args)
    except failures.USER_ERRORS as e:
        if job:
            failures.exit_on_user_error(exp, job, f"vlgrpo {args.command}", e)
        sys.exit(f"vlgrpo {args.command}: {e}")


def _job(args) -> tuple[Path | None, str | None]:
    """(experiment folder, job name as in its log's name) of a workflow job's command; (None, None) otherwise."""
    name = {"filter": lambda: f"filter_{args.split}", "evaluate": lambda: f"evaluate_{paths.step_str(args.step)}",
            "train": lambda: f"train_{paths.step_str(args.end_step)}"}.get(args.command)
    return (Path(args.config).parent, name()) if name else (None, None)


if __name__ == "__main__":
    main()

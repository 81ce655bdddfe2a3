"""`vlgrpo report`: build the report of one of our experiments or of EasyR1 logs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlgrpo.config import ConfigError, read_resolved
from vlgrpo.report.build import REPORT_HTML, SUMMARY_JSON, build_report
from vlgrpo.report.records import RecordError, read_easyr1, read_experiment

RESOLVED_CONFIG = "config.resolved.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlgrpo report",
        description="Write report.html, summary.json and figures for a training run.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--experiment-dir", type=Path, metavar="DIR", help="results/<experiment> of a vlgrpo run")
    source.add_argument(
        "--from-easyr1",
        type=Path,
        nargs="+",
        metavar="LOG",
        help="EasyR1 experiment_log.jsonl files, one per launch of a resumed run, oldest first",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="report folder to write")
    p.add_argument(
        "--config",
        type=Path,
        help=f"resolved config of the run (default: DIR/{RESOLVED_CONFIG} when it exists); gives the title "
        "(experiment) and the clip threshold (worker.actor.max_grad_norm)",
    )
    p.add_argument("--title", help="report title (default: the experiment name)")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        help="grad-norm clip threshold (default: the config's worker.actor.max_grad_norm, else 1.0 as in EasyR1)",
    )
    p.add_argument("--n-gpus", type=int, help="GPUs of the run (default: inferred from perf/ metrics)")
    return p


def options_from_config(path: Path) -> dict:
    """Report options taken from a resolved config: title, clip threshold, GPU count."""
    cfg = read_resolved(path)
    trainer = cfg["trainer"]
    gpus = trainer["n_gpus_per_node"] * trainer["nnodes"]
    return {
        "title": cfg["experiment"],
        "max_grad_norm": cfg["worker"]["actor"]["max_grad_norm"],
        "n_gpus": gpus or None,
    }


def input_warnings(exp_dir: Path) -> list[str]:
    """The filter's warnings about the experiment's data (data/*.stats.json)."""
    out = []
    for stats in sorted((exp_dir / "data").glob("*.stats.json")):
        out += json.loads(stats.read_text()).get("warnings", [])
    return out


def lora_of(exp_dir: Path) -> dict | None:
    """The LoRA settings and parameter counts the newest segment marker records (None: full fine-tuning)."""
    markers = sorted((exp_dir / "segments").glob("step_*.json"))
    return json.loads(markers[-1].read_text()).get("lora") if markers else None


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.config and args.from_easyr1:
        p.error("--config goes with --experiment-dir (an EasyR1 run has no vlgrpo config)")
    if args.max_grad_norm is not None and args.max_grad_norm <= 0:
        p.error(f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    if args.n_gpus is not None and args.n_gpus < 1:
        p.error(f"--n-gpus must be >= 1, got {args.n_gpus}")
    try:
        if args.experiment_dir:
            config = args.config or args.experiment_dir / RESOLVED_CONFIG
            options = options_from_config(config) if args.config or config.is_file() else {}
            options.setdefault("title", args.experiment_dir.resolve().name)
            records = read_experiment(args.experiment_dir)
            options["lora"] = lora_of(args.experiment_dir)
            source = f"vlgrpo experiment {args.experiment_dir}" + (f", config {config}" if config.is_file() else "")
            validation_in_step = False
            options["warnings"] = input_warnings(args.experiment_dir)
        else:
            options = {"title": f"EasyR1 run: {args.from_easyr1[0].resolve().parent.name}"}
            records = read_easyr1(args.from_easyr1)
            source = "EasyR1 logs, launches in order: " + ", ".join(map(str, args.from_easyr1))
            validation_in_step = True
        for name in ("title", "max_grad_norm", "n_gpus"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
        summary = build_report(
            records, args.out, source=source, validation_in_step=validation_in_step, **options
        )
    except (RecordError, ConfigError) as err:
        p.exit(2, f"vlgrpo report: error: {err}\n")
    final = summary["val"]["final"]
    accuracy = f"{final['accuracy']:.3f}" if final and final["accuracy"] is not None else "n/a"
    print(
        f"wrote {args.out / REPORT_HTML} and {args.out / SUMMARY_JSON}: {summary['train_steps']} training steps, "
        f"final validation accuracy {accuracy}"
    )
    return 0

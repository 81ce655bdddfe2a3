"""The docs cannot drift from the code: the generated configuration reference, the site build, the
claims of what is refused, and every command README and docs/ show."""

import argparse
import copy
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_scripts import load_script
from vlgrpo import config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

reference = load_script("config_reference")


def test_configuration_reference_is_what_the_script_writes():
    page = reference.render(config.load_schema())
    assert (ROOT / "docs" / "configuration.md").read_text() == page, \
        "docs/configuration.md is stale: run `python scripts/config_reference.py` and commit the page"
    for key, _ in reference.walk(config.load_schema()):  # every key of the schema has its row or section
        assert f"`{key}`" in page


def test_every_schema_key_has_a_description():
    schema = config.load_schema()
    assert reference.undescribed(schema) == []
    broken = copy.deepcopy(schema)
    del broken["properties"]["trainer"]["properties"]["save_freq"]["description"]
    with pytest.raises(reference.MissingDescription, match=r"trainer\.save_freq"):
        reference.render(broken)
    assert reference.main(["--check"]) == 0


# --- claims of what is refused ------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "configuration.md")]
CLAIM = re.compile(r"refus|not supported|cannot honour|not implemented|must be 0", re.I)
# A claim a doc line makes -> configs (overrides of the demo) that config.validate must refuse, naming the key.
CONFIG_REFUSALS = {
    r"vLLM engine with several processes \(refused|is refused when the config is validated":
        [({"trainer": {"n_gpus_per_node": 2}, "worker": {"rollout": {"engine": "vllm"}}}, "worker.rollout.engine"),
         ({"trainer": {"nnodes": 2, "rdzv_endpoint": "h:1"}, "worker": {"rollout": {"engine": "vllm"}}}, "worker.rollout.engine")],
    r"`worker\.actor\.lora_rank` is refused": [({"worker": {"actor": {"lora_rank": 8}}}, "worker.actor.lora_rank")],
    r"gae( is)? refused|`gae` \| refused": [({"algorithm": {"adv_estimator": "gae"}}, "algorithm.adv_estimator")],
    r"full refused|distributions\) is refused": [({"algorithm": {"kl_penalty": "full"}}, "algorithm.kl_penalty")],
    r"is refused with the key to use instead, `kl_penalty`": [({"algorithm": {"kl_type": "low_var_kl"}}, "algorithm.kl_type")],
    r"vlgrpo refuses both set": [({"worker": {"actor": {"optim": {"lr_warmup_steps": 2, "lr_warmup_ratio": 0.1}}}},
                                  "worker.actor.optim.lr_warmup_steps")],
}
# Refusals at run time, not by the config: the test that shows each.
RUNTIME_REFUSALS = {
    r"lock stays and the next run refuses to start|it refuses otherwise": "test_a_lock_taken_on_another_host_is_kept",
    r"corrupted checkpoint is refused": "test_a_damaged_checkpoint_is_refused_and_the_previous_used",
    r"refus\w* checkpoint|checkpoints/refused/|refused checkpoint": "test_a_corrupt_checkpoint_is_set_aside_said_on_the_console_and_not_kept",
    r"unlock-stale` refuses while|It refuses otherwise, naming what still runs": "test_a_job_of_the_killed_run_that_still_runs_keeps_the_lock",
    r"refused where the swanlab package is not installed": "test_a_logger_whose_package_is_missing_is_refused_by_name",
    r"family is not supported, or whose `config.json` has no `model_type`":
        "test_unsupported_family_or_missing_model_type_stops_at_parse_time",
    # docs/from-easyr1.md: the key table is made from the converter's mapping, whose listing a test checks.
    r"^\| `[\w.*]+` \|.*\| .*(not supported|not implemented|refused)|\*not supported\*|\"NOT SUPPORTED\"|other values$|are not supported\), \*no effect\*":
        "test_values_vlgrpo_cannot_honour_are_listed_with_the_reason",
}
# What the docs say runs (README once said these were refused): each validates.
SUPPORTED = [
    {"trainer": {"n_gpus_per_node": 4}},
    {"trainer": {"n_gpus_per_node": 2, "nnodes": 2, "rdzv_endpoint": "node0:29500"}},
    {"worker": {"rollout": {"engine": "vllm", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.6}}},
    {"trainer": {"always_torchrun": True, "fsdp_cpu_offload": True}},
]


def claim_lines():
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CLAIM.search(line):
                yield f"{path.relative_to(ROOT)}:{number}", line


def test_every_refusal_the_docs_claim_is_one_the_code_makes():
    patterns = {**CONFIG_REFUSALS, **RUNTIME_REFUSALS}
    unchecked = [f"{where}: {line.strip()}" for where, line in claim_lines() if not any(re.search(p, line) for p in patterns)]
    assert not unchecked, ("a doc claims a refusal this test does not check; add it to CONFIG_REFUSALS (a config "
                           "config.validate must refuse) or RUNTIME_REFUSALS (the test that shows it):\n" + "\n".join(unchecked))
    for refusals in CONFIG_REFUSALS.values():
        for override, key in refusals:
            with pytest.raises(config.ConfigError, match=re.escape(key)):
                config.load(ROOT / "config.yaml", overrides=override)
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for test in RUNTIME_REFUSALS.values():
        assert f"def {test}(" in tests


@pytest.mark.parametrize("override", SUPPORTED, ids=str)
def test_what_the_docs_call_supported_validates(override):
    config.load(ROOT / "config.yaml", overrides=override)


# --- commands ------------------------------------------------------------------------------------

PROGRAM = re.compile(r"^(pip|snakemake|vlgrpo|python3?|mkdocs|envs/\S+\.sh|\.venv-vllm/bin/snakemake)(\s|$)")


def shown_commands():
    """(where, argv) of every command README.md and docs/ show: indented or fenced code blocks, and inline
    code that starts with a program and passes a flag. `a && b` is two commands; `\\` continues a line."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines, text = path.read_text().splitlines(), []
        block, fenced = [], False
        for number, line in enumerate(lines + [""], 1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced or line.startswith("    "):
                block.append((number, line.strip()))
                continue
            text.append((number, line))
        joined = []  # code lines with their continuations
        for number, line in block:
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line)
            else:
                joined.append((number, line))
        inline = [(number, span) for number, line in text for span in re.findall(r"`([^`]+)`", line)
                  if PROGRAM.match(span) and (" -" in span or re.match(r"python3? scripts/", span))]
        inline += [(number, f"snakemake --cores all {span}")  # an override shown alone applies to the demo
                   for number, line in text for span in re.findall(r"`(--config [^`]+)`", line)]
        for number, line in joined + inline:
            if not PROGRAM.match(re.sub(r"^([A-Z_]+=\S+\s+)*", "", line)):
                continue  # not a command: a folder tree, a table
            for part in line.split("&&"):
                argv = shlex.split(part.replace("[...]", ""), comments=True)
                while argv and re.match(r"^[A-Z_]+=", argv[0]):  # environment assignments
                    argv.pop(0)
                if argv:
                    yield f"{path.relative_to(ROOT)}:{number}", argv


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args once the arguments parsed: nothing runs."""


@pytest.fixture
def parse_only(monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def parse_with_main(main, argv, monkeypatch):
    """Run an entry point's main only up to its argument parsing; a bad flag fails the test."""
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except Parsed:
        return
    except SystemExit as e:
        assert e.code in (0, None), f"{argv}: the parser refused it (exit {e.code})"
        return
    raise AssertionError(f"{argv}: main returned without parsing arguments")


def check_python(argv, monkeypatch):
    if argv[:2] == ["-m", "pytest"]:
        return
    if argv[:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.run import get_args_parser

        try:
            get_args_parser().parse_args(argv[2:])
        except Parsed as parsed:
            launch = parsed.args[0]
        argv = (["-m"] if launch.module else []) + [launch.training_script, *launch.training_script_args]
    if argv[:2] == ["-m", "vlgrpo.cli"]:
        return check_vlgrpo(argv[2:], monkeypatch)
    assert argv[0].startswith("scripts/"), f"python {argv}: not a command this test knows"
    parse_with_main(load_script(Path(argv[0]).stem).main, argv[1:], monkeypatch)


def check_vlgrpo(argv, monkeypatch):
    from vlgrpo import cli

    parse_with_main(cli.main, argv, monkeypatch)
    if "--config" in argv and argv[argv.index("--config") + 1].startswith("configs/"):  # an experiment config
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        config.load(ROOT / argv[argv.index("--config") + 1], overrides=config.parse_assignments(sets))


def check_snakemake(argv):
    from snakemake.cli import get_argument_parser, parse_config

    args = get_argument_parser().parse_args(argv)
    rules = re.findall(r"^(?:rule|checkpoint) (\w+):", "\n".join(p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk")), re.M)
    assert set(args.targets) <= {*rules, "all"}, f"unknown targets {args.targets}"
    for profile in args.profile if isinstance(args.profile, list) else filter(None, [args.profile]):
        assert (ROOT / profile / "config.yaml").is_file(), f"no profile {profile}"
    if not args.report:  # the config these flags give must validate (what the workflow does when parsed)
        config.load(*(args.configfile or [ROOT / "config.yaml"]), overrides=parse_config(args.config or []))


def check_pip(argv):
    assert argv[:2] == ["install", "-e"], argv
    extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", argv[2])
    assert extras, f"pip installs {argv[2]}, not this checkout"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(filter(None, (extras.group(1) or "").split(","))) <= set(declared)


def test_docs_show_the_commands_this_test_checks():
    shown = {" ".join(argv) for _, argv in shown_commands()}
    for command in ("pip install -e .", "snakemake --cores all", "python -m pytest",
                    "snakemake --profile profiles/slurm --configfile configs/qwen2_5_vl_3b_geo3k.yaml",
                    "python scripts/config_reference.py", "mkdocs build --strict"):
        assert command in shown


def test_every_command_in_the_docs_parses_with_its_program(parse_only, monkeypatch):
    """The demo and test commands are the ones CI runs (below); the rest need a GPU, a cluster or the hub,
    so each is parsed by its program's own parser (snakemake's, vlgrpo's, the script's, torchrun's) and the
    configs it names are loaded and validated: a renamed flag or key fails here, not for a reader."""
    failures = []
    for where, argv in shown_commands():
        program, args = Path(argv[0]).name, argv[1:]
        paths = [a for a in args if re.match(r"^(configs|scripts|profiles|envs)/", a)]
        try:
            for path in paths:
                assert (ROOT / path).exists(), f"{path} does not exist"
            if program == "snakemake":
                check_snakemake(args)
            elif program == "vlgrpo":
                check_vlgrpo(args, monkeypatch)
            elif program in ("python", "python3"):
                check_python(args, monkeypatch)
            elif program == "pip":
                check_pip(args)
            elif program == "mkdocs":
                assert args[0] == "build" and "--strict" in args  # test_the_site_builds runs it
            else:
                assert (ROOT / argv[0]).is_file() and os.access(ROOT / argv[0], os.X_OK), f"{argv[0]} is not an executable here"
        except (AssertionError, config.ConfigError, SystemExit, KeyError) as e:
            failures.append(f"{where}: {shlex.join(argv)}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_readme_set_up_commands_are_what_ci_runs(monkeypatch, tmp_path):
    from snakemake.cli import get_argument_parser

    readme = [" ".join(argv) for where, argv in shown_commands() if where.startswith("README.md")]
    assert readme[:4] == ["pip install -e .", "snakemake --cores all", "pip install -e .[dev]", "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    ci_extras = set(re.search(r"pip install -q -e '\.\[([\w,]+)\]'", ci).group(1).split(","))
    assert {"dev", "docs"} <= ci_extras
    pytest_line = re.search(r"^python -m pytest(.*)$", ci, re.M).group(1)
    assert " -m " not in pytest_line and "-k" not in pytest_line  # CI runs every test, the demo workflow's included
    # The demo CI runs (tests/test_workflow.py) is README's command: Snakemake on this Snakefile with the
    # embedded config.yaml (no --configfile), only smaller and elsewhere.
    import test_workflow

    ran = []
    monkeypatch.setattr(test_workflow.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    test_workflow.snakemake(tmp_path / "work", tmp_path / "demo")
    args = get_argument_parser().parse_args(ran[0][1:])
    assert ran[0][0] == "snakemake" and args.cores and not args.configfile and not args.targets
    assert Path(args.snakefile) == ROOT / "Snakefile"
    written = config.experiment_dir(config.load(ROOT / "config.yaml")) / "report" / "report.html"
    assert written.as_posix() == "results/demo/report/report.html"
    assert "`results/demo/report/report.html`" in (ROOT / "README.md").read_text()


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()

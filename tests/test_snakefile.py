"""Reading the workflow has no side effects, and a recipe stands on the schema, never on the demo."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from vlgrpo import config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # about 10 s per Snakemake invocation on 2 cores


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.fixture
def minimal(tmp_path) -> Path:
    """A recipe with nothing but its name, model and data (paths that do not exist)."""
    path = tmp_path / "minimal.yaml"
    path.write_text(yaml.safe_dump({
        "experiment": "minimal", "model": {"path": str(tmp_path / "model")},
        "data": {"train": str(tmp_path / "train.parquet"), "val": str(tmp_path / "val.parquet")},
    }))
    return path


def test_a_dry_run_and_a_lint_write_nothing_of_the_workflow(tmp_path):
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    before = tree(work)
    dry = snakemake(work, "-n", "--cores", "1")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "filter_data" in dry.stdout
    lint = snakemake(work, "--lint")
    assert lint.returncode == 0 and "good condition" in lint.stdout + lint.stderr, lint.stdout[-2000:]
    # Snakemake keeps its own bookkeeping in .snakemake/ (the lint its log); nothing else appears.
    after = {p: t for p, t in tree(work).items() if not p.startswith(".snakemake")}
    assert after == before
    assert not list(work.glob(".snakemake/vlgrpo*"))


def test_a_recipe_resolves_to_the_schema_defaults_not_the_demo(tmp_path, minimal):
    """The resolved config is written when jobs are about to run (onstart); the filter job then fails
    on the missing data, which is fine here."""
    work = tmp_path / "work"
    snakemake(work, "results/minimal/data/train.parquet", "--cores", "1", "--configfile", str(minimal))
    resolved = yaml.safe_load((work / "results/minimal/config.resolved.yaml").read_text())
    assert resolved == config.validate(yaml.safe_load(minimal.read_text()))
    demo = config.load(ROOT / "config.yaml")
    assert resolved["worker"]["actor"]["optim"]["lr"] == 1e-6 != demo["worker"]["actor"]["optim"]["lr"]
    assert resolved["trainer"]["device"] == "auto" and resolved["data"]["max_pixels"] == 524288
    assert (work / ".snakemake/vlgrpo_lock_owner.json").is_file()  # onstart records the lock's owner


def test_unsupported_keys_stop_the_workflow_at_parse_time_naming_them(tmp_path):
    recipe = ROOT / "configs" / "qwen2_5_vl_3b_geo3k.yaml"
    ok = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(recipe))
    assert ok.returncode == 0, ok.stderr[-2000:]  # the seed recipe as it stands: one GPU
    many = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(recipe), "--config", "trainer={n_gpus_per_node: 4}")
    assert many.returncode == 0, many.stderr[-2000:]  # four GPUs: one torchrun job of 4 processes
    for overrides, name in [(["trainer={nnodes: 2}"], "'trainer.nnodes' 2 needs 'trainer.rdzv_endpoint'"),
                            (["trainer={n_gpus_per_node: 4}", "worker={rollout: {engine: vllm}}"], "'worker.rollout.engine' vllm")]:
        out = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(recipe), "--config", *overrides)
        assert out.returncode != 0 and name in out.stderr + out.stdout

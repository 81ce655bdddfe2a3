"""Nothing lost, ever (issue 28, items 1, 3, 5, 6): content, not timestamps, decides what reruns; a
validation whose weights are gone is put back, never lost; the demo's data and model live in folders
keyed by their settings; resuming without a tracker or past a corrupt checkpoint."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import make_experiment
from vlgrpo import config, evaluate, paths
from vlgrpo.checkpoint import CheckpointStore
from vlgrpo.trainer import GRPOTrainer, run_segment

ROOT = Path(__file__).resolve().parents[1]
NOTHING = "Nothing to be done"


def console_pipe(monkeypatch):
    """A pipe standing for the job's console (the rules' fd 3); returns a reader of what was said."""
    read, write = os.pipe()
    monkeypatch.setenv("VLGRPO_CONSOLE_FD", str(write))

    def said() -> str:
        os.close(write)
        text = os.read(read, 1 << 20).decode()
        os.close(read)
        return text

    return said


# --- fast: the parts ------------------------------------------------------------------------------


def test_content_not_timestamps_makes_a_digest(tmp_path):
    from vlgrpo import fingerprint

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "weights.bin").write_bytes(b"\1" * 1000)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("bookkeeping")
    before = fingerprint.digest(folder), fingerprint.digest(folder / "weights.bin")
    os.utime(folder / "weights.bin", (1, 1))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)  # another inode, other timestamps, the same bytes
    (copy / ".cache" / "x").write_text("other bookkeeping")
    assert (fingerprint.digest(folder), fingerprint.digest(folder / "weights.bin")) == before
    assert fingerprint.digest(copy) == before[0]
    (copy / "weights.bin").write_bytes(b"\1" * 999 + b"\2")
    assert fingerprint.digest(copy) != before[0]


def test_demo_folders_are_keyed_by_what_makes_them():
    """Issue 28 (3): the same settings share one folder, another seed, pixel bounds or template another."""
    from vlgrpo import demo_folders

    base = config.load(ROOT / "config.yaml")
    a = demo_folders.keyed(base)
    assert demo_folders.keyed(a) == a  # a resolved config stays as it is
    assert a["model"]["path"].startswith("results/_demo/tiny_qwen2_5_vl-")
    assert a["data"]["train"].startswith("results/_demo/geometry_synth-") and a["data"]["train"].endswith("/train.parquet")
    assert Path(a["data"]["val"]).parent == Path(a["data"]["train"]).parent == demo_folders.data_dir(a)
    same = demo_folders.keyed(config.load(ROOT / "config.yaml", overrides={"experiment": "other", "trainer": {"max_steps": 9}}))
    assert (same["model"]["path"], same["data"]["train"]) == (a["model"]["path"], a["data"]["train"])
    seed = demo_folders.keyed(config.load(ROOT / "config.yaml", overrides={"seed": 2}))
    assert seed["model"]["path"] != a["model"]["path"] and seed["data"]["train"] != a["data"]["train"]
    pixels = demo_folders.keyed(config.load(ROOT / "config.yaml", overrides={"data": {"max_pixels": 50176}}))
    assert pixels["model"]["path"] != a["model"]["path"] and pixels["data"]["train"] == a["data"]["train"]
    own = config.load(ROOT / "config.yaml", overrides={"model": {"path": "/models/qwen"}, "data": {"train": "/d/train.parquet"}})
    assert demo_folders.keyed(own)["model"]["path"] == "/models/qwen"
    assert demo_folders.keyed(own)["data"]["train"] == "/d/train.parquet"


def test_a_validation_whose_weights_are_gone_is_put_back_not_lost(demo_base, tmp_path, monkeypatch):
    """Issue 28 (1): the evaluate rule reruns (Snakemake deleted its outputs) for a step whose weights
    were removed after validation: the kept result comes back, the same, and the console says so."""
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"save_freq": 5, "val_freq": 5}})
    exp = config.experiment_dir(cfg)
    trainer = GRPOTrainer(cfg)
    trainer.load(0)
    trainer.save(5, "run").result()
    resolved = paths.path(paths.RESOLVED, exp)
    first = evaluate.main(resolved, 5)
    placed = [paths.path(p, exp, step=5) for p in (paths.VAL, paths.GENERATIONS)]
    texts = [p.read_text() for p in placed]
    shutil.rmtree(CheckpointStore(paths.path(paths.CHECKPOINTS, exp)).path(5))  # keep_validated_weights: false
    for p in placed:
        p.unlink()  # as Snakemake does before it reruns the job
    said = console_pipe(monkeypatch)
    assert evaluate.main(resolved, 5) == first
    assert [p.read_text() for p in placed] == texts
    assert "step 5: its weights were removed after validation" in said()
    # Settings that change the result: the kept one is not put back; the missing weights are said.
    other = config.deep_merge(cfg, {"worker": {"rollout": {"val_override_config": {"temperature": 0.5}}}})
    config.write_resolved(other, resolved)
    for p in placed:
        p.unlink()
    with pytest.raises(FileNotFoundError, match="no model weights for step 5"):
        evaluate.main(resolved, 5)
    assert paths.path(paths.VAL_KEPT, exp, step=5).read_text() == texts[0]


@pytest.mark.slow
def test_a_lost_tracker_and_a_corrupt_checkpoint_resume_from_an_intact_one(demo_base, tmp_path, monkeypatch):
    """Issue 28 (5, 6) on the demo model: without latest.json the segment resumes from the newest
    checkpoint, not step 0; a corrupt one is set aside (named on the console), is not counted as kept,
    and the one before it is resumed from."""
    cfg = make_experiment(demo_base, tmp_path, {"trainer": {"save_freq": 2, "val_freq": 100, "max_steps": 6,
                                                           "val_before_train": False}})
    exp = config.experiment_dir(cfg)
    store = CheckpointStore(paths.path(paths.CHECKPOINTS, exp))
    run_segment(cfg, 2, paths.path(paths.MARKER, exp, step=2))
    (store.root / "latest.json").unlink()
    assert run_segment(cfg, 4, paths.path(paths.MARKER, exp, step=4))["start_step"] == 2
    biggest = max(store.path(4).rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 1
    biggest.write_bytes(bytes(data))
    said = console_pipe(monkeypatch)
    assert run_segment(cfg, 6, paths.path(paths.MARKER, exp, step=6))["start_step"] == 2
    text = said()
    assert "refusing checkpoint 4" in text and str(store.root / "refused" / "global_step_000004") in text
    assert "resuming from checkpoint 2 instead of the tracker's 4" in text
    assert store.steps() == [2, 6] and store.verify(2) is None  # keep_checkpoints 2: the intact ones


# --- slow: the workflow ---------------------------------------------------------------------------


def snakemake(workdir: Path, *config_items: str, targets=(), dry=False, check=True):
    cmd = ["snakemake", "--cores", "2", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
           *(["-n"] if dry else []), *targets, "--config", *config_items]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLGRPO_FAULT")}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if check:
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out


def touch_and_copy_again(*items: Path) -> None:
    """Every file under items gets a new timestamp, or a new inode (copied over itself)."""
    files = [f for item in items for f in ([item] if item.is_file() else sorted(item.rglob("*"))) if f.is_file()]
    for i, f in enumerate(files):
        if i % 2:
            shutil.copyfile(f, f.with_name(f.name + ".copy"))
            os.replace(f.with_name(f.name + ".copy"), f)
        else:
            f.touch()
    for item in items:
        item.touch()


@pytest.mark.slow
def test_touched_or_copied_inputs_rerun_nothing_and_lose_no_validation(demo_base, tmp_path):
    """Issue 28 (1): the issue's command on a finished run whose inputs are then touched or copied
    again: nothing to be done. Then the validation data changes: what can be recomputed is, and the
    result of a step whose weights were pruned is put back, not deleted."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    train, val, model = inputs / "train_copy.parquet", inputs / "val_copy.parquet", inputs / "model"
    shutil.copyfile(demo_base["data"]["train"], train)
    shutil.copyfile(demo_base["data"]["val"], val)
    shutil.copytree(demo_base["model"]["path"], model)
    items = ["experiment=t1", f"model={{path: {model}}}", f"data={{train: {train}, val: {val}}}",
             "trainer={max_steps: 4, save_freq: 2, val_freq: 2, keep_checkpoints: 1, retries: 0}"]
    work = tmp_path / "work"
    snakemake(work, *items)
    exp = work / "results" / "t1"
    assert not (exp / "checkpoints" / "global_step_000002").exists()  # validated, then pruned
    touch_and_copy_again(train, val, model)
    again = snakemake(work, *items)
    assert NOTHING in again.stdout + again.stderr, again.stdout[-3000:]

    table = pq.read_table(val)
    pq.write_table(table.slice(0, table.num_rows - 2), val)  # other validation data
    kept = (exp / "val" / "step_000002.json").read_text()
    changed = snakemake(work, *items)
    log = changed.stdout + changed.stderr
    assert "step 2: its weights were removed after validation" in log  # said on the console
    assert (exp / "val" / "step_000002.json").read_text() == kept
    assert json.loads((exp / "val" / "step_000004.json").read_text())["val/overall_reward"] is not None
    assert (exp / "report" / "summary.json").is_file()


@pytest.mark.slow
def test_the_demo_model_of_one_experiment_is_never_rebuilt_by_another(tmp_path):
    """Issue 28 (3): experiments with another seed get their own demo data and model; one with the
    same settings shares them; a build that fails leaves every other model as it was."""
    demo = tmp_path / "demo"
    common = [f"demo={{out_dir: {demo}, n_train: 32, n_val: 8, n_test: 8, warmup_steps: 5, perception_steps: 5}}",
              f"model={{path: {demo}/tiny}}",
              f"data={{train: {demo}/geometry_synth/train.parquet, val: {demo}/geometry_synth/test.parquet}}"]
    work = tmp_path / "work"
    targets = ["demo_model", "demo_data"]
    snakemake(work, "experiment=a", *common, targets=targets)
    built = {p: p.stat().st_mtime_ns for p in demo.rglob("*") if p.is_file() and "logs" not in p.parts}
    assert any(p.name == "config.json" for p in built)
    snakemake(work, "experiment=b", "seed=2", *common, targets=targets)
    assert len([p for p in demo.iterdir() if p.name.startswith("tiny-")]) == 2
    assert len([p for p in demo.iterdir() if p.name.startswith("geometry_synth-")]) == 2
    template = tmp_path / "broken.jinja"
    template.write_text("{{ content ")  # a Jinja syntax error: the build fails
    failed = snakemake(work, "experiment=c", *common[:2], common[2][:-1] + f", format_prompt: {template}}}",
                       targets=["demo_model"], check=False)
    assert failed.returncode != 0
    assert {p: p.stat().st_mtime_ns for p in built} == built  # a's files untouched by b's and c's builds
    for exp in ("a", "d"):  # d: another experiment with a's settings shares its folders
        rerun = snakemake(work, f"experiment={exp}", *common, targets=targets, dry=True)
        assert NOTHING in rerun.stdout + rerun.stderr, rerun.stdout[-3000:]

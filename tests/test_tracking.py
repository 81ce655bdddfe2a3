"""Metric logs that survive resume: one reader that merges each step's training and validation records,
and one W&B run (offline here) for every segment and validation of an experiment."""

import json
import math
import struct
from pathlib import Path

import pytest

from vlgrpo import config, evaluate, paths
from vlgrpo.tracking import RecordError, Tracker, append_record, read_metrics, read_records, wandb_run_id

BASE = {"experiment": "t", "model": {"path": "m"}, "data": {"train": "a.parquet", "val": "b.parquet"}}


def test_resumed_steps_appear_once_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step, value in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35)]:  # resumed from step 1
        append_record(path, {"step": step, "reward/overall": value})
    append_record(path, {"step": 4, "actor/pg_loss": math.nan})
    with open(path, "a") as f:
        f.write('{"step": 5, "reward/ov')  # killed mid-write
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("reward/overall") for r in records[:3]] == [0.1, 0.25, 0.35]
    assert '"actor/pg_loss": null' in path.read_text()  # NaN stored as null: the line stays valid JSON
    assert math.isnan(records[3]["actor/pg_loss"])


def test_a_record_after_a_torn_line_starts_afresh_and_corruption_elsewhere_is_refused(tmp_path, caplog):
    """A job killed mid-write leaves a torn last line; the next segment's records must not join it."""
    path = tmp_path / "metrics.jsonl"
    append_record(path, {"step": 1, "reward/overall": 0.1})
    with open(path, "a") as f:
        f.write('{"step": 2, "reward/ov')  # killed mid-write
    assert [r["step"] for r in read_records(path)] == [1]
    assert f"{path}:2: skipped a torn last line" in caplog.text  # reading says so
    for step in (2, 3):  # the resumed segment logs step 2 again, then step 3
        append_record(path, {"step": step, "reward/overall": step / 10})
    assert f"{path}:2: cut off a torn last line" in caplog.text and '{"step": 2, "reward/ov' in caplog.text
    assert [(r["step"], r["reward/overall"]) for r in read_metrics(path)] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert all(json.loads(line) for line in path.read_text().splitlines())  # the file is valid JSONL again
    # A damaged line that is not the last is refused, naming the file and line.
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:-5], lines[2]]) + "\n")
    with pytest.raises(RecordError, match=f"{path}:2: not valid JSON.*repair or delete it"):
        read_records(path)


def test_a_validation_record_and_later_timings_join_their_training_step(tmp_path):
    """EasyR1 logs a validated step as one record; the reader rebuilds it from the three lines."""
    path = tmp_path / "metrics.jsonl"
    append_record(path, {"step": 0, "val/accuracy_reward": 0.1}, kind="val")  # the baseline
    append_record(path, {"step": 5, "reward/overall": 0.4, "timing_s/step": 2.0})
    append_record(path, {"step": 5, "timing_s/save_checkpoint": 0.5})  # after the save
    append_record(path, {"step": 5, "val/accuracy_reward": 0.3, "timing_s/validation": 9.0}, kind="val")
    append_record(path, {"step": 5, "reward/overall": 0.45, "timing_s/step": 2.1})  # a resumed re-log
    assert [(r["step"], r["kind"]) for r in read_records(path)] == [(0, "val"), (5, "train"), (5, "train"), (5, "val"), (5, "train")]
    assert read_metrics(path) == [
        {"step": 0, "val/accuracy_reward": 0.1},
        {"step": 5, "reward/overall": 0.45, "timing_s/step": 2.1, "timing_s/save_checkpoint": 0.5,
         "val/accuracy_reward": 0.3, "timing_s/validation": 9.0},
    ]


def test_the_run_id_is_made_once(tmp_path):
    first = wandb_run_id(tmp_path)
    assert wandb_run_id(tmp_path) == first and len(first) == 12
    assert (tmp_path / "wandb_run_id").read_text().strip() == first
    assert [p.name for p in tmp_path.iterdir()] == ["wandb_run_id"]  # no temporary file left


def wandb_records(path: Path):
    """The records of a W&B transaction log (run-<id>.wandb): a 7-byte header, then LevelDB-style
    log blocks of 32 KiB whose chunks carry serialized wandb_internal Record protos."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[0] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_segments_and_validations_log_into_one_wandb_run_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config.validate({**BASE, "results_dir": str(tmp_path), "trainer": {"logger": ["file", "wandb"], "wandb_mode": "offline"}})
    exp = config.experiment_dir(cfg)
    evaluate.log_validation(cfg, {"step": 0, "val/accuracy_reward": 0.1, "samples": [{"response": "x"}]})  # baseline
    first = Tracker(cfg, exp)  # segment 1
    first.log({"step": 1, "reward/overall": 0.5})
    first.add_timings(1, {"save_checkpoint": 0.25})
    first.close()
    evaluate.log_validation(cfg, {"step": 1, "val/accuracy_reward": 0.2, "timing_s/validation": 3.0})
    second = Tracker(cfg, exp)  # segment 2
    second.log({"step": 2, "reward/overall": 0.6})
    second.close()
    import wandb

    wandb.teardown()  # as at a job's exit: the service flushes every transaction log before we read them

    run_id = (exp / "wandb_run_id").read_text().strip()
    assert first.run_id == second.run_id == run_id
    runs = sorted((exp / "wandb").glob("offline-run-*"))
    assert len(runs) == 4 and all(r.name.split("-")[3] == run_id for r in runs)  # one run, four jobs
    history, axes = [], set()
    for run in runs:
        records = list(wandb_records(run / f"run-{run_id}.wandb"))
        kinds = [r.WhichOneof("record_type") for r in records]
        assert kinds[-1:] == ["exit"], f"{run.name} holds {kinds}"  # the whole log, to its end
        assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {run_id}
        axes |= {(r.metric.name or r.metric.glob_name, r.metric.step_metric) for r in records if r.WhichOneof("record_type") == "metric"}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                history.append({k: v for k, v in row.items() if not k.startswith("_")})
    assert ("*", "global_step") in axes  # every metric, validation too, against the training step
    assert sorted(history, key=lambda h: (h["global_step"], sorted(h))) == [
        {"global_step": 0, "val/accuracy_reward": 0.1},
        {"global_step": 1, "reward/overall": 0.5},
        {"global_step": 1, "timing_s/save_checkpoint": 0.25},
        {"global_step": 1, "val/accuracy_reward": 0.2, "timing_s/validation": 3.0},
        {"global_step": 2, "reward/overall": 0.6},
    ]
    assert read_metrics(paths.path(paths.METRICS, exp)) == [
        {"step": 0, "val/accuracy_reward": 0.1},
        {"step": 1, "reward/overall": 0.5, "timing_s/save_checkpoint": 0.25, "val/accuracy_reward": 0.2, "timing_s/validation": 3.0},
        {"step": 2, "reward/overall": 0.6},
    ]


def test_console_tensorboard_and_mlflow_get_every_record_of_every_job(tmp_path, capsys):
    """trainer.logger with EasyR1's names: two jobs (a segment, a validation) log into one TensorBoard
    folder and one MLflow run (a local SQLite store), each scalar at its training step."""
    pytest.importorskip("tensorboard", reason="trainer.logger tensorboard needs tensorboard: pip install -e '.[loggers]'")
    pytest.importorskip("mlflow", reason="trainer.logger mlflow needs mlflow: pip install -e '.[loggers]'")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config.validate({**BASE, "results_dir": str(tmp_path), "trainer": {"logger": ["console", "file", "tensorboard", "mlflow"]}})
    exp = config.experiment_dir(cfg)
    first = Tracker(cfg, exp)
    first.log({"step": 1, "reward/overall": 0.5, "actor/lr": 1e-6})
    first.close()
    evaluate.log_validation(cfg, {"step": 1, "val/pass@4": 0.25, "val/overall_reward": 0.75})
    second = Tracker(cfg, exp)
    second.log({"step": 2, "reward/overall": 0.625, "actor/lr": 1e-6})
    second.close()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "step 1 (train): actor/lr=1e-06 reward/overall=0.5"
    assert "step 1 (val): val/overall_reward=0.75 val/pass@4=0.25" in printed

    scalars: dict = {}
    for events in sorted((exp / "tensorboard").glob("events.out.tfevents.*")):  # one file per job
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    assert sorted(scalars) == ["actor/lr", "reward/overall", "val/overall_reward", "val/pass@4"]
    assert sorted(scalars["reward/overall"]) == [(1, 0.5), (2, 0.625)] and scalars["val/pass@4"] == [(1, 0.25)]

    client = MlflowClient(tracking_uri=f"sqlite:///{(exp / 'mlflow.db').resolve()}")
    run_id = (exp / "mlflow_run_id").read_text().strip()
    (run,) = client.search_runs([client.get_experiment_by_name("vlgrpo").experiment_id])
    assert run.info.run_id == run_id and run.info.run_name == "t"  # one run for both jobs
    assert run.data.params["trainer/logger"] == "['console', 'file', 'tensorboard', 'mlflow']"
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
               for k in ("reward/overall", "val/pass_4", "val/overall_reward")}
    assert history == {"reward/overall": [(1, 0.5), (2, 0.625)], "val/pass_4": [(1, 0.25)], "val/overall_reward": [(1, 0.75)]}


def test_a_logger_whose_package_is_missing_is_refused_by_name(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    with pytest.raises(config.ConfigError, match=r"'trainer.logger' \['swanlab'\]: not installed here.*pip install swanlab"):
        config.validate({**BASE, "trainer": {"logger": ["file", "swanlab"]}})
    with pytest.raises(config.ConfigError, match="allowed values: 'console', 'file', 'wandb', 'tensorboard', 'mlflow', 'swanlab'"):
        config.validate({**BASE, "trainer": {"logger": ["neptune"]}})


def test_swanlab_logs_one_offline_run_where_installed(tmp_path):
    pytest.importorskip("swanlab", reason="trainer.logger swanlab needs the swanlab package (pip install swanlab)")
    cfg = config.validate({**BASE, "results_dir": str(tmp_path), "trainer": {"logger": ["swanlab"]}})
    exp = config.experiment_dir(cfg)
    for step in (1, 2):  # two jobs
        tracker = Tracker(cfg, exp)
        tracker.log({"step": step, "reward/overall": 0.5})
        tracker.close()
    run_id = (exp / "swanlab_run_id").read_text().strip()
    logs = sorted((exp / "swanlab").glob(f"run-*-{run_id}/run-{run_id}.swanlab"))
    assert len(logs) == 2 and all(b"reward/overall" in log.read_bytes() for log in logs)

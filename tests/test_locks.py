"""`vlgrpo unlock-stale` releases a lock only when its Snakemake ran on this host and is gone, and so
are its jobs; one trainer per experiment holds the trainer lock."""

import json
import os
import subprocess
import sys
import time

import pytest

from vlgrpo import locks


@pytest.fixture
def locked(tmp_path):
    """A Snakemake directory with a lock, as a run leaves it when it is killed."""
    root = tmp_path / ".snakemake"
    (root / "locks").mkdir(parents=True)
    (root / "locks" / "0.output.lock").write_text("results/x\n")
    return root


def owned_by(root, **changes):
    """Record a finished process as the lock's owner, with `changes` to its identity."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    locks.record_owner(root, pid=child.pid)
    child.wait()
    owner = json.loads((root / locks.OWNER).read_text())
    (root / locks.OWNER).write_text(json.dumps({**owner, **changes}))
    return owner


def test_the_lock_of_a_process_gone_from_this_host_is_released(locked):
    owner = owned_by(locked)
    assert f"process {owner['pid']}" in locks.release_stale(locked)
    assert not (locked / "locks").exists() and not (locked / locks.OWNER).exists()
    assert locks.release_stale(locked).startswith("no lock")


def test_the_lock_of_a_run_before_a_reboot_is_released(locked):
    owned_by(locked, boot_id="another-boot")
    assert "restarted" in locks.release_stale(locked)
    assert not (locked / "locks").exists()


def test_a_lock_taken_on_another_host_is_kept(locked):
    owned_by(locked, host="node-17")
    with pytest.raises(locks.StaleLockError, match="on host node-17.*snakemake --unlock"):
        locks.release_stale(locked)
    assert (locked / "locks" / "0.output.lock").is_file()


def test_the_lock_of_a_live_process_is_kept(locked):
    locks.record_owner(locked)  # this process
    with pytest.raises(locks.StaleLockError, match="still running"):
        locks.release_stale(locked)
    assert (locked / "locks" / "0.output.lock").is_file()


def test_a_reused_pid_is_not_the_owner(locked):
    owner = owned_by(locked)
    (locked / locks.OWNER).write_text(json.dumps({**owner, "pid": os.getpid()}))  # alive, started earlier
    assert "has exited" in locks.release_stale(locked)


def test_an_unrecorded_owner_is_refused(locked):
    with pytest.raises(locks.StaleLockError, match="not recorded.*snakemake --unlock"):
        locks.release_stale(locked)
    assert (locked / "locks").is_dir()


def test_the_command(locked):
    owned_by(locked, host="node-17")
    out = subprocess.run([sys.executable, "-m", "vlgrpo.cli", "unlock-stale", "--directory", str(locked.parent)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "node-17" in out.stderr


def test_a_job_of_the_killed_run_that_still_runs_keeps_the_lock(locked, tmp_path):
    """Snakemake was SIGKILLed, its jobs were not: a rerun now would start a second trainer."""
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                           env={**os.environ, locks.RUN_ENV: "run-1"})
    try:
        owner = owned_by(locked, run="run-1", experiment=str(tmp_path / "results" / "x"))
        with pytest.raises(locks.StaleLockError, match=f"process {owner['pid']} .*is gone, but jobs of its run still "
                                                       f"run: process {job.pid} .*time.sleep"):
            locks.release_stale(locked)
        assert (locked / "locks" / "0.output.lock").is_file()
    finally:
        job.kill()
        job.wait()
    assert "has exited" in locks.release_stale(locked)


def test_a_trainer_holding_the_experiment_keeps_the_lock_and_a_second_trainer_is_refused(locked, tmp_path):
    exp = tmp_path / "results" / "x"
    owned_by(locked, run="run-2", experiment=str(exp))
    with locks.trainer_lock(exp, 10):
        with pytest.raises(locks.StaleLockError, match=f"the trainer process {os.getpid()} .*segment to step 10"):
            locks.release_stale(locked)
        started = time.monotonic()
        with pytest.raises(locks.TrainerBusyError, match=f"process {os.getpid()} .*segment to step 10.* holds {exp}"):
            with locks.trainer_lock(exp, 20, wait_s=1.0):
                pass
        assert time.monotonic() - started >= 1.0  # it waited for the first to end
    assert locks.trainer_holder(exp) is None
    with locks.trainer_lock(exp, 20, wait_s=0):  # free again once the first ends
        assert locks.trainer_holder(exp)["end_step"] == 20
    assert "has exited" in locks.release_stale(locked)

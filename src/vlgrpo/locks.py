"""Who may run: one trainer per experiment, trainers that die with their watchdog, and the release
of the lock a hard-killed Snakemake leaves behind, only when that is safe.

A segment's trainer (rank 0) holds an exclusive lock on results/<exp>/segments/trainer.lock for the
whole segment (`trainer_lock`), the file naming its holder: a second trainer of the experiment waits
a little (a retry may start while the killed attempt is still dying), then fails naming the first.
The watchdog (`vlgrpo train`) starts its trainer with PR_SET_PDEATHSIG on Linux, and every trainer
process also polls the watchdog (`exit_with_watchdog`, for torchrun's ranks, which are its
grandchildren), so a trainer whose watchdog was killed does not keep running beside the retry.

Snakemake locks its working directory (.snakemake/locks) for the run's files and removes the lock
when it exits; SIGKILL or a lost node leaves the lock, and the next run refuses to start.
`snakemake --unlock` removes it whoever holds it, which on a shared file system can break a run
that is still going on another node. So the workflow's onstart records the owner beside the lock
(host, boot id, PID and the PID's start time), and `vlgrpo unlock-stale` removes the lock only when
that owner ran on this host and is gone (a new boot id: the machine restarted; the same boot id: no
process with that PID and start time), and no job of its run is alive: the onstart also gives the
run an id that every job inherits (RUN_ENV), so a job left running by the killed Snakemake is found
by it, and a trainer by the experiment's trainer lock. Anything else is refused with what to check
and the command that unlocks regardless.

Snakemake checks the lock after parsing the workflow and building the job graph, before any hook
runs, so the workflow itself cannot release it without acting at parse time (which a dry run, a
lint or a report also does); hence a command, run before the same snakemake command:

    vlgrpo unlock-stale [--directory DIR] && snakemake --cores all ...
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from vlgrpo import paths
from vlgrpo.errors import VlgrpoError

OWNER = "vlgrpo_lock_owner.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
RUN_ENV = "VLGRPO_RUN"  # the workflow run's id, which every job it starts inherits (onstart sets it)
WATCHDOG_ENV = "VLGRPO_WATCHDOG"  # "pid:start time" of the `vlgrpo train` watchdog, for its trainer
TRAINER_LOCK_WAIT_S = 60.0  # how long a trainer waits for the one before it to end
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork

log = logging.getLogger(__name__)


class StaleLockError(VlgrpoError, RuntimeError):
    """The lock may belong to a live Snakemake: it is kept, and the message says why."""


class TrainerBusyError(RuntimeError):
    """Another trainer holds the experiment's trainer lock. Not a VlgrpoError: it is a fault that a
    retry may outlast (the other trainer ends), not a mistake in the user's input."""


def _describe(identity: dict) -> str:
    what = f"process {identity.get('pid')} on host {identity.get('host')}"
    return what + (f" (segment to step {identity['end_step']})" if "end_step" in identity else "")


@contextlib.contextmanager
def trainer_lock(exp_dir: str | os.PathLike, end_step: int, wait_s: float | None = None):
    """Hold the experiment's trainer lock (an exclusive flock on segments/trainer.lock) for the block.

    Waits up to `wait_s` (TRAINER_LOCK_WAIT_S) for a trainer that holds it, then raises
    TrainerBusyError naming that trainer. The lock is the kernel's: it ends with the process that
    holds it, however that process ends."""
    path = paths.path(paths.TRAINER_LOCK, exp_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + (TRAINER_LOCK_WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TrainerBusyError(
                        f"another trainer of {exp_dir} runs: {_describe(trainer_holder(exp_dir) or {})} holds {path}; "
                        "two trainers must not train one experiment at once (wait for it to end, or stop it)"
                    ) from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**_identity(os.getpid()), "end_step": end_step}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def trainer_holder(exp_dir: str | os.PathLike) -> dict | None:
    """The identity of the trainer that holds the experiment's trainer lock, None if none does."""
    path = paths.path(paths.TRAINER_LOCK, exp_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            try:
                return json.loads(path.read_text())
            except ValueError:
                return {"pid": "?", "host": "?"}  # taken, its holder not written yet
    finally:
        os.close(fd)


def watchdog_env() -> dict:
    """The environment entry that tells a trainer which watchdog it must not outlive (this process)."""
    return {WATCHDOG_ENV: f"{os.getpid()}:{psutil.Process().create_time()}"}


def die_with_parent(parent: int) -> None:
    """In a child between fork and exec: be SIGKILLed when the parent dies (Linux; a no-op elsewhere),
    or exit now if it already has."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def exit_with_watchdog(period_s: float = 1.0) -> None:
    """Poll the watchdog named in the environment from a daemon thread; SIGKILL this process once it
    is gone (torchrun's ranks are its grandchildren: PR_SET_PDEATHSIG does not reach them)."""
    if WATCHDOG_ENV not in os.environ:
        return
    pid, started = os.environ[WATCHDOG_ENV].split(":")
    watchdog = {"pid": int(pid), "started": float(started)}

    def watch():
        while _alive(watchdog):
            time.sleep(period_s)
        log.error("the watchdog (vlgrpo train, process %s) is gone: this trainer stops too", pid)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="watchdog-watch", daemon=True).start()


def start_run(experiment: str | os.PathLike, snakemake_dir: str | os.PathLike = ".snakemake") -> str:
    """The workflow's onstart: give this run an id that every job inherits, and record the lock's owner."""
    run = os.environ.setdefault(RUN_ENV, uuid.uuid4().hex[:12])
    record_owner(snakemake_dir, run=run, experiment=str(Path(experiment).resolve()))
    return run


def _jobs_alive(owner: dict) -> list[str]:
    """The live processes of the owner's run (its id in their environment) and the trainer that
    holds its experiment's lock, each described."""
    found = []
    if owner.get("run"):
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.pid != os.getpid() and proc.environ().get(RUN_ENV) == owner["run"]:
                    found.append(f"process {proc.pid} ({' '.join(proc.info['cmdline'] or [])[:120]})")
            except psutil.Error:
                continue
    if owner.get("experiment") and (holder := trainer_holder(owner["experiment"])):
        found.append(f"the trainer {_describe(holder)} holding {paths.path(paths.TRAINER_LOCK, owner['experiment'])}")
    return found


def _identity(pid: int) -> dict:
    return {
        "host": socket.gethostname(),
        "boot_id": BOOT_ID.read_text().strip() if BOOT_ID.is_file() else "",
        "pid": pid,
        "started": psutil.Process(pid).create_time(),
    }


def record_owner(snakemake_dir: str | os.PathLike = ".snakemake", pid: int | None = None, **run) -> None:
    """Note the Snakemake process holding the lock (this one unless `pid`), with `run` (its id and
    experiment folder: start_run)."""
    path = Path(snakemake_dir) / OWNER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**_identity(os.getpid() if pid is None else pid), **run}))


def _alive(owner: dict) -> bool:
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 0.01
    except psutil.Error:
        return False


def release_stale(snakemake_dir: str | os.PathLike = ".snakemake") -> str:
    """Remove the lock in `snakemake_dir` if its owner ran on this host and is gone, and so are its
    run's jobs; say what was done.

    Raises StaleLockError when the owner is unknown, on another host, or still running, or while a
    job of its run still runs (a process with the run's id, or a trainer holding the experiment's
    trainer lock), naming them.
    """
    root = Path(snakemake_dir)
    locks = root / "locks"
    if not (locks.is_dir() and any(locks.iterdir())):
        return f"no lock in {root}"
    unlock = f"if no Snakemake runs in {root.resolve().parent}, `snakemake --unlock` releases the lock"
    try:
        owner = json.loads((root / OWNER).read_text())
        host, boot_id, pid = owner["host"], owner["boot_id"], owner["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        raise StaleLockError(f"{locks} holds a lock whose owner was not recorded; {unlock}") from None
    here = _identity(os.getpid())
    if host != here["host"]:
        raise StaleLockError(
            f"the lock in {locks} was taken by Snakemake process {pid} on host {host}, and this is "
            f"{here['host']}: whether it still runs cannot be seen from here; {unlock}"
        )
    if boot_id == here["boot_id"] and _alive(owner):
        raise StaleLockError(f"Snakemake process {pid} that holds the lock in {locks} is still running on this host")
    if alive := _jobs_alive(owner):
        raise StaleLockError(
            f"Snakemake process {pid} that took the lock in {locks} is gone, but jobs of its run still run: "
            f"{'; '.join(alive)}. Rerunning now would start them a second time: wait for them to end or stop "
            "them (kill PID), then run `vlgrpo unlock-stale` again"
        )
    shutil.rmtree(locks)
    (root / OWNER).unlink()
    why = "has exited" if boot_id == here["boot_id"] else "ran before this host restarted"
    return f"released the lock left by Snakemake process {pid} on {host}, which {why}"

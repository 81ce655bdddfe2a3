"""Release of the lock a hard-killed Snakemake leaves behind, only when that is safe.

Snakemake locks its working directory (.snakemake/locks) for the run's files and removes the lock
when it exits; SIGKILL or a lost node leaves the lock, and the next run refuses to start.
`snakemake --unlock` removes it whoever holds it, which on a shared file system can break a run
that is still going on another node. So the workflow's onstart records the owner beside the lock
(host, boot id, PID and the PID's start time), and `vlgrpo unlock-stale` removes the lock only when
that owner ran on this host and is gone (a new boot id: the machine restarted; the same boot id: no
process with that PID and start time). Anything else is refused with what to check and the command
that unlocks regardless.

Snakemake checks the lock after parsing the workflow and building the job graph, before any hook
runs, so the workflow itself cannot release it without acting at parse time (which a dry run, a
lint or a report also does); hence a command, run before the same snakemake command:

    vlgrpo unlock-stale [--directory DIR] && snakemake --cores all ...
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import psutil

from vlgrpo.errors import VlgrpoError

OWNER = "vlgrpo_lock_owner.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class StaleLockError(VlgrpoError, RuntimeError):
    """The lock may belong to a live Snakemake: it is kept, and the message says why."""


def _identity(pid: int) -> dict:
    return {
        "host": socket.gethostname(),
        "boot_id": BOOT_ID.read_text().strip() if BOOT_ID.is_file() else "",
        "pid": pid,
        "started": psutil.Process(pid).create_time(),
    }


def record_owner(snakemake_dir: str | os.PathLike = ".snakemake", pid: int | None = None) -> None:
    """Note the Snakemake process holding the lock (this one unless `pid`); the workflow's onstart."""
    path = Path(snakemake_dir) / OWNER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_identity(os.getpid() if pid is None else pid)))


def _alive(owner: dict) -> bool:
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 0.01
    except psutil.Error:
        return False


def release_stale(snakemake_dir: str | os.PathLike = ".snakemake") -> str:
    """Remove the lock in `snakemake_dir` if its owner ran on this host and is gone; say what was done.

    Raises StaleLockError when the owner is unknown, on another host, or still running.
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
    shutil.rmtree(locks)
    (root / OWNER).unlink()
    why = "has exited" if boot_id == here["boot_id"] else "ran before this host restarted"
    return f"released the lock left by Snakemake process {pid} on {host}, which {why}"

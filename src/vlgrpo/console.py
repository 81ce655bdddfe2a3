"""Lines the user must see on the console from a job whose output goes to its log file.

A rule runs its command as `VLGRPO_CONSOLE_FD=3 vlgrpo ... 3>&2 >> {log} 2>&1`: file descriptor 3
is the stderr Snakemake shows, 1 and 2 the job's log. A recovery that changes what the run holds
(a corrupt checkpoint set aside, resuming from an older one, a kept validation result put back) is
said with say(): in the log, and on that console when the job has one (a child process gets the
descriptor with pass_fds()). Run by hand, without the variable, the log is the console.
"""

from __future__ import annotations

import logging
import os

FD_VARIABLE = "VLGRPO_CONSOLE_FD"
log = logging.getLogger("vlgrpo.console")


def _fd() -> int | None:
    if "LOCAL_RANK" in os.environ:  # a torchrun rank: torchrun does not pass the descriptor on (another file may have its number)
        return None
    try:
        fd = int(os.environ[FD_VARIABLE])
        os.fstat(fd)
    except (KeyError, ValueError, OSError):  # unset, or not open in this process
        return None
    return fd


def pass_fds() -> tuple[int, ...]:
    """The console's descriptor, for subprocess.Popen(pass_fds=...) of a job's child process."""
    fd = _fd()
    return () if fd is None else (fd,)


def say(message: str) -> None:
    """Log `message` as a warning, and write it on the job's console when it has one."""
    log.warning(message)
    fd = _fd()
    if fd is not None:
        os.write(fd, f"vlgrpo: {message}\n".encode())

"""A job that fails on a user error fails once, with one line; faults are retried.

A user error is a VlgrpoError (a bad config, data, model folder or reward function) or a missing
file: the same input fails the same way, so a retry cannot help. The job that hits one writes the
message to results/<exp>/logs/<job>.user_error.json with the workflow run's id (locks.RUN_ENV),
prints one line and exits; its traceback goes to the job log before that line. Then, in the same
workflow run:
- the rule's `retries` (RetriesUnlessUserError) leaves no retry to Snakemake's scheduler, which asks
  it after each failure;
- a retry that starts anyway (another Snakemake, another executor) stops at once with the line;
- the workflow's onerror prints the line of each such job (`summary`), so it is the last thing said.
A new workflow run (the user fixed the mistake) has another id and runs the job again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

from vlgrpo import atomic
from vlgrpo.errors import VlgrpoError
from vlgrpo.locks import RUN_ENV

USER_ERRORS = (VlgrpoError, FileNotFoundError)
SUFFIX = ".user_error.json"

log = logging.getLogger(__name__)


def marker(exp_dir: str | os.PathLike, job: str) -> Path:
    return Path(exp_dir) / "logs" / f"{job}{SUFFIX}"


def one_line(error: BaseException) -> str:
    """The first line of the error's message (several lines go to the log)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def record(exp_dir: str | os.PathLike, job: str, command: str, error: BaseException) -> str:
    """Log the traceback, note the user error for this workflow run, and return the line to exit with."""
    log.error("%s failed on a user error; the traceback:\n%s", command, "".join(traceback.format_exception(error)).rstrip())
    line = f"{command}: {one_line(error)}"
    atomic.write_json(marker(exp_dir, job), {"run": os.environ.get(RUN_ENV), "message": line, "full": str(error)})
    return line


def exit_on_user_error(exp_dir: str | os.PathLike, job: str, command: str, error: BaseException) -> None:
    """record(), then exit with the line (stderr goes to the job log; its last line is this one)."""
    sys.exit(record(exp_dir, job, command, error))


def earlier(exp_dir: str | os.PathLike, job: str, any_run: bool = False) -> str | None:
    """The line of a user error this job hit earlier in this workflow run (any run: whatever is
    noted, e.g. by the trainer a watchdog ran), None if none. A note from another run (or from a run
    by hand) is stale: it is removed."""
    path = marker(exp_dir, job)
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    run = os.environ.get(RUN_ENV)
    if any_run or (run and note.get("run") == run):
        return note["message"]
    path.unlink(missing_ok=True)
    return None


def stop_if_failed_before(exp_dir: str | os.PathLike, job: str) -> None:
    """At a job's start: exit at once, without retrying, if this job failed on a user error earlier in this run."""
    if (line := earlier(exp_dir, job)) is not None:
        sys.exit(f"{line} (not retried: a user error fails the same way again)")


def summary(exp_dir: str | os.PathLike) -> list[str]:
    """The lines of the jobs that failed on a user error in this workflow run (the workflow's onerror)."""
    run = os.environ.get(RUN_ENV)
    out = []
    for path in sorted((Path(exp_dir) / "logs").glob(f"*{SUFFIX}")):
        try:
            note = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if run and note.get("run") == run:
            out.append(f"{path.name[:-len(SUFFIX)]} failed on a user error (not retried): {note['message']}")
    return out


class RetriesUnlessUserError(int):
    """A rule's `retries` (an int, as Snakemake requires) that runs out once a job of `prefix` failed
    on a user error in this workflow run: Snakemake retries while `retries > attempt - 1`."""

    def __new__(cls, retries: int, exp_dir: str | os.PathLike, prefix: str):
        self = super().__new__(cls, retries)
        self.exp_dir, self.prefix = Path(exp_dir), prefix
        return self

    def _left(self) -> int:
        run = os.environ.get(RUN_ENV)
        for path in (self.exp_dir / "logs").glob(f"{self.prefix}*{SUFFIX}"):
            try:
                if run and json.loads(path.read_text()).get("run") == run:
                    return 0
            except (OSError, ValueError):
                continue
        return int(self)

    def __gt__(self, other):
        return self._left() > other

    def __lt__(self, other):  # `attempt - 1 < retries`, the same question
        return self._left() < other

"""Atomic file and folder writes: the one way vlgrpo replaces a file that others may read.

A file is written under a temporary name beside its target, flushed and fsynced, then renamed over
the target, and the folder is fsynced so the rename survives a power loss. A reader (or a process
killed at any moment) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, deepest first, then `root`."""
    for path in sorted(root.rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(root)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def replacing(path: str | os.PathLike):
    """Yield a temporary path to write `path`'s new content to; on success it is fsynced and renamed
    over `path`; on an exception it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as tmp:
        Path(tmp).write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    with replacing(path) as tmp:
        Path(tmp).write_text(text)


def write_json(path: str | os.PathLike, data, indent: int | None = 1) -> None:
    write_text(path, json.dumps(data, indent=indent))


def write_lines(path: str | os.PathLike, lines) -> None:
    """Write an iterable of text lines (each ending in a newline) atomically."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.writelines(lines)


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished folder `src` over `dst` (an old `dst` goes aside first, then away): a reader
    sees the old folder or the new one. `src` is fsynced first."""
    fsync_tree(src)
    old = dst.with_name(f".{dst.name}.old{os.getpid()}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_path(dst.parent)
    shutil.rmtree(old, ignore_errors=True)

"""Content hashes of a run's inputs (data files, model folder), so that content, not a timestamp,
decides what the workflow reruns: a file touched or copied again unchanged hashes the same."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


@functools.lru_cache(maxsize=None)
def _file(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """sha256 of a file's bytes (cached per size, mtime and inode: each is read once per process)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a folder's files (their relative names and bytes; names that start
    with a dot, such as a hub cache's bookkeeping, left out)."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return _file(str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    total = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path)
        if any(part.startswith(".") for part in name.parts):
            continue
        total.update(f"{name}\0{digest(file)}\n".encode())
    return total.hexdigest()

"""A checkpoint folder appears only when complete: written aside, then renamed into place."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def atomic_directory(final: str | os.PathLike):
    """Yield a temporary sibling folder; on success it replaces ``final`` in one rename.

    A crash inside the block leaves ``final`` as it was (absent or the previous version) and
    only a hidden ``.tmp-*`` folder behind, which nothing treats as a checkpoint.
    """
    final = Path(final)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an earlier crash
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = final.with_name(f".old-{final.name}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

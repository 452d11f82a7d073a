"""Writes that appear only when complete: a checkpoint folder, or a set of files, written aside and
renamed into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def staging_directory(final: str | os.PathLike) -> Path:
    """Where ``atomic_directory(final)`` stages its contents (for other processes writing into it)."""
    final = Path(final)
    return final.with_name(f".tmp-{final.name}")


@contextmanager
def atomic_directory(final: str | os.PathLike):
    """Yield a temporary sibling folder; on success it replaces ``final`` in one rename.

    A crash inside the block leaves ``final`` as it was (absent or the previous version) and
    only a hidden ``.tmp-*`` folder behind, which nothing treats as a checkpoint.
    """
    final = Path(final)
    tmp = staging_directory(final)
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


@contextmanager
def atomic_files(final_dir: str | os.PathLike, last: Sequence[str] = (), replaces: Sequence[str] = ()):
    """Yield a hidden staging folder inside ``final_dir``; on success each file written there is renamed
    into ``final_dir`` whole, those named in ``last`` at the end and in that order.

    For a folder that also holds other things (``checkpoint-*/``), so it cannot be swapped as a whole:
    every file appears complete or not at all, and files a reader starts from (``last``) never refer to
    files that are not there yet. Files matching a ``replaces`` glob that the new set does not include
    (an earlier save's shards) are deleted afterwards. A crash leaves complete files and the staging
    folder, which the next call removes.
    """
    final_dir = Path(final_dir)
    final_dir.mkdir(parents=True, exist_ok=True)
    stage = final_dir / ".tmp-files"
    if stage.exists():
        shutil.rmtree(stage)  # left by an earlier crash
    stage.mkdir()
    try:
        yield stage
        _fsync_tree(stage)
        names = sorted(p.name for p in stage.iterdir())
        assert all((stage / name).is_file() for name in names), "atomic_files publishes files, not folders"
        ordered = [n for n in names if n not in last] + [n for n in last if n in names]
        for name in ordered:
            os.replace(stage / name, final_dir / name)
        stale = {p for pattern in replaces for p in final_dir.glob(pattern) if p.name not in names}
        for path in sorted(stale):
            path.unlink()
        _fsync_dir(final_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)

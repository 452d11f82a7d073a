"""What a run checks before its first step: output_dir can be written and no other run is using it,
and there is something to train on.

output_dir is claimed with an ``fcntl.flock`` on ``output_dir/.hfnative-run.lock`` (the file records
the holder's pid, for the error a second run gets). The lock lives as long as the trainer that took
it (the CLI: the whole command), and the kernel drops it when the process dies, so a crashed run
never leaves a stale lock behind. In a distributed run only rank 0 takes it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path

from .data_loading import has_length

logger = logging.getLogger(__name__)

LOCK_NAME = ".hfnative-run.lock"


class RunError(ValueError):
    """A run that cannot start: output_dir unwritable or in use, or nothing to train on."""


class OutputDirLock:
    """This process's claim on one output_dir; shared by every holder in the process, released by the last.
    Folders the claim created are removed on release if the run left them empty (a failed start)."""

    def __init__(self, path: Path, fd: int | None, created: list[Path]):
        self.path, self.fd, self.created = path, fd, created
        self.pid, self.holders = os.getpid(), 0


_held: dict[str, OutputDirLock] = {}  # output_dir's real path -> its lock, while this process holds it


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing, path = [], path.absolute()
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _open_writable(output_dir: Path) -> int:
    """Create output_dir, check a file can be created in it, and open its lock file for writing."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):  # the lock file may be an earlier run's, left by a crash
            pass
        return os.open(output_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise RunError(
            f"output_dir {str(output_dir)!r} cannot be written ({err.strerror}): the run would fail at its first "
            "save; choose a folder you can write to, or fix its permissions"
        ) from err


def _claim(output_dir: Path) -> int | None:
    """The locked lock file's descriptor (None where the filesystem cannot lock)."""
    path = output_dir / LOCK_NAME
    while True:
        fd = _open_writable(output_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"output_dir {str(output_dir)!r} is in use by another run (process {holder} holds {LOCK_NAME}); "
                "wait for it to finish, or choose another output_dir"
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.warning("output_dir %s cannot be locked on this filesystem (%s): a second run on it would "
                           "not be refused", output_dir, err.strerror)
            os.close(fd)
            return None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:  # not the file of a run that released it (and removed it) while we were locking
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def hold_output_dir(output_dir: str | os.PathLike) -> OutputDirLock:
    """Create output_dir, check it can be written and claim it for this process (again: the same claim).

    Raises RunError naming the folder when it cannot be written or another process holds it.
    Each call is one holder; ``release_output_dir`` ends it.
    """
    output_dir = Path(output_dir)
    key = os.path.realpath(output_dir)
    lock = _held.get(key)
    if lock is None:
        created = _missing_folders(output_dir)
        lock = _held[key] = OutputDirLock(output_dir, _claim(output_dir), created)
    lock.holders += 1
    return lock


def release_output_dir(lock: OutputDirLock) -> None:
    lock.holders -= 1
    if lock.holders > 0 or lock.pid != os.getpid():  # a forked child never releases its parent's claim
        return
    _held.pop(os.path.realpath(lock.path), None)
    if lock.fd is not None:
        path = lock.path / LOCK_NAME
        try:
            if os.stat(path).st_ino == os.fstat(lock.fd).st_ino:
                path.unlink()
        except FileNotFoundError:
            pass
        os.close(lock.fd)
        lock.fd = None
    for folder in lock.created:
        try:
            folder.rmdir()
        except OSError:  # not empty: the run wrote there
            break


@contextmanager
def output_dir_claimed(output_dir: str | os.PathLike):
    """Hold output_dir for the block on rank 0 (the CLI: from before loading anything until the model is saved)."""
    if not _is_main_process():
        yield None
        return
    lock = hold_output_dir(output_dir)
    try:
        yield lock
    finally:
        release_output_dir(lock)


def check_run_can_start(trainer, dataloader) -> None:
    """Before the first step: the train dataloader has a batch to give, and output_dir is writable and
    claimed for as long as ``trainer`` lives. Raises RunError saying what to do."""
    dataset = dataloader.dataset
    if has_length(dataset) and len(dataloader) == 0:
        why = "it has no rows" if len(dataset) == 0 else (
            f"its {len(dataset)} rows do not fill one batch of {trainer.args.per_device_train_batch_size} and "
            "dataloader_drop_last=True drops the partial one")
        raise RunError(f"train_dataset gives no batch to train on: {why}")
    # a stream is read up to its first row (the dataset itself, not the DataLoader, whose seed draw would
    # shift the run's random numbers): one whose rows were all dropped would otherwise loop over nothing
    if not has_length(dataset) and next(iter(dataset), None) is None:
        raise RunError(
            "train_dataset (a stream) gives no row to train on: it is empty, or every row was dropped (see the "
            "warning above: e.g. each prompt fills max_length)"
        )
    if _is_main_process():
        claims = trainer.__dict__.setdefault("_output_dir_claims", set())
        key = os.path.realpath(trainer.args.output_dir)
        if key not in claims:
            weakref.finalize(trainer, release_output_dir, hold_output_dir(trainer.args.output_dir))
            claims.add(key)

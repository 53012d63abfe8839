"""Exclusive locks that say who holds them: one job at a time in a run dir or on a dataset prefix.

`fcntl.flock`, not a lock file's existence: the kernel drops the lock when its holder dies (kill -9,
OOM, a node lost to Slurm), so a requeued or resumed job takes it again; slurm/launch.sh's `flock`
takes the same kind of lock. The holder writes its host, pid and Slurm job into the file and removes
the file on release (under the lock; a taker checks that the file it locked is still the one named).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # e.g. Lustre mounted without -o flock


class LockHeld(Exception):
    """Another process holds the lock; `holder` says who, as it recorded itself."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


def holder_line() -> str:
    """This process as a holder: host, pid, Slurm job (if any), since when."""
    job = os.environ.get("SLURM_JOB_ID")
    return (f"host {socket.gethostname()}, pid {os.getpid()}" + (f", Slurm job {job}" if job else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}")


def holder(path: Path) -> str:
    """Who holds `path`'s lock, as the holder wrote it."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        text = ""
    return text or "another process (it has not recorded itself yet)"


def acquire(path: Path, wait_s: float = 0.0) -> tuple[Path, int] | None:
    """Lock `path` (created if need be) exclusively, waiting up to `wait_s` seconds for another
    holder, and record this process in it. Returns what `release` takes; None where the filesystem
    has no flock (a warning says so); LockHeld when another process still holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise LockHeld(Path(path), holder(path)) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_FLOCK:
                raise
            warnings.warn(f"{path}: this filesystem has no flock ({err.strerror}): nothing stops a second job "
                          "from writing to the same place at the same time", stacklevel=2)
            return None
        if _names(path, fd):
            break
        os.close(fd)  # its holder removed it while releasing: lock the next one
    os.ftruncate(fd, 0)
    os.pwrite(fd, (holder_line() + "\n").encode(), 0)
    return Path(path), fd


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        named, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def release(held: tuple[Path, int] | None) -> None:
    """Remove the lock file and drop the lock (also for any child forked while it was held)."""
    if held is None:
        return
    path, fd = held
    try:
        Path(path).unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def held(path: Path, wait_s: float = 0.0,
         refusal: Callable[[str], Exception] | None = None) -> Iterator[tuple[Path, int] | None]:
    """Hold `path` while inside (`acquire`, then `release`). When another process still holds it after
    `wait_s` seconds: `refusal(holder)` raised in LockHeld's place, if given."""
    try:
        lock = acquire(path, wait_s)
    except LockHeld as other:
        if refusal is None:
            raise
        raise refusal(other.holder) from None
    try:
        yield lock
    finally:
        release(lock)

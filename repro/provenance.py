"""Where results come from: the commit that produced them, and files that are never half-written."""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from repro.tracking.store import project_root


def file_in_the_way(directory: Path) -> Path | None:
    """The first thing on `directory`'s path that exists and is not a directory (it, or a file above
    it): where writing into `directory` would fail with NotADirectoryError. None when it can be made."""
    existing = next((p for p in (directory, *directory.parents) if p.exists() or p.is_symlink()), None)
    return existing if existing is not None and not existing.is_dir() else None


def unwritable_ancestor(path: Path) -> Path | None:
    """The existing directory in which creating `path` (and its missing parents) starts, when this
    process cannot create a file there (permissions, a read-only or virtual file system such as /proc:
    tried with a nameless temporary file, as root too); None when it can."""
    base = next(p for p in Path(path).absolute().parents if p.exists())
    try:
        with tempfile.TemporaryFile(dir=base):
            return None
    except OSError:
        return base


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True, timeout=30,
                         check=True)
    return out.stdout.strip()


def git_sha(dirty_paths: tuple[str, ...] = ()) -> str:
    """HEAD of the checkout, with "-dirty" when any of `dirty_paths` differs from it; $REPRO_GIT_SHA
    where the tree was copied without .git (a lent GPU machine); "unknown" without git or a repository
    (never an error: a missing git must not stop a run on one rank while the others wait)."""
    if os.environ.get("REPRO_GIT_SHA"):
        return os.environ["REPRO_GIT_SHA"]
    try:
        sha = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--", *dirty_paths) if dirty_paths else ""
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


class OutDirError(ValueError):
    """An --out that cannot be a folder of results; the message names what is in the way and the fix."""


def make_out_dir(out: Path, example: str) -> Path:
    """Create the results folder `out` before any work is done: a file at `out` or above it is an
    OutDirError at once, not a traceback after minutes of measuring."""
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise OutDirError(f"--out {out}: {blocking} is a file, not a directory (the results are written "
                          f"into a directory). Fix: give a directory path, e.g. --out {example}")
    out.mkdir(parents=True, exist_ok=True)
    return out


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the quota used up


def error_chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err`, then what it was raised over (its __cause__/__context__ chain), up to an error raised
    `from None`: one that already says what went wrong."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def full_disk_behind(err: BaseException | None) -> OSError | None:
    """The full-disk OSError that `err` is, or was raised over: torch's zip writer reports a failed write
    as RuntimeError ("unexpected pos ...") over the OSError."""
    return next((e for e in error_chain(err) if isinstance(e, OSError) and e.errno in FULL_DISK), None)


def save_torch(obj, path: Path) -> None:
    """torch.save through a Python file, so that a full disk is OSError(ENOSPC or EDQUOT) naming `path`
    (the callers' clear error), not the RuntimeError torch raises over it."""
    import torch

    try:
        with open(path, "wb") as handle:
            torch.save(obj, handle)
    except (OSError, RuntimeError) as err:
        full = full_disk_behind(err)
        if full is None:
            raise
        raise OSError(full.errno, full.strerror, str(path)) from None


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write through a temporary sibling, fsync, and rename over `path`: a reader (or a crash) never
    sees half a file."""
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # one per writer
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        chmod_as_created(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a failed write names no file: this one
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def chmod_as_created(path: str | Path) -> None:
    """Give a mkstemp file (0600) the mode open() would have created it with, 0666 & ~umask: a
    file in a shared directory stays readable by the group's jobs."""
    os.chmod(path, 0o666 & ~_umask())


def measurement_provenance(device, argv: list[str], prog: str = "python -m repro.perf.gpu_bench") -> dict:
    """Where and how a benchmark's numbers were measured: device, versions, host, date, commit, command."""
    import torch

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(), "host": platform.node(), "threads": torch.get_num_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(), "command": " ".join([prog, *argv]),
    }


def finite_json(obj):
    """NaN -> None recursively, so the JSON is strict."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj


def write_report(out: Path, stem: str, report: dict, markdown: str) -> None:
    """A measurement's `stem`.json (strict JSON, NaN as null) and `stem`.md in `out`, each atomically."""
    write_atomic(out / f"{stem}.json", json.dumps(finite_json(report), indent=2, allow_nan=False))
    write_atomic(out / f"{stem}.md", markdown)

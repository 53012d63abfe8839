"""Where results come from: the commit that produced them, and files that are never half-written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from repro.tracking.store import project_root


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


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write through a temporary sibling, fsync, and rename over `path`: a reader (or a crash) never
    sees half a file."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

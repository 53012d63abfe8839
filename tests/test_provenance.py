"""repro.provenance: the commit behind a result, and atomic writes."""

from __future__ import annotations

import subprocess

from repro.provenance import git_sha, write_atomic
from repro.tracking.store import project_root


def test_git_sha_is_head_or_the_override_or_unknown(monkeypatch, tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_root(), capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.delenv("REPRO_GIT_SHA", raising=False)
    assert git_sha().removesuffix("-dirty") == head
    monkeypatch.setenv("REPRO_GIT_SHA", "abc123")  # a copied tree without .git (scripts/gpu_session.sh)
    assert git_sha() == "abc123"
    monkeypatch.delenv("REPRO_GIT_SHA")
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary: a value, never an exception on one rank
    assert git_sha() == "unknown" and git_sha(("repro",)) == "unknown"


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "table.md"
    write_atomic(path, "first\n")
    write_atomic(path, b"second\n")
    assert path.read_text() == "second\n" and [p.name for p in tmp_path.iterdir()] == ["table.md"]

"""Shared test settings. Multi-process tests spawn gloo ranks through repro.parallel.spawn.run_ranks,
which kills every rank after a timeout, so a hung collective fails the test instead of CI."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip locally when an external component is missing; in CI (CI=true) fail instead."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but missing", pytrace=False)
    pytest.skip(f"{what} is not available on this machine")

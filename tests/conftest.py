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


@pytest.fixture(scope="session")
def cpu_results(tmp_path_factory):
    """`make results` at smoke length, run once per session (tests/results_fixtures.py); tests that
    read it carry a timeout above its run time."""
    from data_fixtures import mirror_path
    from results_fixtures import run_smoke

    mirror = mirror_path()
    require(mirror is not None and mirror.is_dir(), f"the data mirror (REPRO_DATA_MIRROR={mirror})")
    return run_smoke(tmp_path_factory.mktemp("cpu_results"), mirror)


STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # SIGINT is left to the libraries (Jupyter kernels, torch) and pytest


@pytest.fixture(autouse=True)
def _signal_handlers_are_given_back():
    """Code run in the test process leaves its signal handlers as it found them: a stop handler that
    stayed behind (once `repro data prepare`'s) hung a later test's multiprocessing pool."""
    import signal

    before = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    yield
    after = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    changed = {name: (before[name], after[name]) for name in STOP_SIGNALS if after[name] is not before[name]}
    for name in changed:
        signal.signal(getattr(signal, name), before[name])
    assert not changed, f"signal handlers left changed (before, after): {changed}"


# Session fixtures that take minutes or hold a machine-wide resource. `make test` runs pytest-xdist
# with --dist loadscope (one module per worker at a time), which builds a session fixture once in every
# worker whose modules ask for it: each must therefore be read by a single module.
# (--dist loadgroup would allow groups across modules, but pytest-xdist 3.8 marks a group by editing
# Item._nodeid, which pytest 9.2 no longer reads: its groups are silently ignored, seen 2026-12-02.)
ONE_MODULE_FIXTURES = ("cpu_results", "slurm_cluster")


def pytest_collection_modifyitems(items):
    """Fail collection when a fixture of ONE_MODULE_FIXTURES is read from more than one module."""
    readers: dict[str, set[str]] = {name: set() for name in ONE_MODULE_FIXTURES}
    for item in items:
        for name in set(getattr(item, "fixturenames", ())) & set(ONE_MODULE_FIXTURES):
            readers[name].add(item.module.__name__)
    shared = {name: sorted(modules) for name, modules in readers.items() if len(modules) > 1}
    if shared:
        raise pytest.UsageError(f"session fixtures read from several test modules: {shared}; under "
                                "--dist loadscope each worker would build its own copy: move the tests "
                                "that read one of them into a single module")

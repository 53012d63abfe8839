"""Tracking with other processes at the store, against a real sqlite store: one holding its write lock
for a while (a long writer, a slow shared filesystem) costs MLflow no row and no final status; jobs
creating one experiment, or one new store, at once all log; two syncs of one directory make one run.
Each race is forced: a lock-holding process, or a file barrier at MLflow's racy call in the jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_tracking_sync import _log, _offline_logger, _status, _steps, _write

import repro
from repro.tracking.logger import RunLogger
from repro.tracking.run_dir import recorded_run_id
from repro.tracking.sync import sync_run

BUSY_MS = 200  # sqlite busy_timeout in the tests (MLflow sets 20 s)

HOLDER = """
import select, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN EXCLUSIVE"); print("held", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))  # until stdin closes, or for N seconds
c.execute("ROLLBACK")
"""

JOB = """
import json, os, sys, time, warnings
from pathlib import Path
import mlflow, mlflow.store.db.utils
from repro.tracking.logger import RunLogger
from repro.tracking.sync import sync_run

def arrive(name, timeout):
    folder = Path(os.environ["BARRIER_DIR"], name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    end = time.monotonic() + timeout
    while len(os.listdir(folder)) < int(os.environ["PARTIES"]) and time.monotonic() < end:
        time.sleep(0.01)

def hold_at(owner, name):
    real = getattr(owner, name)
    def held(*args, **kwargs):
        arrive(name, float(os.environ["BARRIER_S"]))
        return real(*args, **kwargs)
    setattr(owner, name, held)

action, racy, run_dir, *rest = sys.argv[1:]
owner = mlflow.store.db.utils if racy == "_initialize_tables" else mlflow.MlflowClient
hold_at(owner, racy)
arrive("start", 60)  # imports done: all jobs go on together
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if action == "log":
        logger = RunLogger(run_dir, rest[0], Path(run_dir).name, {}, {})
        for step in (1, 2, 3):
            logger.log_metrics({"loss": 10.0 - step}, step)
        logger.close()
        out = {"run_id": logger.run_id}
    else:
        result = sync_run(run_dir)
        out = {"run_id": result.run_id, "action": result.action}
out["warnings"] = [str(w.message)[:400] for w in caught if "MLflow" in str(w.message)]
print(json.dumps(out))
"""


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def short_busy_timeout():
    """A request to a locked store fails after BUSY_MS, not MLflow's 20 s (its PRAGMA, rewritten)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    seen = []

    def shorten(conn, cursor, statement, parameters, context, executemany):
        seen.append("busy_timeout = 20000" in statement)
        return statement.replace("busy_timeout = 20000", f"busy_timeout = {BUSY_MS}"), parameters

    event.listen(Engine, "before_cursor_execute", shorten, retval=True)
    yield
    event.remove(Engine, "before_cursor_execute", shorten)
    assert any(seen), "MLflow no longer sets `PRAGMA busy_timeout = 20000`: update this fixture"


@contextmanager
def _locked(uri: str, seconds: float = 600.0):
    """Another process holds the sqlite store's write lock: for `seconds`, or until the block ends."""
    db = uri.removeprefix("sqlite:///")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, db, str(seconds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _jobs(tmp_path: Path, argvs: list[list[str]], racy: str, barrier_s: float = 2.0) -> list[dict]:
    """Run one job a argv at once (JOB: `log` a run or `sync` one), each held at `racy` until all
    reach it or `barrier_s` passes; their JSON answers. They import the repro the tests do."""
    script = _write(tmp_path / "job.py", JOB)
    path = os.pathsep.join(filter(None, [str(Path(repro.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "BARRIER_DIR": str(tmp_path / "barrier"),
           "BARRIER_S": str(barrier_s), "PARTIES": str(len(argvs))}
    procs = [subprocess.Popen([sys.executable, str(script), argv[0], racy, *argv[1:]], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    outs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, f"job failed:\n{err[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _existing_store(uri: str, experiment: str | None = None) -> None:
    """Create the store (and `experiment`) before the jobs start: only the race under test is run."""
    from mlflow import MlflowClient

    from repro.tracking.store import experiment_id

    client = MlflowClient(uri)
    if experiment:
        experiment_id(client, experiment)


def test_rows_of_a_pause_reach_mlflow_once_the_store_answers_again(tmp_path, store, short_busy_timeout):
    """A flush into a locked store pauses MLflow; the first flush after the pause sends every row the
    run lacks: the failed batch's and the paused ones, not only the rows logged since (A)."""
    logger = RunLogger(tmp_path / "run", "exp-lock", "r", {}, {})
    _log(logger, (1, 2))
    logger.flush()
    with _locked(store):
        _log(logger, (3, 4))
        with pytest.warns(UserWarning, match=r"(?s)database is locked.*retrying"):
            logger.flush()
        _log(logger, (5,))  # paused: metrics.jsonl only
    logger._paused_until = 0.0  # the retry time has come
    _log(logger, (6,))
    logger.flush()
    assert _steps(store, logger.run_id) == [1, 2, 3, 4, 5, 6]
    logger.close()
    assert _status(store, logger.run_id) == "FINISHED"


def test_a_store_locked_at_close_still_gets_every_row_and_the_final_status(tmp_path, store, short_busy_timeout):
    """close() on a store locked for a second retries: the run gets its queued rows and FINISHED, and
    no warning is given. It used to stay RUNNING without them (A)."""
    logger = RunLogger(tmp_path / "run", "exp-lock", "r", {}, {})
    _log(logger, (1, 2, 3))  # queued
    with _locked(store, seconds=1.0), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.close()
    assert _steps(store, logger.run_id) == [1, 2, 3] and _status(store, logger.run_id) == "FINISHED"
    assert [str(w.message) for w in caught if "MLflow" in str(w.message)] == []


def test_a_store_locked_past_close_gets_one_warning_with_the_sync_that_completes_it(tmp_path, store,
                                                                                  short_busy_timeout):
    """A store still locked when close() stops retrying: one warning naming `repro tracking sync RUN_DIR`,
    which gives the run its rows and FINISHED once the store answers (A)."""
    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, "exp-lock", "r", {}, {})
    logger.CLOSE_RETRY_SECONDS = 0.5
    _log(logger, (1, 2, 3))
    _write(run_dir / "final_metrics.json", '{"iteration": 3}')
    with _locked(store), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.close()
    said = [str(w.message) for w in caught if "MLflow" in str(w.message)]
    assert len(said) == 1 and f"`repro tracking sync {run_dir}`" in said[0], said
    assert _status(store, logger.run_id) == "RUNNING"
    assert sync_run(run_dir).run_id == logger.run_id
    assert _steps(store, logger.run_id) == [1, 2, 3] and _status(store, logger.run_id) == "FINISHED"


def test_jobs_creating_one_experiment_at_once_all_log_into_it(tmp_path, store):
    """Two jobs find the experiment absent and create it together: the one refused takes the other's
    experiment instead of losing MLflow for the whole run (B)."""
    from mlflow import MlflowClient

    _existing_store(store)
    jobs = _jobs(tmp_path, [["log", str(tmp_path / f"run{i}"), "exp-new"] for i in (1, 2)], "create_experiment")
    assert [job["warnings"] for job in jobs] == [[], []]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("exp-new").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(job["run_id"] for job in jobs)
    assert all(_steps(store, job["run_id"]) == [1, 2, 3] for job in jobs)


def test_jobs_starting_together_on_a_new_store_all_log(tmp_path, store):
    """Two jobs open a sqlite store that does not exist yet, both about to create its tables: one
    creates them under `<db>.lock`, the other waits and opens them. Both used to create them, and one
    lost MLflow ("duplicate column name: step") (C)."""
    jobs = _jobs(tmp_path, [["log", str(tmp_path / f"run{i}"), "exp-store"] for i in (1, 2)], "_initialize_tables")
    assert [job["warnings"] for job in jobs] == [[], []]
    assert all(_steps(store, job["run_id"]) == [1, 2, 3] and _status(store, job["run_id"]) == "FINISHED"
               for job in jobs)


def test_two_syncs_of_one_directory_at_once_make_one_run(tmp_path, store, monkeypatch):
    """Two `repro tracking sync RUN_DIR` of a run trained offline, both about to create its run: the one
    holding RUN_DIR/.sync.lock creates it, the other then finds it up to date. Each used to create one (D)."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    _log(_offline_logger(monkeypatch, run_dir, "exp-sync"), (1, 2, 3))
    _existing_store(store, "exp-sync")
    jobs = _jobs(tmp_path, [["sync", str(run_dir)]] * 2, "create_run")
    assert sorted(job["action"] for job in jobs) == ["created", "up to date"]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("exp-sync").experiment_id])
    assert [r.info.run_id for r in runs] == [recorded_run_id(run_dir)]
    assert {job["run_id"] for job in jobs} == {recorded_run_id(run_dir)}
    assert _steps(store, recorded_run_id(run_dir)) == [1, 2, 3]


def test_a_locked_store_prints_no_mlflow_tracebacks(tmp_path, store, short_busy_timeout, capfd):
    """MLflow logs every failed sqlite request as an ERROR with its SQLAlchemy traceback (~60 lines,
    more with close()'s retries) before raising it: the logger's one warning says it all, so inside
    its requests those logs are dropped."""
    logger = RunLogger(tmp_path / "run", "exp-quiet", "r", {}, {})
    _log(logger, (1,))
    capfd.readouterr()
    with _locked(store), pytest.warns(UserWarning, match="database is locked"):
        logger.flush()
    err = capfd.readouterr().err
    assert "SQLAlchemy database error" not in err and "Traceback" not in err, err[-2000:]
    import logging

    assert logging.getLogger("mlflow.store").level == logging.NOTSET  # (restored after the request)
    logger._paused_until = 0.0
    logger.close()
    assert _steps(store, logger.run_id) == [1] and _status(store, logger.run_id) == "FINISHED"


def test_a_run_stopped_by_a_signal_tries_its_final_status_once(tmp_path, store, short_busy_timeout, monkeypatch):
    """close('KILLED') (a stop signal: Slurm's grace time is the checkpoint's) does not wait out
    CLOSE_RETRY_SECONDS for a store that does not answer; the requeued launch catches up."""
    import repro.tracking.logger as tracking_logger

    logger = RunLogger(tmp_path / "run", "exp-killed", "r", {}, {})
    _log(logger, (1, 2))
    slept = []
    monkeypatch.setattr(tracking_logger.time, "sleep", slept.append)
    with _locked(store), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.close("KILLED")
    said = [str(w.message) for w in caught if "MLflow" in str(w.message)]
    retries = [s for s in slept if s >= 1.0]  # close()'s waits (1, 2, 4 .. s; MLflow's own are ms)
    assert retries == [] and len(said) == 1 and "repro tracking sync" in said[0], (retries, said)


LOCK_HOLDER = """
import select, sys
from repro import run_lock
held = run_lock.acquire(sys.argv[1]); print("held", flush=True)
select.select([sys.stdin], [], [], 60)  # until stdin closes
run_lock.release(held)
"""


def test_the_store_lock_names_its_holder_and_leaves_no_file(tmp_path, monkeypatch):
    """`<db>.lock` is repro.run_lock's, like a run dir's: a new store's folder is made, the lock file is
    gone once the store is open, and a job that waits out STORE_LOCK_SECONDS is told who holds it."""
    import repro.tracking.store as store_module
    from repro.tracking.store import tracking_client

    db = tmp_path / "new" / "mlflow.db"
    assert len(tracking_client(f"sqlite:///{db}").search_experiments()) == 1
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db"]

    other = tmp_path / "other.db"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, f"{other}.lock"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(repro.__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(store_module, "STORE_LOCK_SECONDS", 0.5)
        with pytest.raises(TimeoutError, match=rf"pid {holder.pid}.*MLflow store sqlite:///{other}"):
            tracking_client(f"sqlite:///{other}")
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert not Path(f"{other}.lock").exists()

"""`repro tracking sync` sets the status a run's last launch ended with, MLflow up or not: a crash
logged offline (run_status), a finished run extended since and killed without a word, and the MLflow
run of a launch set aside whose restart ran without MLflow."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from repro.tracking.logger import RunLogger
from repro.tracking.sync import sync_run


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _status(uri: str, run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(uri).get_run(run_id).info.status


def _log(logger: RunLogger, steps) -> None:
    for step in steps:
        logger.log_metrics({"loss": 10.0 - step}, step)


def _crash(run_dir: Path, steps, **kwargs) -> None:
    """A launch with MLflow off that raises after logging `steps` (RunLogger's __exit__ closes FAILED)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError), RunLogger(run_dir, "exp-status", "r", {}, {}, use_mlflow=False,
                                                    **kwargs) as logger:
            _log(logger, steps)
            raise RuntimeError("CUDA out of memory")


def _finished_live(run_dir: Path, steps) -> RunLogger:
    """A run logged with MLflow up that finished at its last step (final_metrics.json written)."""
    with RunLogger(run_dir, "exp-status", "r", {"train.train_iters": str(steps[-1])}, {}) as logger:
        _log(logger, steps)
    (run_dir / "final_metrics.json").write_text(f'{{"iteration": {steps[-1]}}}')
    return logger


def test_an_offline_run_that_crashed_is_synced_failed_and_a_later_launch_clears_it(tmp_path, store):
    """close("FAILED") reached only MLflow: with MLflow off the synced run stayed RUNNING, ranked above
    FAILED. A later launch that finishes removes the stale run_status, so sync finishes the run."""
    run_dir = tmp_path / "run"
    _crash(run_dir, (1, 2, 3))
    run_id = sync_run(run_dir).run_id
    assert _status(store, run_id) == "FAILED"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with RunLogger(run_dir, "exp-status", "r", {}, {}, use_mlflow=False) as again:
            assert not (run_dir / "run_status").exists()
            _log(again, (4, 5))
    (run_dir / "final_metrics.json").write_text('{"iteration": 5}')
    sync_run(run_dir)
    assert _status(store, run_id) == "FINISHED"


def test_a_finished_run_resumed_offline_that_crashed_is_synced_failed(tmp_path, store):
    """Finished at iteration 5 (FINISHED in MLflow), resumed with MLflow off and train_iters raised,
    crashed at step 8: sync left it FINISHED."""
    run_dir = tmp_path / "run"
    first = _finished_live(run_dir, (1, 2, 3, 4, 5))
    _crash(run_dir, (6, 7, 8))
    result = sync_run(run_dir)
    assert (result.run_id, result.metrics_sent) == (first.run_id, 3)
    assert _status(store, first.run_id) == "FAILED"


def test_a_finished_run_extended_and_killed_without_a_word_is_not_left_finished(tmp_path, store):
    """The same, but the offline launch is SIGKILLed (no close, no run_status): rows past
    final_metrics.json's iteration under a FINISHED run end it KILLED. A live resumed launch has
    reopened its run (RUNNING), which sync leaves as it is."""
    run_dir = tmp_path / "run"
    first = _finished_live(run_dir, (1, 2, 3, 4, 5))
    killed = RunLogger(run_dir, "exp-status", "r", {}, {}, use_mlflow=False)
    _log(killed, (6, 7, 8))  # then SIGKILL: no close
    sync_run(run_dir)
    assert _status(store, first.run_id) == "KILLED"

    live_dir = tmp_path / "live"
    done = _finished_live(live_dir, (1, 2))
    live = RunLogger(live_dir, "exp-status", "r", {}, {}, resume_run_id=done.run_id)
    _log(live, (3, 4))
    live.flush()
    sync_run(live_dir)  # while it trains
    assert _status(store, done.run_id) == "RUNNING"


def test_a_dead_launchs_run_is_ended_by_sync_when_the_restart_ran_without_mlflow(tmp_path, store):
    """Killed before its first checkpoint with MLflow up, then begun again with MLflow down: only a
    launch that reached MLflow ended the dead launch's run, which stayed RUNNING forever."""
    run_dir = tmp_path / "run"
    dead = RunLogger(run_dir, "exp-status", "r", {}, {})
    _log(dead, (1,))
    dead.flush()  # then killed: no close
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with RunLogger(run_dir, "exp-status", "r", {}, {}, use_mlflow=False, starts_over=True) as again:
            _log(again, (1, 2, 3))
    (run_dir / "final_metrics.json").write_text('{"iteration": 3}')
    result = sync_run(run_dir)
    assert result.run_id != dead.run_id and _status(store, result.run_id) == "FINISHED"
    assert _status(store, dead.run_id) == "KILLED" and dead.run_id in result.note
    assert sync_run(run_dir).action == "up to date"


def test_a_rescheduled_resume_after_a_kill_gives_the_analysis_one_value_a_step(tmp_path, store):
    """Launch 1 logs steps 1-4 live and is SIGKILLed (no close); launch 2 resumes from step 2 with a new
    schedule (the trainer sets the rows after 2 aside in metrics.jsonl) and logs 3-4 again. MLflow keeps
    both values of steps 3-4 (it deletes no metric value); the analysis took both into its curves and
    medians. It now reads the last logged value of each step, metrics.jsonl's."""
    import time

    from repro.analysis.runs import metric_history
    from repro.tracking.run_dir import set_aside_rows_after

    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, "exp-status", "r", {}, {})
    for step in (1, 2, 3, 4):
        first.log_metrics({"loss": 10.0 - step}, step)
    first.flush()  # then killed: no close
    time.sleep(0.01)  # a later launch logs later (MLflow timestamps are milliseconds)
    assert set_aside_rows_after(run_dir, 2) is not None
    with RunLogger(run_dir, "exp-status", "r", {}, {}, resume_run_id=first.run_id) as second:
        for step in (3, 4):
            second.log_metrics({"loss": 100.0 + step}, step)
    history = metric_history(store, first.run_id, "loss")
    assert history.to_dict("list") == {"step": [1, 2, 3, 4], "value": [9.0, 8.0, 103.0, 104.0]}

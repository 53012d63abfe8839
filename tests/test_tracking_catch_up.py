"""The rows an MLflow run lacks are found with one request, whatever the run's length: a resume after a
hard kill, an offline launch or a pause sends them without downloading each metric's whole history
(at the paper's 1.5M BERT iterations, 12M values: minutes on rank 0 while every other rank waits in a
collective). A backlog too large to send while training waits is left to `repro tracking sync`, with
a warning that names it."""

from __future__ import annotations

import warnings

import pytest
from mlflow import MlflowClient

from repro.tracking import logger as L
from repro.tracking.logger import RunLogger
from repro.tracking.sync import sync_run
from test_tracking_sync import UNREACHABLE, _log, _offline_logger, _status, _steps, store  # noqa: F401

EXPERIMENT = "exp-catch-up"


@pytest.fixture
def history_downloads(monkeypatch) -> list[str]:
    """The metric keys whose whole history any MLflow client downloads (the real client, counted)."""
    keys: list[str] = []
    real = MlflowClient.get_metric_history

    def counted(self, run_id, key):
        keys.append(key)
        return real(self, run_id, key)

    monkeypatch.setattr(MlflowClient, "get_metric_history", counted)
    return keys


def _values(uri: str, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_a_resume_after_a_hard_kill_sends_the_queued_rows_without_reading_histories(
        tmp_path, store, history_downloads, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    _log(first, range(1, 51))
    first.flush()
    _log(first, range(51, 56))  # queued for the next flush when the process is killed: RUNNING, rows missing
    resumed = RunLogger(run_dir, EXPERIMENT, "r", {}, {}, resume_run_id=first.run_id)
    resumed.resume_at(55)
    assert history_downloads == []
    assert _steps(store, first.run_id) == list(range(1, 56))
    history_downloads.clear()  # (the line above read one)
    # a failed request, then the catch-up after the pause: again only the run's latest values are read
    real = L.send_metrics
    monkeypatch.setattr(L, "send_metrics", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("database is locked")))
    _log(resumed, (56, 57))
    with pytest.warns(UserWarning, match="database is locked.*retrying"):
        resumed.flush()
    monkeypatch.setattr(L, "send_metrics", real)
    _log(resumed, (58,))  # paused: queued, not sent
    resumed._paused_until = 0.0  # the retry time has come
    resumed.close()
    assert history_downloads == []
    assert _values(store, first.run_id) == [(s, 10.0 - s) for s in range(1, 59)]  # each once
    assert _status(store, first.run_id) == "FINISHED"


def test_a_batch_the_store_took_before_its_reply_failed_is_not_sent_twice(tmp_path, store, monkeypatch):  # noqa: F811
    """A request that reached the store but failed on the way back (a timeout): the catch-up sends
    only the rows after it."""
    logger = RunLogger(tmp_path / "run", EXPERIMENT, "r", {}, {})
    real = L.send_metrics

    def lost_reply(*args, **kwargs):
        real(*args, **kwargs)
        raise TimeoutError("read timed out")

    monkeypatch.setattr(L, "send_metrics", lost_reply)
    _log(logger, (1, 2, 3))
    with pytest.warns(UserWarning, match="read timed out"):
        logger.flush()
    monkeypatch.setattr(L, "send_metrics", real)
    _log(logger, (4,))
    logger._paused_until = 0.0
    logger.close()
    assert _values(store, logger.run_id) == [(s, 10.0 - s) for s in range(1, 5)]


def test_an_offline_launchs_rows_reach_the_run_when_the_next_launch_is_online(tmp_path, store, monkeypatch):  # noqa: F811
    """Online, stopped (KILLED, closed properly); resumed on a node that cannot reach MLflow; resumed
    again online: the middle launch's rows reach the run. Before, only a run left RUNNING was caught up."""
    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    _log(first, (1, 2, 3))
    first.close("KILLED")
    offline = _offline_logger(monkeypatch, run_dir, EXPERIMENT)
    offline.resume_at(3)
    _log(offline, (4, 5, 6))
    offline.close("KILLED")
    third = RunLogger(run_dir, EXPERIMENT, "r", {}, {}, resume_run_id=first.run_id)
    third.resume_at(6)
    _log(third, (7,))
    third.close()
    assert _steps(store, first.run_id) == list(range(1, 8))
    assert sync_run(run_dir).action == "up to date"


def test_a_backlog_past_the_limit_is_left_to_sync_with_a_warning(tmp_path, store, monkeypatch):  # noqa: F811
    """An offline launch's rows, more than a resume sends while the other ranks wait: a warning names
    `repro tracking sync`, training logs on, and the sync then adds exactly the rows the run lacks."""
    monkeypatch.setattr(RunLogger, "MAX_CATCH_UP_VALUES", 5)
    run_dir = tmp_path / "run"
    offline = _offline_logger(monkeypatch, run_dir, EXPERIMENT)
    _log(offline, range(1, 11))
    offline.close("KILLED")
    online = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    with pytest.warns(UserWarning, match=rf"lacks 10 values of .*metrics.jsonl.*`repro tracking sync {run_dir}`"):
        online.resume_at(10)
    _log(online, (11, 12))
    online.close()
    assert _steps(store, online.run_id) == [11, 12]
    assert sync_run(run_dir).metrics_sent == 10 and _steps(store, online.run_id) == list(range(1, 13))


def test_a_long_pause_keeps_no_unbounded_backlog(tmp_path, store, monkeypatch):  # noqa: F811
    """Rows queued through a pause are bounded: past the limit they stay in metrics.jsonl only, named in
    one warning, and the rows after them still reach the run once the store answers."""
    monkeypatch.setattr(RunLogger, "MAX_CATCH_UP_VALUES", 5)
    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    real = L.send_metrics
    monkeypatch.setattr(L, "send_metrics", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("database is locked")))
    _log(logger, (1,))
    with pytest.warns(UserWarning, match="database is locked"):
        logger.flush()
    with pytest.warns(UserWarning, match=rf"MLflow has not answered for 6 values.*`repro tracking sync {run_dir}`"):
        _log(logger, range(2, 7))
    monkeypatch.setattr(L, "send_metrics", real)
    _log(logger, (7,))
    logger._paused_until = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.close()
    assert _steps(store, logger.run_id) == [7]
    assert sync_run(run_dir).metrics_sent == 6 and _steps(store, logger.run_id) == list(range(1, 8))


def _failing_sends(monkeypatch):
    monkeypatch.setattr(L, "send_metrics", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("database is locked")))


def test_a_failed_catch_up_at_resume_is_done_again_after_the_pause(tmp_path, store, monkeypatch):  # noqa: F811
    """The resume's catch-up request fails (a locked store): the rows the killed launch had queued are
    sent once MLflow answers again, though this launch's later rows reach the run first."""
    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    _log(first, range(1, 51))
    first.flush()
    _log(first, range(51, 56))  # queued when the process is killed
    second = RunLogger(run_dir, EXPERIMENT, "r", {}, {}, resume_run_id=first.run_id)
    real = L.send_metrics
    _failing_sends(monkeypatch)
    with pytest.warns(UserWarning, match="database is locked"):
        second.resume_at(55)
    monkeypatch.setattr(L, "send_metrics", real)
    _log(second, range(56, 61))
    second._paused_until = 0.0
    second.close()
    assert _values(store, first.run_id) == [(s, 10.0 - s) for s in range(1, 61)]


@pytest.mark.parametrize("then", ["a failed request", "a kill with rows queued"])
def test_a_launch_whose_clock_is_behind_the_last_ones_loses_no_row(tmp_path, store, monkeypatch, then):  # noqa: F811
    """Launch 1's node clock runs 60 s ahead of launch 2's: launch 2's later steps carry earlier times.
    The catch-up after a failed request, or the next launch's after a kill, still sends them (the store
    orders a metric's values by step first)."""
    run_dir, real_time, real_send = tmp_path / "run", L.time.time, L.send_metrics
    monkeypatch.setattr(L.time, "time", lambda: real_time() + 60)
    first = RunLogger(run_dir, EXPERIMENT, "r", {}, {})
    _log(first, range(1, 51))
    first.flush()  # then killed
    monkeypatch.setattr(L.time, "time", real_time)
    second = RunLogger(run_dir, EXPERIMENT, "r", {}, {}, resume_run_id=first.run_id)
    second.resume_at(50)
    if then == "a failed request":
        _failing_sends(monkeypatch)
        _log(second, range(51, 56))
        with pytest.warns(UserWarning, match="database is locked"):
            second.flush()
        monkeypatch.setattr(L, "send_metrics", real_send)
        _log(second, range(56, 61))
        second._paused_until = 0.0
        second.close()
    else:
        _log(second, range(51, 61))  # queued when the process is killed
        third = RunLogger(run_dir, EXPERIMENT, "r", {}, {}, resume_run_id=first.run_id)
        third.resume_at(60)
        third.close()
    assert _values(store, first.run_id) == [(s, 10.0 - s) for s in range(1, 61)]

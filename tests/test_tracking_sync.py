"""`repro tracking sync` compares a run directory with its MLflow run every time: rows a killed logger
had queued, and rows logged after a sync made while the run still trained, reach MLflow; a repeated
sync, or one racing the live logger, never duplicates a row."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from repro.tracking.logger import RunLogger
from repro.tracking.run_dir import recorded_run_id
from repro.tracking.sync import sync_run

UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _steps(uri: str, run_id: str, key: str = "loss") -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _offline_logger(monkeypatch, run_dir: Path, experiment: str) -> RunLogger:
    """A logger started while MLflow was unreachable: metrics.jsonl only."""
    with monkeypatch.context() as down, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        down.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        return RunLogger(run_dir, experiment, "r", {}, {})


def _log(logger: RunLogger, steps) -> None:
    for step in steps:
        logger.log_metrics({"loss": 10.0 - step}, step)


def test_rows_queued_when_the_logger_was_killed_are_synced(tmp_path, store):
    """MLflow up throughout, the process killed (OOM, Slurm's KillWait) with rows still queued for
    the next batched flush: sync sends exactly those rows, and a file the run never uploaded."""
    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {})
    logger.log_artifact(_write(tmp_path / "config.yaml", "a: 1\n"))
    _log(logger, range(1, 6))  # queued (FLUSH_SECONDS), then the process dies: no flush, no close
    _write(run_dir / "artifacts" / "final_metrics.json", "{}")
    assert _steps(store, logger.run_id) == []
    first = sync_run(run_dir)
    assert (first.run_id, first.action, first.metrics_sent) == (logger.run_id, "updated", 5)
    assert _steps(store, logger.run_id) == [1, 2, 3, 4, 5]
    from mlflow import MlflowClient

    assert {a.path for a in MlflowClient(store).list_artifacts(logger.run_id)} == {"config.yaml", "final_metrics.json"}
    again = sync_run(run_dir)
    assert (again.action, again.metrics_sent) == ("up to date", 0) and _steps(store, logger.run_id) == [1, 2, 3, 4, 5]


def test_rows_logged_after_a_sync_made_while_the_run_trained_are_synced(tmp_path, store, monkeypatch):
    """MLflow down at start (the logger writes metrics.jsonl only), synced mid-run once the server is
    back, then training continues: the final sync sends the later rows."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as down, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        down.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        logger = RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {})
    _log(logger, (1, 2, 3))
    mid = sync_run(run_dir)
    assert (mid.action, mid.metrics_sent) == ("created", 3)
    _log(logger, (4, 5, 6))
    logger.close()
    final = sync_run(run_dir)
    assert (final.run_id, final.action, final.metrics_sent) == (mid.run_id, "updated", 3)
    assert _steps(store, mid.run_id) == [1, 2, 3, 4, 5, 6] and recorded_run_id(run_dir) == mid.run_id
    assert sync_run(run_dir).action == "up to date"


def test_a_sync_racing_the_live_logger_duplicates_nothing(tmp_path, store):
    """A sync while the logger is up and has rows queued sends them; the logger's own flush of the
    same rows later adds nothing (a row is key, step and timestamp, as the logger wrote it)."""
    run_dir = tmp_path / "run"
    with RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {}) as logger:
        _log(logger, (1, 2, 3))
        assert sync_run(run_dir).metrics_sent == 3
        _log(logger, (4,))
    from mlflow import MlflowClient

    history = MlflowClient(store).get_metric_history(logger.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert sync_run(run_dir).action == "up to date"


def _status(uri: str, run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(uri).get_run(run_id).info.status


def test_sync_sets_the_status_the_run_directory_shows(tmp_path, store, monkeypatch):
    """A run whose logger lost MLflow before close() stays RUNNING in the store (the analysis reads
    FINISHED runs only): sync finishes it once final_metrics.json is from its last step, leaves a
    run still training (or extended past an earlier end) as it is, and marks a stopped one KILLED.
    It used to finish only runs it had created itself, and those even mid-training."""
    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {})
    _log(logger, (1, 2))
    logger.flush()
    sync_run(run_dir)
    assert _status(store, logger.run_id) == "RUNNING"  # training: no end written
    _write(run_dir / "final_metrics.json", '{"iteration": 2}')
    sync_run(run_dir)
    assert _status(store, logger.run_id) == "FINISHED"
    _log(logger, (3,))  # extended past its end: not finished any more
    _write(run_dir / "stopped_by_signal", "3")
    sync_run(run_dir)
    assert _status(store, logger.run_id) == "KILLED"
    (run_dir / "stopped_by_signal").unlink()
    assert sync_run(run_dir).action == "up to date" and _status(store, logger.run_id) == "KILLED"

    created = tmp_path / "created"
    offline = _offline_logger(monkeypatch, created, "exp-sync")
    _log(offline, (1, 2))
    assert _status(store, sync_run(created).run_id) == "RUNNING"  # mid-training: not FINISHED


def test_a_failed_request_pauses_mlflow_and_the_run_still_ends_finished(tmp_path, store, monkeypatch):
    """One failed batch (a locked sqlite store, a server restart) used to turn MLflow off for the rest
    of the run, which then stayed RUNNING; now rows wait RETRY_SECONDS, the run gets every row it lacks
    once MLflow answers again, and close() still sets FINISHED."""
    from repro.tracking import logger as L

    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, "exp-sync", "r1", {}, {})
    real = L.send_metrics

    def locked(*args, **kwargs):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(L, "send_metrics", locked)
    _log(logger, (1, 2))
    with pytest.warns(UserWarning, match="database is locked.*retrying"):
        logger.flush()
    monkeypatch.setattr(L, "send_metrics", real)
    _log(logger, (3,))  # paused: only metrics.jsonl
    logger._paused_until = 0.0  # the retry time has come
    _log(logger, (4,))
    logger.close()
    assert _steps(store, logger.run_id) == [1, 2, 3, 4] and _status(store, logger.run_id) == "FINISHED"
    assert sync_run(run_dir).action == "up to date"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_login_node_reads_the_store_the_cluster_settings_give_the_jobs(tmp_path, monkeypatch):
    """Only the job scripts source slurm/cluster.env: `repro report` and `repro tracking sync` on a login
    node read the repository's own sqlite store (the demo's runs) unless they take the file's URI too."""
    from repro.tracking.store import default_tracking_uri

    jobs = f"sqlite:///{tmp_path / 'cluster.db'}"
    (tmp_path / "cluster.env").write_text(f"REPRO_RUNS_DIR=/shared/runs\nMLFLOW_TRACKING_URI={jobs}\n")
    monkeypatch.setenv("REPRO_CLUSTER_ENV", str(tmp_path / "cluster.env"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri() == jobs
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mine:5000")  # the environment still wins
    assert default_tracking_uri() == "http://mine:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "cluster.env").write_text("REPRO_RUNS_DIR=/shared/runs\n")
    assert default_tracking_uri().endswith("/mlruns/mlflow.db")


def test_a_new_experiment_keeps_its_artifacts_where_its_store_does(tmp_path, monkeypatch):
    """A server (named by the environment or only by cluster.env) keeps the artifacts where it is told;
    a sqlite store keeps them beside its database. Before, a server named only by cluster.env got
    experiments whose artifacts went to the login node's checkout (mlruns/artifacts)."""
    from repro.tracking.store import default_artifact_location

    assert default_artifact_location("gpt2", "http://login01:5000") is None
    shared = tmp_path / "shared" / "mlflow.db"
    assert default_artifact_location("gpt2", f"sqlite:///{shared}") == (shared.parent / "artifacts/gpt2").as_uri()
    monkeypatch.chdir(tmp_path)  # a relative database path (three slashes) is resolved
    assert default_artifact_location("bert", "sqlite:///shared/mlflow.db") == (shared.parent / "artifacts/bert").as_uri()


def test_the_check_before_launch_asks_a_server_once_and_names_the_fix(tmp_path):
    """probe_tracking_server: nothing to ask of a sqlite store; a server that does not answer is
    reported with what it said; MLflow 3's refusal of an unknown Host name comes with the fix (the
    real refusal, from a real server, is in tests/test_slurm_multinode.py)."""
    from repro.tracking.store import probe_tracking_server, tracking_hint

    assert probe_tracking_server(f"sqlite:///{tmp_path / 'mlflow.db'}") is None
    problem = probe_tracking_server(UNREACHABLE)
    assert problem.startswith(f"the MLflow server at {UNREACHABLE} did not answer (") and "--allowed-hosts" not in problem
    assert "`repro tracking sync RUN_DIR` uploads it later" in problem
    refused = RuntimeError("... 403 != 200. Response body: 'Invalid Host header - possible DNS rebinding attack detected'")
    assert "`mlflow server --allowed-hosts login01:5000 ...`" in tracking_hint(refused, "http://login01:5000")
    assert tracking_hint(ConnectionError("refused"), "http://login01:5000") == ""


def test_a_server_with_authentication_gets_its_credentials_from_the_environment(tmp_path, monkeypatch):
    """A real `mlflow server --app-name basic-auth`: without credentials the check before launch
    reports its 401 and names MLFLOW_TRACKING_USERNAME / _PASSWORD and ~/.mlflow/credentials; with
    them exported (as slurm/launch.sh passes the batch environment to every task) the check passes
    and the trainer's logger logs params, metrics and an artifact into the server."""
    from mlflow import MlflowClient

    from mlflow_server import MlflowServer
    from repro.tracking.store import probe_tracking_server

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with MlflowServer(tmp_path / "server", auth=True) as server:
        problem = probe_tracking_server(server.local_uri)
        assert "error code 401" in problem and "MLFLOW_TRACKING_PASSWORD are not set" in problem, problem
        assert "~/.mlflow/credentials" in problem
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.ADMIN[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
        assert "MLFLOW_TRACKING_PASSWORD were refused" in probe_tracking_server(server.local_uri)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.ADMIN[1])
        assert probe_tracking_server(server.local_uri) is None
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.local_uri)
        run_dir = tmp_path / "run"
        logger = RunLogger(run_dir, "auth-test", "authenticated", {"tp": "2"}, {"family": "gpt"})
        _log(logger, range(1, 4))
        (run_dir / "config.yaml").write_text("name: authenticated\n")
        logger.log_artifact(run_dir / "config.yaml")
        logger.close()
        client = MlflowClient(server.local_uri)
        run = client.get_run(recorded_run_id(run_dir))
        assert run.data.params == {"tp": "2"} and run.info.status == "FINISHED"
        assert _steps(server.local_uri, run.info.run_id) == [1, 2, 3]
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_a_tracking_server_restarted_mid_run_costs_no_row(tmp_path, monkeypatch):
    """A real `mlflow server` stopped mid-run (a login-node restart) and started again on its store and
    port: the logger's failed batch pauses MLflow, the rows go on into metrics.jsonl, the first batch
    after the pause sends the restarted server every row it lacks, and close() sets FINISHED."""
    from mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "server").start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.local_uri)
        run_dir = tmp_path / "run"
        logger = RunLogger(run_dir, "restart-test", "r", {}, {})
        _log(logger, (1, 2))
        logger.flush()
        server.stop()
        _log(logger, (3, 4))
        with pytest.warns(UserWarning, match="MLflow request failed.*retrying"):
            logger.flush()
        server.start()
        logger._paused_until = 0.0  # the retry time has come
        _log(logger, (5,))
        logger.close()
        assert _steps(server.local_uri, logger.run_id) == [1, 2, 3, 4, 5]
        assert _status(server.local_uri, logger.run_id) == "FINISHED"
        assert sync_run(run_dir).action == "up to date"
    finally:
        server.stop()


def _record(training_run_id, **metrics):
    import time

    from repro.eval.report import EvalRecord

    return EvalRecord("wikitext", {"word_ppl": 20.5, "num_bpe_tokens": 270329.0, **metrics},
                      {"window": 1024, "stride": 32, "file": "wiki.test.tokens"},
                      training_run_id=training_run_id, time=time.time())


def test_an_evaluation_logged_before_its_training_run_existed_is_linked_not_logged_again(tmp_path, store,
                                                                                        monkeypatch):
    """Training with MLflow down, then `repro eval` with it up (the record names no training run),
    then `repro tracking sync RUN_DIR`: the training run is created and the evaluation run already
    there is linked to it. It used to be logged a second time (Table 3 showed the model twice)."""
    from mlflow import MlflowClient

    from repro.eval.report import log_to_mlflow, sync_records, write_json

    run_dir = tmp_path / "run"
    offline = _offline_logger(monkeypatch, run_dir, "gpt2")
    _log(offline, (1, 2))
    offline.close()
    record = _record(None)
    write_json(record, run_dir / "zero_shot.jsonl")
    eval_run = log_to_mlflow(record)
    training_run = sync_run(run_dir).run_id
    for _ in range(2):
        result = sync_records(run_dir / "zero_shot.jsonl")
        assert (result.created, result.already) == ([], 1)
    tags = MlflowClient(store).get_run(eval_run).data.tags
    assert tags["training_run_id"] == training_run


def test_an_evaluation_with_a_nan_metric_is_synced_once(tmp_path, store):
    """A diverged model's perplexity is NaN, and NaN != NaN: every sync used to log it again."""
    from repro.eval.report import sync_records, write_json

    write_json(_record("abc", word_ppl=float("nan"), sum_nll=float("nan")), tmp_path / "zero_shot.jsonl")
    created = [sync_records(tmp_path / "zero_shot.jsonl").created for _ in range(3)]
    assert [len(c) for c in created] == [1, 0, 0]


def test_an_evaluation_with_an_infinite_perplexity_is_synced_once(tmp_path, store):
    """An overflowing perplexity is inf in the record; MLflow stores it as the largest float, which
    made every sync log the record again."""
    from repro.eval.report import sync_records, write_json

    write_json(_record("abc", word_ppl=float("inf"), sum_nll=8000.0), tmp_path / "zero_shot.jsonl")
    created = [sync_records(tmp_path / "zero_shot.jsonl").created for _ in range(3)]
    assert [len(c) for c in created] == [1, 0, 0]


def test_a_new_launch_removes_an_earlier_launchs_stop_marker(tmp_path, store):
    """A run stopped for a signal and continued by hand (not by launch.sh, which removes the marker):
    the stale marker made sync mark the finished run KILLED, and the tables dropped it."""
    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, "exp-sync", "r", {}, {})
    _log(first, (1, 2))
    first.close("KILLED")
    _write(run_dir / "stopped_by_signal", "2")
    again = RunLogger(run_dir, "exp-sync", "r", {}, {}, resume_run_id=first.run_id)
    assert not (run_dir / "stopped_by_signal").exists()
    _log(again, (3, 4))
    _write(run_dir / "final_metrics.json", '{"iteration": 4}')
    again.close()
    sync_run(run_dir)
    assert _status(store, first.run_id) == "FINISHED"


def test_a_run_begun_again_gets_none_of_the_dead_launchs_rows(tmp_path, store):
    """Killed before its first checkpoint, then the same command again: the new launch starts over
    (a new MLflow run); the dead launch's metrics.jsonl and run id are set aside, its run ends KILLED,
    and sync no longer copies its rows into the new run (two values a step)."""
    run_dir = tmp_path / "run"
    dead = RunLogger(run_dir, "exp-sync", "r", {}, {})
    _log(dead, (1, 2, 3))
    dead.flush()  # then killed: no close
    again = RunLogger(run_dir, "exp-sync", "r", {}, {}, starts_over=True)
    _log(again, (1, 2, 3))
    _write(run_dir / "final_metrics.json", '{"iteration": 3}')
    again.close()
    sync_run(run_dir)
    assert _steps(store, again.run_id) == [1, 2, 3] and _status(store, dead.run_id) == "KILLED"
    assert len(list(run_dir.glob("metrics.jsonl.before-*"))) == 1 == len(list(run_dir.glob("mlflow_run_id.before-*")))


@pytest.mark.parametrize("online", [True, False])
def test_a_resume_that_changes_a_param_shows_the_new_value_to_the_analysis(tmp_path, store, monkeypatch, online):
    """A run extended on resume (train.train_iters 100 -> 1000): MLflow never changes a logged param,
    so the new value goes in the tag resumed_with.train.train_iters, live or by sync after an
    outage, and the analysis reads it as the param (it labelled the run a 100-iteration test)."""
    from repro.analysis.runs import load_runs

    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, "exp-sync", "r", {"train.train_iters": 100, "lr": "0.1"}, {})
    _log(first, (1, 2))
    first.close("KILLED")
    with monkeypatch.context() as env, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not online:
            env.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        again = RunLogger(run_dir, "exp-sync", "r", {"train.train_iters": 1000, "lr": "0.1"}, {},
                          resume_run_id=first.run_id)
        _log(again, (3,))
        again.close()
    if not online:
        assert sync_run(run_dir).action == "updated"
    assert sync_run(run_dir).action == "up to date"
    row = load_runs(store, "exp-sync", finished_only=False).iloc[0]
    assert (row["params.train.train_iters"], row["params.lr"]) == ("1000", "0.1")


def test_a_resume_into_a_run_deleted_in_the_ui_logs_into_a_new_run(tmp_path, store):
    """Metrics sent to a deleted run are invisible to the analysis: the resumed launch warns and opens
    a new run, which the run directory then names."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    first = RunLogger(run_dir, "exp-sync", "r", {}, {})
    _log(first, (1,))
    first.close("KILLED")
    MlflowClient(store).delete_run(first.run_id)
    with pytest.warns(UserWarning, match="was deleted: logging into a new run"):
        again = RunLogger(run_dir, "exp-sync", "r", {}, {}, resume_run_id=first.run_id)
    _log(again, (2,))
    again.close()
    assert again.run_id != first.run_id and recorded_run_id(run_dir) == again.run_id
    assert _steps(store, again.run_id) == [2]


def test_a_resume_into_a_run_another_store_holds_logs_into_a_new_run(tmp_path, store):
    """The tracking URI changed between launches (or `mlflow gc` removed the run): the resumed launch
    warns and opens a new run here, instead of switching MLflow off for the whole launch."""
    run_dir = tmp_path / "run"
    with pytest.warns(UserWarning, match="is not in .*logging into a new run"):
        again = RunLogger(run_dir, "exp-sync", "r", {}, {}, resume_run_id="0123456789abcdef0123456789abcdef")
    _log(again, (2,))
    again.close()
    assert recorded_run_id(run_dir) == again.run_id and _steps(store, again.run_id) == [2]


@pytest.mark.parametrize("row, problem", [
    ({"step": 1, "loss": 2.0}, "has time None, not a number of seconds"),
    ({"step": 1, "time": 1.0, "loss": "n/a"}, "has non-numeric value(s) for loss"),
    ([1, 2], "is a JSON list, not an object"),
    ({"step": "1", "time": 1.0, "loss": 2.0}, "has step '1', not an integer"),
])
def test_sync_refuses_a_bad_metrics_row_before_creating_a_run(tmp_path, store, capsys, row, problem):
    """A malformed metrics.jsonl row is a user error naming its line, found before MLflow is contacted:
    it was a KeyError/ValueError traceback after an empty RUNNING run had been created."""
    import json

    from repro.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "params.json").write_text("{}")
    (run_dir / "tags.json").write_text(json.dumps({"experiment": "exp-sync", "run_name": "r"}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "loss": 3.0}) + "\n" + json.dumps(row) + "\n"
                                           + json.dumps({"step": 2, "time": 2.0, "loss": 1.0}) + "\n")
    assert main(["tracking", "sync", str(run_dir)]) == 2
    assert f"metrics.jsonl:2 {problem}" in capsys.readouterr().err
    assert recorded_run_id(run_dir) is None and not (tmp_path / "mlflow.db").exists()


def _runs_of(uri: str) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def test_a_sync_into_another_store_does_not_detach_the_directory_from_its_run(tmp_path, store, monkeypatch):
    """Synced into store A, then (a wrong MLFLOW_TRACKING_URI) into B, which rewrote mlflow_run_id,
    then into A again: A's run is found again by its run_dir tag, not uploaded a second time, and a
    resumed launch against A logs into it too. Each store holds one run of the directory."""
    run_dir = tmp_path / "run"
    offline = _offline_logger(monkeypatch, run_dir, "exp-sync")
    _log(offline, (1, 2))
    offline.close()
    other = f"sqlite:///{tmp_path / 'other.db'}"
    first = sync_run(run_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    wrong = sync_run(run_dir)
    assert wrong.action == "created" and "uploading as a new run" in wrong.note
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    again = sync_run(run_dir)
    assert (again.run_id, again.action) == (first.run_id, "up to date") and "syncing into" in again.note
    assert recorded_run_id(run_dir) == first.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert sync_run(run_dir).run_id == wrong.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    with pytest.warns(UserWarning, match=f"resuming this directory's run {first.run_id}"):
        resumed = RunLogger(run_dir, "exp-sync", "r", {}, {}, resume_run_id=wrong.run_id)
    _log(resumed, (3,))
    resumed.close()
    assert resumed.run_id == first.run_id and _steps(store, first.run_id) == [1, 2, 3]
    assert _runs_of(store) == [first.run_id] and _runs_of(other) == [wrong.run_id]


def test_a_live_logged_run_is_found_again_after_a_sync_into_another_store(tmp_path, store, monkeypatch):
    """The run the trainer logged live carries the run_dir tag too: a sync into another store and back
    does not copy it."""
    run_dir = tmp_path / "run"
    live = RunLogger(run_dir, "exp-sync", "r", {}, {})
    _log(live, (1, 2))
    live.close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    sync_run(run_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert sync_run(run_dir).run_id == live.run_id and _runs_of(store) == [live.run_id]


def test_two_directories_of_the_same_relative_path_sync_into_runs_of_their_own(tmp_path, store, monkeypatch):
    """Two checkouts' `runs/gpt` synced into one shared store: B (logged live into its own store first,
    so its mlflow_run_id names a run the shared store lacks) gets a run of its own. Before, B's sync
    found A's run by the relative synced_from tag and added B's loss to it."""
    from mlflow import MlflowClient

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    offline = _offline_logger(monkeypatch, Path("runs/gpt"), "exp-shared")
    _log(offline, (1,))
    offline.close()
    sync_run(Path("runs/gpt"))
    monkeypatch.chdir(tmp_path / "b")
    with monkeypatch.context() as local:
        local.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'local_b.db'}")
        live = RunLogger(Path("runs/gpt"), "exp-shared", "gpt", {}, {})
        live.log_metrics({"loss": 99.0}, 1)
        live.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # B's run id is not in the shared store
        sync_run(Path("runs/gpt"))
    a, b = recorded_run_id(tmp_path / "a/runs/gpt"), recorded_run_id(tmp_path / "b/runs/gpt")
    losses = {run: [m.value for m in MlflowClient(store).get_metric_history(run, "loss")] for run in (a, b)}
    assert a != b and losses == {a: [9.0], b: [99.0]}, losses


@pytest.mark.parametrize("line, problem", [
    ('{"task": "wikitext", "metrics": {"word_ppl": "12.5x"}, "params": {"window": 1024}}',
     "metrics: word_ppl='12.5x', not a number"),
    ('{"task": "wikitext", "metrics": null, "params": {}}', "metrics is null, not an object"),
    ('{"task": "wikitext", "metrics": {"word_ppl": 1.0}, "params": [1024]}', "params is [1024], not an object"),
    ('{"task": "wikitext", "metrics": {"word_ppl": true}, "params": {}}', "metrics: word_ppl=True, not a number"),
    ('{"task": "wikitext", "metrics": {}, "params": {"window": {"a": 1}}}', "params: window={'a': 1}, not a string"),
    ('{"task": "wikitext", "metrics": {}}', "lacks params"),
    ('[1, 2]', "a JSON list, not an object"),
])
def test_eval_sync_refuses_a_malformed_record_before_contacting_mlflow(tmp_path, store, capsys, line, problem):
    """A non-numeric metric, null metrics or non-object params in a zero_shot.jsonl: a user error naming
    the file and line, before MLflow is contacted (it was a traceback after the store was opened)."""
    from repro.cli import main

    path = tmp_path / "zero_shot.jsonl"
    path.write_text(line + "\n")
    assert main(["tracking", "sync", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1 is not an evaluation record: {problem}" in err and "Fix:" in err, err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_dead_launchs_run_is_not_found_again_for_the_run_begun_again(tmp_path, store, monkeypatch):
    """Killed before its first checkpoint, begun again with MLflow down (the dead launch's id set
    aside), synced into another store and back: the new launch gets a run of its own, its rows are not
    put into the dead launch's run."""
    run_dir = tmp_path / "run"
    dead = RunLogger(run_dir, "exp-sync", "r", {}, {})
    _log(dead, (1, 2))
    dead.flush()  # then killed: no close
    with monkeypatch.context() as down, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        down.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        again = RunLogger(run_dir, "exp-sync", "r", {}, {}, starts_over=True)
    _log(again, (1, 2, 3))
    again.close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    sync_run(run_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    synced = sync_run(run_dir)
    assert synced.action == "created" and synced.run_id != dead.run_id
    assert _steps(store, dead.run_id) == [1, 2] and _steps(store, synced.run_id) == [1, 2, 3]


def test_all_runs_reads_every_page(store):
    """One search_runs call stops at its max_results (the eval sync's 1,000, the analysis' 5,000): past
    them a sync logged a record again and a table missed runs. all_runs follows the page tokens."""
    from mlflow import MlflowClient

    from repro.tracking.store import all_runs, experiment_id

    client = MlflowClient(store)
    exp = experiment_id(client, "exp-pages")
    made = {client.create_run(exp).info.run_id for _ in range(5)}
    assert len(client.search_runs([exp], max_results=2)) == 2
    assert {r.info.run_id for r in all_runs(client, [exp], page_size=2)} == made

"""The MLflow run of a run directory, shared by the training logger and `repro tracking sync`: find,
create or reopen it, and send it the params, tags and metric rows it lacks."""

from __future__ import annotations

import warnings
from pathlib import Path

from repro.tracking.run_dir import RESUMED_PARAM_TAG, RUN_ID_FILE, set_aside_run_ids, write_text
from repro.tracking.store import default_tracking_uri, experiment_id

RUN_DIR_TAG = "run_dir"  # the run directory's absolute path: sync finds its run in a store again by it


def clean_metric_name(name: str) -> str:
    """MLflow rejects ',' in metric names (lm-eval's `acc,none`)."""
    return name.replace(",", "_")


def live_run(client, run_id: str | None, run_dir: Path, experiment: str):
    """The run to resume into, or None: none named, or one deleted in the UI since (metrics logged
    into it would be invisible to the analysis), or one this store does not hold (the tracking URI
    changed between launches, or `mlflow gc` removed it), each with a warning and a new run instead.
    A run id of another store (a sync into it rewrote mlflow_run_id) resumes this directory's run
    here when the store has one (run_of_dir)."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = run_of_dir(client, run_dir, experiment)
        instead = f"resuming this directory's run {found.info.run_id} there" if found else "logging into a new run"
        warnings.warn(f"MLflow run {run_id} of this run directory is not in {default_tracking_uri()} (another "
                      f"store's, or garbage-collected): {instead}", stacklevel=3)
        return found
    if run.info.lifecycle_stage == "deleted":
        warnings.warn(f"MLflow run {run_id} of this run directory was deleted: logging into a new run",
                      stacklevel=3)
        return None
    return run


def end_dead_launch(client, run_id: str | None) -> bool:
    """Mark the MLflow run of a launch that died before any checkpoint KILLED (it stayed RUNNING).
    Whether it did."""
    if run_id:
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "KILLED")
                return True
        except Exception:  # deleted, or another store's: nothing to end
            pass
    return False


def log_param_changes(client, run, params: dict, tags: dict) -> bool:
    """Log the params (params.json) the run lacks; a param's value since a resume changed it (tags.json's
    resumed_with.KEY, or params.json's where the run holds another) goes in the tag resumed_with.KEY, as
    MLflow never changes a logged param (the analysis reads it). Whether anything was sent."""
    held = run.data.params
    new = {k: v for k, v in params.items() if k not in held}
    now = {k: str(tags.get(RESUMED_PARAM_TAG + k, v)) for k, v in params.items() if k in held}
    changed = {k: v for k, v in now.items() if v != _param_now(run, k)}
    log_params(client, run.info.run_id, new)
    for key, value in changed.items():
        client.set_tag(run.info.run_id, RESUMED_PARAM_TAG + key, value)
    return bool(new or changed)


def _param_now(run, key: str) -> str | None:
    """A param's value as the analysis reads it: a resume's change (tag) over the logged value."""
    return run.data.tags.get(RESUMED_PARAM_TAG + key, run.data.params.get(key))


def log_params(client, run_id: str, params: dict) -> None:
    """Log params in batches of 100 (MLflow's per-request limit)."""
    from mlflow.entities import Param

    rows = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(rows), 100):
        client.log_batch(run_id, params=rows[i:i + 100])


def send_metrics(client, run_id: str, metrics: list, chunk: int = 1000, progress=None) -> None:
    """Log Metric rows in batches of at most `chunk` (MLflow's per-request limit); `progress` (a tqdm
    bar) advances by each batch's values."""
    for i in range(0, len(metrics), chunk):
        batch = metrics[i:i + chunk]
        client.log_batch(run_id, metrics=batch)
        if progress is not None:
            progress.update(len(batch))


def _metric_rows(rows: list[dict]) -> list:
    from mlflow.entities import Metric

    return [Metric(clean_metric_name(k), float(v), int(row["time"] * 1000), row["step"])
            for row in rows for k, v in row.items() if k not in ("step", "time")]


def latest_values(client, run_id: str) -> dict[str, tuple[int, int]]:
    """Each metric's (step, timestamp) of the run's latest value, the store's order (step first): one
    request, whatever the run's length."""
    return {m.key: (m.step, m.timestamp) for m in client.get_run(run_id).data.to_proto().metrics}


def _past(latest: dict[str, tuple[int, int]], key: str, step: int, timestamp: int) -> bool:
    """Whether a row (key, step, timestamp) comes after its key's latest value in the run, as steps go
    or as time goes (a launch on a node whose clock is behind an earlier one's logs later steps at
    earlier times; a redone step after a schedule change, an earlier step at a later time)."""
    last = latest.get(key)
    return last is None or (step, timestamp) > last or timestamp > last[1]


def metrics_past_latest(client, run_id: str, metrics: list) -> list:
    """The Metric rows of `metrics` (in the order logged) that the run lacks, found with one request
    (latest_values), not by downloading each key's whole history, which grows with the run (12M values
    for BERT's 1.5M iterations). A launch sends its rows in order, so the run holds a prefix of them:
    a row after its key's latest value (_past) is missing; one before it is there (e.g. a batch the
    store took before its reply failed). A row sent although it is there is dropped by a SQL store (the
    same key, step, time and value), as rows past another launch's latest value may be."""
    latest = latest_values(client, run_id)
    return [m for m in metrics if _past(latest, m.key, m.step, m.timestamp)]


def rows_past_latest(client, run_id: str, rows: list[dict]) -> list:
    """metrics_past_latest for metrics.jsonl's rows, building Metric rows only for the values the run
    lacks (a resume reads millions of rows, nearly all in the run already)."""
    from mlflow.entities import Metric

    latest = latest_values(client, run_id)
    missing = []
    for row in rows:
        step, timestamp = row["step"], int(row["time"] * 1000)
        for key, value in row.items():
            name = clean_metric_name(key) if key not in ("step", "time") else None
            if name and _past(latest, name, step, timestamp):
                missing.append(Metric(name, float(value), timestamp, step))
    return missing


def send_missing_metrics(client, run_id: str, rows: list[dict], progress=None) -> int:
    """Log the metric rows (a row = key, step, timestamp) of metrics.jsonl's `rows` the run lacks;
    how many were sent. `progress` (a tqdm bar) is given their total and advances as they go."""
    metrics = _metric_rows(rows)
    logged = {(m.key, m.step, m.timestamp) for key in {m.key for m in metrics}
              for m in client.get_metric_history(run_id, key)}
    new = [m for m in metrics if (m.key, m.step, m.timestamp) not in logged]
    if progress is not None:
        progress.total = len(new)  # (not reset(): it would draw the bar before its delay)
    send_metrics(client, run_id, new, progress=progress)
    return len(new)


def existing_run(client, run_id: str | None):
    """The named run when the store holds it (and it is not deleted), else None."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return None if run.info.lifecycle_stage == "deleted" else run


def create_run(client, run_dir: Path, tags: dict, **extra: str):
    """A new run with tags.json's tags (and `extra`); its id is recorded first, so a broken sync
    resumes into it."""
    rest = {k: str(v) for k, v in tags.items() if k not in ("experiment", "run_name")}
    run = client.create_run(experiment_id(client, tags["experiment"]), run_name=tags["run_name"],
                            tags={**rest, **extra, RUN_DIR_TAG: str(run_dir.resolve())})
    write_text(run_dir / RUN_ID_FILE, run.info.run_id)
    return run


def run_of_dir(client, run_dir: Path, experiment: str):
    """The newest live run of `experiment` this directory logged or synced (its run_dir tag, or the
    synced_from tag of syncs before that tag), not one of a launch set aside (mlflow_run_id.before-*):
    `mlflow_run_id` names another store's run after a sync into that store, and this store's run is
    found again instead of uploaded twice. Only by absolute path: a relative one (`runs/gpt`) names
    another user's or checkout's directory as well, whose run this directory's rows must not join."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    path = str(run_dir.resolve())
    dead = set_aside_run_ids(run_dir)
    for key, value in ((RUN_DIR_TAG, path), ("synced_from", path)):
        if "'" in value:  # not expressible in a search filter
            continue
        runs = client.search_runs([exp.experiment_id], f"tags.{key} = '{value}'", max_results=100,
                                  order_by=["attributes.start_time DESC"])
        found = next((r for r in runs if r.info.run_id not in dead), None)
        if found:
            return found
    return None

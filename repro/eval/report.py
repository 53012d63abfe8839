"""Evaluation output: a small table on stdout, a JSON record, and an MLflow run in "zero-shot".

The MLflow run carries the evaluation's own params (window, stride, strict, data sha256, checkpoint)
and is linked to the training run by the tag `training_run_id` (and `mlflow.parentRunId` when that
run is in the same tracking store, so the UI nests it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

EXPERIMENT = "zero-shot"


@dataclass
class EvalRecord:
    """One evaluation's numbers and settings."""

    task: str
    metrics: dict[str, float]
    params: dict[str, str | int | float | bool]
    training_run_id: str | None = None
    paper: dict[str, float] = field(default_factory=dict)


def format_table(record: EvalRecord) -> str:
    """Two aligned columns (metric, value), with the paper's value where there is one."""
    rows = [(k, _fmt(v), _fmt(record.paper[k]) if k in record.paper else "") for k, v in record.metrics.items()]
    width = max(len(r[0]) for r in rows)
    head = f"{record.task}  " + "  ".join(f"{k}={v}" for k, v in record.params.items() if k != "checkpoint")
    lines = [head, f"{'metric':<{width}}  {'value':>14}  {'paper':>10}"]
    lines += [f"{k:<{width}}  {v:>14}  {p:>10}" for k, v, p in rows]
    return "\n".join(lines)


def _fmt(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer() and abs(value) > 100:
        return f"{int(value):,}"
    return f"{value:.4f}"


def write_json(record: EvalRecord, path: Path) -> None:
    """Append the record as one JSON line (the copy that survives a tracking server outage)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record.__dict__, sort_keys=True) + "\n")


def _experiment_id(mlflow) -> str:
    from repro.tracking.store import default_artifact_location

    found = mlflow.get_experiment_by_name(EXPERIMENT)
    if found is not None:
        return found.experiment_id
    return mlflow.create_experiment(EXPERIMENT, artifact_location=default_artifact_location(EXPERIMENT))


def _link_tags(mlflow, training_run_id: str | None, experiment_id: str) -> dict[str, str]:
    if not training_run_id:
        return {}
    tags = {"training_run_id": training_run_id}
    try:
        parent = mlflow.get_run(training_run_id)
    except Exception:  # the training run lives in another store: keep the id only
        return tags
    if parent.info.experiment_id == experiment_id:
        tags["mlflow.parentRunId"] = training_run_id
    return tags


def log_to_mlflow(record: EvalRecord, tracking_uri: str | None = None) -> str:
    """Log the record as a run of the "zero-shot" experiment; returns the run id. An unreachable or
    failing store is a TrackingError naming the URI within seconds (one quick HTTP retry)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from repro.tracking.logger import TrackingError, quiet_http_retries
    from repro.tracking.store import default_tracking_uri

    uri = tracking_uri or default_tracking_uri()
    quiet_http_retries()
    try:
        mlflow.set_tracking_uri(uri)
        experiment_id = _experiment_id(mlflow)
        tags = {"task": record.task, **_link_tags(mlflow, record.training_run_id, experiment_id)}
        with mlflow.start_run(experiment_id=experiment_id, run_name=f"{record.task}", tags=tags) as run:
            mlflow.log_params({k: str(v) for k, v in record.params.items()})
            mlflow.log_metrics({_metric_name(record.task, k): float(v) for k, v in record.metrics.items()})
            return run.info.run_id
    except (MlflowException, OSError) as err:
        raise TrackingError(f"logging to MLflow at {uri} failed: {str(err)[:300]}") from None


def _metric_name(task: str, key: str) -> str:
    """`task/key`, with characters MLflow rejects (',' from lm-eval names) mapped to '_'."""
    return f"{task}/{key}".replace(",", "_")

"""Run tracking: every metric goes to `<run_dir>/metrics.jsonl`, and to MLflow when it is reachable.

Only one rank (global rank 0) creates a RunLogger. If the tracking server is down at start or
fails later, training continues with a warning; `repro tracking sync RUN_DIR` uploads the run
directory (params.json, tags.json, metrics.jsonl, artifacts/) afterwards, losing nothing.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

from repro.tracking.store import default_artifact_location, default_tracking_uri


def _quiet_http_retries() -> None:
    """Fail fast against an unreachable server instead of MLflow's minutes of retries."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def clean_metric_name(name: str) -> str:
    """MLflow rejects ',' in metric names (lm-eval's `acc,none`)."""
    return name.replace(",", "_")


def start_mlflow_run(experiment: str, run_name: str, tags: dict[str, str]):
    """Create (or reuse) the experiment and start a run; returns the mlflow module's active run."""
    import mlflow

    _quiet_http_retries()
    mlflow.set_tracking_uri(default_tracking_uri())
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=default_artifact_location(experiment))
    mlflow.set_experiment(experiment)
    return mlflow.start_run(run_name=run_name, tags=tags)


class RunLogger:
    """JSONL always; MLflow best-effort. Use as a context manager around training."""

    FLUSH_SECONDS = 10.0

    def __init__(self, run_dir: str | Path, experiment: str, run_name: str,
                 params: dict[str, str], tags: dict[str, str], use_mlflow: bool = True,
                 resume_run_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        (self.run_dir / "params.json").write_text(json.dumps(params, indent=1, sort_keys=True))
        (self.run_dir / "tags.json").write_text(json.dumps({**tags, "experiment": experiment,
                                                            "run_name": run_name}, indent=1))
        self.run_id: str | None = None
        self._mlflow = None
        self._pending: list = []  # MLflow Metric rows not yet sent
        self._last_flush = time.monotonic()
        if use_mlflow:
            self._start(experiment, run_name, params, tags, resume_run_id)

    def _start(self, experiment, run_name, params, tags, resume_run_id) -> None:
        try:
            import mlflow

            if resume_run_id:
                _quiet_http_retries()
                mlflow.set_tracking_uri(default_tracking_uri())
                run = mlflow.start_run(run_id=resume_run_id)
            else:
                run = start_mlflow_run(experiment, run_name, tags)
                mlflow.log_params(params)
            self._mlflow, self.run_id = mlflow, run.info.run_id
            (self.run_dir / "mlflow_run_id").write_text(self.run_id)
        except Exception as err:  # tracking must never stop training
            self._disable(err)

    def _disable(self, err: Exception) -> None:
        warnings.warn(f"MLflow tracking unavailable ({type(err).__name__}: {str(err)[:200]}); "
                      f"metrics continue in {self.metrics_path}; upload later with "
                      f"`repro tracking sync {self.run_dir}`", stacklevel=3)
        self._mlflow = None
        (self.run_dir / "tracking_unsynced").write_text(str(err)[:1000])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append to metrics.jsonl now; queue for MLflow, sent in batches every `FLUSH_SECONDS`
        (one request instead of one per step keeps tracking off the training step's hot path)."""
        from mlflow.entities import Metric

        clean = {clean_metric_name(k): float(v) for k, v in metrics.items() if v is not None}
        now = time.time()
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "time": now, **clean}) + "\n")
        if self._mlflow is not None:
            self._pending += [Metric(k, v, int(now * 1000), step) for k, v in clean.items()]
            if time.monotonic() - self._last_flush > self.FLUSH_SECONDS:
                self.flush()

    def flush(self) -> None:
        """Send the queued metrics to MLflow (no-op when tracking is off)."""
        if self._mlflow is not None and self._pending:
            try:
                send_metrics(self._mlflow.MlflowClient(), self.run_id, self._pending)
            except Exception as err:
                self._disable(err)
        self._pending, self._last_flush = [], time.monotonic()

    def log_artifact(self, path: str | Path) -> None:
        """Copy into run_dir/artifacts (kept for sync) and upload when MLflow is up."""
        path = Path(path)
        kept = self.run_dir / "artifacts" / path.name
        kept.parent.mkdir(exist_ok=True)
        if path.resolve() != kept.resolve():
            kept.write_bytes(path.read_bytes())
        if self._mlflow is not None:
            try:
                self._mlflow.log_artifact(str(kept))
            except Exception as err:
                self._disable(err)

    def close(self, status: str = "FINISHED") -> None:
        self.flush()
        if self._mlflow is not None:
            try:
                self._mlflow.end_run(status=status)
            except Exception as err:
                self._disable(err)

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type else "FINISHED")


def send_metrics(client, run_id: str, metrics: list, chunk: int = 1000) -> None:
    """Log Metric rows in batches of at most `chunk` (MLflow's per-request limit)."""
    for i in range(0, len(metrics), chunk):
        client.log_batch(run_id, metrics=metrics[i:i + chunk])


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every line of a run directory's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def sync_run(run_dir: str | Path) -> str:
    """Upload a run directory that was logged while MLflow was unreachable; returns the run id."""
    import mlflow
    from mlflow.entities import Metric

    run_dir = Path(run_dir)
    if not (run_dir / "params.json").exists():
        raise FileNotFoundError(f"{run_dir} has no params.json: give the run directory of `repro train`")
    params = json.loads((run_dir / "params.json").read_text())
    tags = json.loads((run_dir / "tags.json").read_text())
    experiment, run_name = tags.pop("experiment"), tags.pop("run_name")
    with start_mlflow_run(experiment, run_name, {**tags, "synced_from": str(run_dir)}) as run:
        mlflow.log_params(params)
        metrics = [Metric(clean_metric_name(k), float(v), int(row["time"] * 1000), row["step"])
                   for row in read_metrics(run_dir) for k, v in row.items() if k not in ("step", "time")]
        send_metrics(mlflow.MlflowClient(), run.info.run_id, metrics)
        if (run_dir / "artifacts").exists():
            mlflow.log_artifacts(str(run_dir / "artifacts"))
    (run_dir / "mlflow_run_id").write_text(run.info.run_id)
    (run_dir / "tracking_unsynced").unlink(missing_ok=True)
    return run.info.run_id

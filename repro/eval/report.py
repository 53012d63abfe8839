"""Evaluation output: a small table on stdout, a JSON record, and an MLflow run in "zero-shot".

The MLflow run carries the evaluation's own params (window, stride, strict, data sha256, checkpoint)
and is linked to the training run by the tag `training_run_id` (and `mlflow.parentRunId` when that
run is in the same tracking store, so the UI nests it).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from repro.tracking.store import all_runs

EXPERIMENT = "zero-shot"


@dataclass
class EvalRecord:
    """One evaluation's numbers and settings."""

    task: str
    metrics: dict[str, float]
    params: dict[str, str | int | float | bool]
    training_run_id: str | None = None
    paper: dict[str, float] = field(default_factory=dict)
    time: float | None = None  # when it was evaluated (unix seconds): the MLflow run's start time


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
    """Append the record as one JSON line (the copy that survives a tracking server outage), after
    cutting a killed write's partial last line, which the record would otherwise run on from. A failed
    append (a full disk) is cut back to the earlier records and raised as a UserError."""
    from repro.cli import UserError
    from repro.tracking.run_dir import drop_partial_line

    path.parent.mkdir(parents=True, exist_ok=True)
    line, size = json.dumps(record.__dict__, sort_keys=True) + "\n", None
    try:
        drop_partial_line(path)
        size = path.stat().st_size if path.exists() else 0
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line)
    except OSError as err:
        _cut_back(path, size)
        raise UserError(f"{path}: {err.strerror}: this evaluation's record (printed above) was not appended; the "
                        "earlier records are intact. Fix: free space there, or give --out on another disk, "
                        "then rerun the evaluation") from None


def _cut_back(path: Path, size: int | None) -> None:
    """Truncate `path` back to `size` bytes (what it held before a failed append), where known."""
    import os

    if size is None:
        return
    try:
        os.truncate(path, size)
    except OSError:
        pass


RECORDS_FIX = "Fix: give the zero_shot.jsonl that `repro eval` wrote, or delete that line"


def read_records(path: Path) -> list[EvalRecord]:
    """The records of a JSON-lines file written by `write_json`; a killed write's partial last line is
    skipped with a warning, any other bad line (not JSON, or not a record: _record_problem) and a file
    that cannot be read or is not UTF-8 are a TrackingError naming it, all before MLflow is contacted."""
    from repro.tracking.run_dir import TrackingError

    records, problem, partial = _scan_records(path, "Fix: give the zero_shot.jsonl that `repro eval` wrote")
    if problem:
        raise TrackingError(f"{problem}. {RECORDS_FIX}")
    if partial:
        warnings.warn(f"{path}: skipped a truncated last line (an append cut short)", stacklevel=2)
    return records


def check_appendable(path: Path, fix: str) -> None:
    """A TrackingError (naming `fix`) for a `path` that holds anything but evaluation records, which
    `write_json` would damage by cutting its 'unfinished' last line; nothing is changed. Absent, empty,
    or records with a killed write's partial last line after them: fine."""
    from repro.tracking.run_dir import TrackingError

    if not path.is_file():
        return
    records, problem, partial = _scan_records(path, fix)
    if problem is None and partial and not records:
        problem = f"{path} holds one unfinished line and no evaluation record"
    if problem:
        raise TrackingError(f"{path} is not a file of `repro eval` records ({problem}), and appending one would "
                            f"cut its last line. {fix}")


def _scan_records(path: Path, fix: str) -> tuple[list[EvalRecord], str | None, bool]:
    """(the records of `path`, what its first bad line is or None, whether its last line is an unfinished
    one that was skipped); a TrackingError naming `fix` for a file that cannot be read or is not UTF-8."""
    from repro.tracking.run_dir import read_text

    lines = read_text(path, fix).split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: an append that was cut short
                return records, None, True
            return records, f"{path}:{number} is not an evaluation record ({err})", False
        problem = _record_problem(row)
        if problem:
            return records, f"{path}:{number} is not an evaluation record: {problem}", False
        records.append(EvalRecord(**row))
    return records, None, False


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record_problem(row) -> str | None:
    """What makes a parsed line unusable as an EvalRecord (checked before any upload), or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    known = set(EvalRecord.__dataclass_fields__)
    missing, unknown = {"task", "metrics", "params"} - set(row), set(row) - known
    if missing or unknown:
        return ", ".join([f"lacks {', '.join(sorted(missing))}"] * bool(missing)
                         + [f"has unknown field(s) {', '.join(sorted(unknown))}"] * bool(unknown))
    if not isinstance(row["task"], str):
        return f"task {row['task']!r} is not a string"
    for name in ("metrics", "paper", "params"):
        value = row.get(name, {})
        if not isinstance(value, dict):
            return f"{name} is {json.dumps(value)}, not an object"
        check = _number if name != "params" else (lambda v: v is None or isinstance(v, (str, int, float, bool)))
        bad = [k for k, v in value.items() if not check(v)]
        if bad:
            kind = "a number" if name != "params" else "a string, number or boolean"
            return f"{name}: {', '.join(f'{k}={value[k]!r}' for k in bad)}, not {kind}"
    if row.get("training_run_id") is not None and not isinstance(row["training_run_id"], str):
        return f"training_run_id {row['training_run_id']!r} is not a string"
    if row.get("time") is not None and not _number(row["time"]):
        return f"time {row['time']!r} is not a number of seconds"
    return None


def _experiment_id(client) -> str:
    from repro.tracking.store import experiment_id

    return experiment_id(client, EXPERIMENT)


def _link_tags(client, training_run_id: str | None, experiment_id: str) -> dict[str, str]:
    if not training_run_id:
        return {}
    tags = {"training_run_id": training_run_id}
    try:
        parent = client.get_run(training_run_id)
    except Exception:  # the training run lives in another store: keep the id only
        return tags
    if parent.info.experiment_id == experiment_id:
        tags["mlflow.parentRunId"] = training_run_id
    return tags


def _mlflow_params(record: EvalRecord) -> dict[str, str]:
    return {k: str(v) for k, v in record.params.items()}


def _mlflow_metrics(record: EvalRecord) -> dict[str, float]:
    return {_metric_name(record.task, k): float(v) for k, v in record.metrics.items()}


def _log_record(client, experiment_id: str, record: EvalRecord) -> str:
    """One FINISHED run holding the record, started at the record's time; returns its id."""
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    started = int(record.time * 1000) if record.time else now
    tags = {"task": record.task, **_link_tags(client, record.training_run_id, experiment_id)}
    run_id = client.create_run(experiment_id, start_time=started, tags=tags, run_name=record.task).info.run_id
    client.log_batch(run_id, params=[Param(k, v) for k, v in _mlflow_params(record).items()],
                     metrics=[Metric(k, v, started, 0) for k, v in _mlflow_metrics(record).items()])
    client.set_terminated(run_id, "FINISHED", end_time=max(started, now))
    return run_id


def _logged_run_id(client, experiment_id: str, record: EvalRecord) -> str | None:
    """The run of the experiment holding this record (same task, params and metrics; NaN equals NaN,
    as a diverged model's perplexity): one linked to its training run, or one logged before that run
    existed (training offline, evaluation live), which is linked to it now."""
    params, metrics = _mlflow_params(record), _mlflow_metrics(record)
    for run in all_runs(client, [experiment_id], f"tags.task = '{record.task}'"):
        linked = run.data.tags.get("training_run_id")
        if linked not in (None, record.training_run_id) or not params.items() <= run.data.params.items():
            continue
        if all(_same_value(value, run.data.metrics.get(key)) for key, value in metrics.items()):
            if linked is None and record.training_run_id:
                for key, value in _link_tags(client, record.training_run_id, experiment_id).items():
                    client.set_tag(run.info.run_id, key, value)
            return run.info.run_id
    return None


def _same_value(ours: float, logged: float | None) -> bool:
    """Equal as MLflow keeps them: NaN equals NaN, and an infinite perplexity (an overflowing exp) is
    stored as the largest float of its sign."""
    if logged is None:
        return False
    if math.isinf(ours):
        ours = math.copysign(sys.float_info.max, ours)
    return ours == logged or (math.isnan(ours) and math.isnan(logged))


@contextmanager
def _tracking_errors(uri: str, retry: str):
    from mlflow.exceptions import MlflowException

    from repro.tracking.run_dir import TrackingError

    try:
        yield
    except (MlflowException, OSError) as err:
        raise TrackingError(f"logging to MLflow at {uri} failed: {str(err)[:300]}{retry}") from None


def _client(tracking_uri: str | None):
    from repro.tracking.store import default_tracking_uri, quiet_http_retries, tracking_client

    quiet_http_retries()
    uri = tracking_uri or default_tracking_uri()
    return tracking_client(uri), uri  # (a new sqlite store is created under its lock)


def log_to_mlflow(record: EvalRecord, tracking_uri: str | None = None) -> str:
    """Log the record as a run of the "zero-shot" experiment; returns the run id. An unreachable or
    failing store is a TrackingError naming the URI within seconds (one quick HTTP retry)."""
    client, uri = _client(tracking_uri)
    with _tracking_errors(uri, ""):
        return _log_record(client, _experiment_id(client), record)


@dataclass
class EvalSyncResult:
    """What `sync_records` did: runs created, records already in the store, the store."""

    created: list[str]
    already: int
    uri: str


def sync_records(path: Path, tracking_uri: str | None = None) -> EvalSyncResult:
    """Upload the evaluation records of a zero_shot.jsonl that the store lacks (after an outage, or
    an eval run with --no-mlflow). A record already there (same task, training run, params and
    metrics) is not logged again, so this is safe to repeat. A record without a training run (its
    training was not tracked then) takes the one its directory's `mlflow_run_id` names, if any."""
    from repro.tracking.run_dir import recorded_run_id

    records = read_records(path)  # the whole file is checked before MLflow is contacted
    for record in records:
        record.training_run_id = record.training_run_id or recorded_run_id(path.parent)
    client, uri = _client(tracking_uri)
    created, already = [], 0
    with _tracking_errors(uri, f". Fix: start the server or set MLFLOW_TRACKING_URI to a reachable store, "
                               f"then rerun `repro tracking sync {path}` (it never logs a record twice)"):
        experiment_id = _experiment_id(client)
        for record in records:
            if _logged_run_id(client, experiment_id, record):
                already += 1
            else:
                created.append(_log_record(client, experiment_id, record))
    return EvalSyncResult(created, already, uri)


def _metric_name(task: str, key: str) -> str:
    """`task/key`, cleaned as every logged metric name is (',' from lm-eval names -> '_')."""
    from repro.tracking.mlflow_run import clean_metric_name

    return clean_metric_name(f"{task}/{key}")

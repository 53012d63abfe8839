"""Run tracking: every metric goes to `<run_dir>/metrics.jsonl`, and to MLflow when it is reachable.

Only one rank (global rank 0) creates a RunLogger. If the tracking server is down at start or
fails later, training continues with a warning; `repro tracking sync RUN_DIR` uploads the run
directory (params.json, tags.json, metrics.jsonl, artifacts/) afterwards, losing nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from repro.tracking.store import default_tracking_uri, experiment_id, tracking_client, tracking_hint

RUN_ID_FILE = "mlflow_run_id"  # the MLflow run that holds this run directory's metrics
STOP_MARKER = "stopped_by_signal"  # the last launch stopped for a signal (launch.sh requeues the job)
STATUS_FILE = "run_status"  # the last launch ended FAILED or KILLED (close() writes it, MLflow up or not)
RESUMED_PARAM_TAG = "resumed_with."  # + a param key: its value since a resume changed it (params are fixed)
RUN_DIR_TAG = "run_dir"  # the run directory's absolute path: sync finds its run in a store again by it
SYNC_LOCK = ".sync.lock"  # held by `repro tracking sync RUN_DIR` (not by training): one sync of a directory at a time
SYNC_LOCK_SECONDS = 600.0  # the longest a sync waits for another sync of its directory


class TrackingError(RuntimeError):
    """A run directory or tracking store that cannot be used; the message names it and the fix."""


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    from repro.provenance import write_atomic

    write_atomic(path, data)


def recorded_run_id(run_dir: str | Path) -> str | None:
    """The MLflow run id named by `<run_dir>/mlflow_run_id` (written by the logger and by sync)."""
    path = Path(run_dir) / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


def drop_partial_line(path: Path) -> None:
    """Cut the unfinished last line a killed writer left in a JSON-lines file, so that the next append
    starts a whole line after it (metrics.jsonl on resume, zero_shot.jsonl before a new record). A last
    line that is whole JSON but lacks its newline (an editor's save) is kept, and the newline added."""
    data = path.read_bytes() if path.exists() else b""
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    with open(path, "r+b") as handle:
        if _is_json(data[cut:]):
            handle.seek(len(data))
            handle.write(b"\n")
            return
        warnings.warn(f"{path}: dropped an unfinished last line ({len(data) - cut} bytes) left by a "
                      "killed writer", stacklevel=3)
        handle.truncate(cut)


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:  # (JSONDecodeError and UnicodeDecodeError both are)
        return False
    return True


def quiet_http_retries() -> None:
    """Fail fast against an unreachable server instead of MLflow's minutes of retries."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


@contextmanager
def quiet_store_errors():
    """MLflow's sqlite store logs each failed request as an ERROR with its whole SQLAlchemy traceback
    (about 60 lines) before raising it; the logger warns once itself and retries, so inside this block
    those logs are dropped instead of flooding the training log."""
    store_log = logging.getLogger("mlflow.store")
    level = store_log.level
    store_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        store_log.setLevel(level)


def clean_metric_name(name: str) -> str:
    """MLflow rejects ',' in metric names (lm-eval's `acc,none`)."""
    return name.replace(",", "_")


class RunLogger:
    """JSONL always; MLflow best-effort. Use as a context manager around training."""

    FLUSH_SECONDS = 10.0
    RETRY_SECONDS = 120.0  # no MLflow request for this long after a failed one; doubled after each failed retry
    MAX_RETRY_SECONDS = 960.0  # (a store down for hours stalls a training step for its timeout this rarely)
    CLOSE_RETRY_SECONDS = 60.0  # close() retries this long (plus one request's timeout) for the run's final status

    def __init__(self, run_dir: str | Path, experiment: str, run_name: str,
                 params: dict[str, str], tags: dict[str, str], use_mlflow: bool = True,
                 resume_run_id: str | None = None, starts_over: bool = False,
                 replaces_run_id: str | None = None) -> None:
        """`starts_over`: this launch begins the run again (nothing to resume from): what an earlier
        launch left in the directory is moved aside, not mixed into this run's rows. `replaces_run_id`:
        an MLflow run set aside (set_aside_run_id), ended KILLED if still RUNNING once this one starts."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        for stale in (STOP_MARKER, STATUS_FILE):  # an earlier launch's stop or end, not this one's
            (self.run_dir / stale).unlink(missing_ok=True)
        earlier_run_id = _set_aside_earlier_launch(self.run_dir) if starts_over else replaces_run_id
        drop_partial_line(self.metrics_path)
        tags = {**tags, "experiment": experiment, "run_name": run_name}
        if not starts_over:
            params, tags = _resumed_launch(self.run_dir, params, tags)
        _write_text(self.run_dir / "params.json", json.dumps(params, indent=1, sort_keys=True))
        _write_text(self.run_dir / "tags.json", json.dumps(tags, indent=1))
        self.run_id: str | None = None
        self._client = None  # an MlflowClient while MLflow is reachable (no process-global active run)
        self._pending: list = []  # MLflow Metric rows not yet sent
        self._paused_until: float | None = None  # after a failed request: no MLflow until then
        self._failures = 0  # failed requests since MLflow last answered
        self._behind = False  # a request failed: the run lacks rows of metrics.jsonl until a catch-up
        self._unsent: list[Path] = []  # artifacts not uploaded yet (MLflow paused or failing)
        self.logged: dict[int, set[str]] = {}
        """step -> metrics an earlier launch logged at it (`resume_at`): a resumed run redoing the
        steps after its checkpoint logs only what they lack (the final evaluation a kill cut short)."""
        self._lacks_rows = False  # the MLflow run may lack rows of metrics.jsonl (see resume_at)
        if use_mlflow:
            self._start(params, tags, resume_run_id, earlier_run_id)
        self._last_flush = time.monotonic()  # (after _start: MLflow's import and store opening take seconds)

    def _start(self, params, tags, resume_run_id, earlier_run_id=None) -> None:
        """Reopen or create the MLflow run with the run directory's params and tags, as sync would."""
        try:
            quiet_http_retries()
            client = tracking_client(default_tracking_uri())
            resumed = _live_run(client, resume_run_id, self.run_dir, tags["experiment"])
            if resumed is not None:
                self.run_id = resumed.info.run_id
                self._lacks_rows = resumed.info.status == "RUNNING"  # its last launch was killed unclosed
                client.update_run(self.run_id, status="RUNNING")
                _log_param_changes(client, resumed, params, tags)
            else:
                self.run_id = _create_run(client, self.run_dir, tags).info.run_id
                self._lacks_rows = True  # any rows metrics.jsonl holds already: an earlier launch's
                _log_params(client, self.run_id, params)
                _end_dead_launch(client, earlier_run_id)
            self._client = client
            _write_text(self.run_dir / RUN_ID_FILE, self.run_id)
        except Exception as err:  # tracking must never stop training
            self._disable(err)

    def resume_at(self, iteration: int) -> None:
        """A launch resumed from its checkpoint at `iteration` redoes the steps after it: only what
        metrics.jsonl lacks of them is logged (`logged`). MLflow gets the rows its run lacks, as from
        `repro tracking sync`: those a hard-killed launch still had queued, or an offline one's."""
        rows = read_metrics(self.run_dir)
        self.logged = logged_metrics(rows, iteration)
        if self._lacks_rows and self._live():
            try:
                send_missing_metrics(self._client, self.run_id, rows)
            except Exception as err:
                self._pause(err)

    def _disable(self, err: Exception) -> None:
        """No run to log into (the store could not create or reopen it): metrics.jsonl only."""
        hint = tracking_hint(err, default_tracking_uri())
        warnings.warn(f"MLflow tracking unavailable ({type(err).__name__}: {str(err)[:200]}).{hint} Metrics "
                      f"continue in {self.metrics_path}; upload later with `repro tracking sync {self.run_dir}`",
                      stacklevel=3)
        self._client = None

    def _pause(self, err: Exception) -> None:
        """A request of a live run failed (a locked sqlite store, a server restart): no request for
        RETRY_SECONDS (doubled after each failed retry, up to MAX_RETRY_SECONDS); then, or at close(),
        MLflow gets every row of metrics.jsonl its run lacks (the queued ones included)."""
        pause = min(self.RETRY_SECONDS * 2 ** self._failures, self.MAX_RETRY_SECONDS)
        if self._paused_until is None:
            warnings.warn(f"MLflow request failed ({type(err).__name__}: {str(err)[:200]}); retrying in "
                          f"{pause:.0f} s. Rows go on into {self.metrics_path}; the run gets those it "
                          "lacks once MLflow answers again", stacklevel=3)
        self._paused_until, self._failures = time.monotonic() + pause, self._failures + 1
        self._pending, self._behind = [], True

    def _live(self) -> bool:
        return self._client is not None and (self._paused_until is None or time.monotonic() >= self._paused_until)

    def log_metrics(self, metrics: dict[str, float], step: int) -> bool:
        """Append to metrics.jsonl now; queue for MLflow, sent in batches every `FLUSH_SECONDS`
        (one request instead of one per step keeps tracking off the training step's hot path).
        Whether a row was written: not when an earlier launch logged all of them at `step` already."""
        held = self.logged.get(step, ())
        clean = {clean_metric_name(k): float(v) for k, v in metrics.items()
                 if v is not None and clean_metric_name(k) not in held}
        if not clean:
            return False
        now = time.time()
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "time": now, **clean}) + "\n")
        if self._live():
            from mlflow.entities import Metric  # imported only here: a run without MLflow skips its 2 s import

            self._pending += [Metric(k, v, int(now * 1000), step) for k, v in clean.items()]
            if time.monotonic() - self._last_flush > self.FLUSH_SECONDS:
                self.flush()
        return True

    def flush(self) -> None:
        """Send the queued metrics to MLflow, after a pause every row it lacks (no-op when tracking is
        off or paused)."""
        if self._live() and (self._pending or self._behind):
            try:
                with quiet_store_errors():
                    self._send()
            except Exception as err:
                self._pause(err)
        self._pending, self._last_flush = [], time.monotonic()

    def _send(self) -> None:
        """Send the queued rows; after a failed request, the rows of metrics.jsonl and the artifacts the
        run lacks instead (as `repro tracking sync` would). Ends a pause."""
        if self._behind:
            send_missing_metrics(self._client, self.run_id, read_metrics(self.run_dir))
            self._send_artifacts()
        else:
            send_metrics(self._client, self.run_id, self._pending)
        self._pending, self._behind, self._paused_until, self._failures = [], False, None, 0

    def _send_artifacts(self) -> None:
        while self._unsent:
            self._client.log_artifact(self.run_id, str(self._unsent[0]))
            self._unsent.pop(0)

    def log_artifact(self, path: str | Path) -> None:
        """Copy into run_dir/artifacts (kept for sync) and upload when MLflow is up."""
        path = Path(path)
        kept = self.run_dir / "artifacts" / path.name
        kept.parent.mkdir(exist_ok=True)
        if path.resolve() != kept.resolve():
            _write_bytes(kept, path.read_bytes())  # never a half copy for sync to upload
        if self._client is None:
            return
        self._unsent.append(kept)  # (uploaded after the pause, or by close(), when MLflow is paused now)
        if self._live():
            try:
                with quiet_store_errors():
                    self._send_artifacts()
            except Exception as err:
                self._pause(err)

    def close(self, status: str = "FINISHED") -> None:
        """Send what MLflow lacks and set the run's final status (tried even while paused: the status
        is what the analysis filters on; see _finish). A status other than FINISHED also goes to
        run_status in the run directory, for sync: MLflow may be off or down now."""
        try:
            if status == "FINISHED":
                (self.run_dir / STATUS_FILE).unlink(missing_ok=True)
            else:
                _write_text(self.run_dir / STATUS_FILE, status)
        except OSError as err:
            warnings.warn(f"could not record status {status} in {self.run_dir / STATUS_FILE}: {err}", stacklevel=2)
        if self._client is not None:
            self._finish(status)

    def _finish(self, status: str) -> None:
        """Send what the run lacks and set `status`, retried 1, 2, 4, .. 16 s apart while the store does
        not answer (a locked sqlite store, a server restart), for CLOSE_RETRY_SECONDS; then one warning
        with the sync that completes the run. A run stopped by a signal or failed tries once: Slurm's
        warning before a kill leaves time for the checkpoint, and the requeued launch catches up."""
        retry_s = self.CLOSE_RETRY_SECONDS if status == "FINISHED" else 0.0  # a stop signal's grace is the checkpoint's
        deadline, delay = time.monotonic() + retry_s, 1.0
        while True:
            try:
                with quiet_store_errors():
                    self._send()
                    self._client.set_terminated(self.run_id, status)
                return
            except Exception as err:
                self._behind = True  # (a batch may have failed halfway)
                if time.monotonic() + delay > deadline:
                    return self._give_up(err, status)
            time.sleep(delay)
            delay = min(2 * delay, 16.0)

    def _give_up(self, err: Exception, status: str) -> None:
        """close() could not complete the MLflow run: say what it lacks and the command that adds it."""
        hint = tracking_hint(err, default_tracking_uri())
        warnings.warn(f"MLflow did not answer at the end of the run "
                      f"({type(err).__name__}: {str(err)[:200]}).{hint} Its run {self.run_id} may lack rows of "
                      f"{self.metrics_path} and is left RUNNING, not {status}. Fix: once the store answers, run "
                      f"`repro tracking sync {self.run_dir}`", stacklevel=4)
        self._client = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type else "FINISHED")


def _set_aside_earlier_launch(run_dir: Path) -> str | None:
    """Rename an earlier launch's metrics.jsonl and mlflow_run_id with a time suffix: a run begun
    again (killed before its first checkpoint) must not have the dead launch's rows synced into it.
    Returns the earlier launch's MLflow run id, if it had one."""
    earlier, moved = recorded_run_id(run_dir), []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name in ("metrics.jsonl", RUN_ID_FILE):
        path = run_dir / name
        if path.is_file() and path.stat().st_size:
            path.rename(run_dir / f"{name}.before-{stamp}")
            moved.append(name)
    if moved:
        print(f"{run_dir}: this launch starts the run again (no checkpoint to resume from); the earlier "
              f"launch's {' and '.join(moved)} kept as *.before-{stamp}", flush=True)
    return earlier


def set_aside_rows_after(run_dir: Path, step: int) -> Path | None:
    """Keep metrics.jsonl's rows up to `step`; the whole earlier file goes to metrics.jsonl.before-TIME
    (returned; None if no row was after `step`). For a resume whose steps after its checkpoint are
    redone with other values (a new schedule): their rows replace the earlier launch's."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) == len(lines):
        return None
    aside = run_dir / f"metrics.jsonl.before-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.write_bytes(path.read_bytes())
    _write_text(path, "".join(kept))
    return aside


def set_aside_run_id(run_dir: Path) -> str | None:
    """Rename mlflow_run_id with a time suffix, so the next launch logs into a new MLflow run (which gets
    metrics.jsonl's rows): one whose steps past the run's new end cannot be taken out of the old run
    (MLflow deletes no metric value). Returns the id set aside."""
    earlier = recorded_run_id(run_dir)
    if earlier:
        (run_dir / RUN_ID_FILE).rename(run_dir / f"{RUN_ID_FILE}.before-{time.strftime('%Y%m%dT%H%M%S')}")
    return earlier


def set_aside_run_ids(run_dir: Path) -> set[str]:
    """The MLflow run ids of the launches set aside in `run_dir` (mlflow_run_id.before-*)."""
    return {p.read_text().strip() for p in Path(run_dir).glob(f"{RUN_ID_FILE}.before-*")}


def _row_step(line: str) -> float:
    """A metrics.jsonl line's step (inf for a line that is not a whole row: it goes with the later rows)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _live_run(client, run_id: str | None, run_dir: Path, experiment: str):
    """The run to resume into, or None: none named, or one deleted in the UI since (metrics logged
    into it would be invisible to the analysis), or one this store does not hold (the tracking URI
    changed between launches, or `mlflow gc` removed it), each with a warning and a new run instead.
    A run id of another store (a sync into it rewrote mlflow_run_id) resumes this directory's run
    here when the store has one (_run_of_dir)."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = _run_of_dir(client, run_dir, experiment)
        instead = f"resuming this directory's run {found.info.run_id} there" if found else "logging into a new run"
        warnings.warn(f"MLflow run {run_id} of this run directory is not in {default_tracking_uri()} (another "
                      f"store's, or garbage-collected): {instead}", stacklevel=3)
        return found
    if run.info.lifecycle_stage == "deleted":
        warnings.warn(f"MLflow run {run_id} of this run directory was deleted: logging into a new run",
                      stacklevel=3)
        return None
    return run


def _end_dead_launch(client, run_id: str | None) -> bool:
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


def _resumed_launch(run_dir: Path, params: dict, tags: dict) -> tuple[dict, dict]:
    """params.json and tags.json of a resumed launch, as its MLflow run holds them: the first launch's
    values kept (MLflow never changes a logged param), a param this launch changed (another layout, a
    raised train.train_iters) in the tag resumed_with.KEY, new params added."""
    earlier, earlier_tags = _json_or_empty(run_dir / "params.json"), _json_or_empty(run_dir / "tags.json")
    changed = {RESUMED_PARAM_TAG + k: str(v) for k, v in params.items()
               if k in earlier and str(v) != str(earlier_tags.get(RESUMED_PARAM_TAG + k, earlier[k]))}
    return {**params, **earlier}, {**tags, **earlier_tags, **changed}


def _json_or_empty(path: Path) -> dict:
    """A JSON object file's content; {} for one missing or unreadable (a new run's)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _log_param_changes(client, run, params: dict, tags: dict) -> bool:
    """Log the params (params.json) the run lacks; a param's value since a resume changed it (tags.json's
    resumed_with.KEY, or params.json's where the run holds another) goes in the tag resumed_with.KEY, as
    MLflow never changes a logged param (the analysis reads it). Whether anything was sent."""
    held = run.data.params
    new = {k: v for k, v in params.items() if k not in held}
    now = {k: str(tags.get(RESUMED_PARAM_TAG + k, v)) for k, v in params.items() if k in held}
    changed = {k: v for k, v in now.items() if v != _param_now(run, k)}
    _log_params(client, run.info.run_id, new)
    for key, value in changed.items():
        client.set_tag(run.info.run_id, RESUMED_PARAM_TAG + key, value)
    return bool(new or changed)


def _param_now(run, key: str) -> str | None:
    """A param's value as the analysis reads it: a resume's change (tag) over the logged value."""
    return run.data.tags.get(RESUMED_PARAM_TAG + key, run.data.params.get(key))


def _log_params(client, run_id: str, params: dict) -> None:
    """Log params in batches of 100 (MLflow's per-request limit)."""
    from mlflow.entities import Param

    rows = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(rows), 100):
        client.log_batch(run_id, params=rows[i:i + 100])


def send_metrics(client, run_id: str, metrics: list, chunk: int = 1000) -> None:
    """Log Metric rows in batches of at most `chunk` (MLflow's per-request limit)."""
    for i in range(0, len(metrics), chunk):
        client.log_batch(run_id, metrics=metrics[i:i + chunk])


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run directory's metrics.jsonl ([] without one). A truncated last line (what a
    killed run leaves) is skipped with a warning; a bad line before it is a TrackingError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if n != lines[-1][0]:
                raise TrackingError(f"{path}:{n} is not JSON ({err}). Fix: delete or repair that line; "
                                    "every line must be one JSON object") from None
            warnings.warn(f"{path}:{n}: skipped a truncated last line (the run was killed while "
                          "writing it)", stacklevel=2)
            continue
        problem = _row_problem(row)
        if problem:
            raise TrackingError(f"{path}:{n} {problem}. Fix: delete or repair that line; every line is one "
                                'object like {"step": 10, "time": 1733300000.0, "loss": 7.1}')
        rows.append(row)
    return rows


def _row_problem(row) -> str | None:
    """What makes a metrics.jsonl row unusable (checked before any upload), or None."""
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object"
    number = (int, float)
    if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return f"has step {row.get('step')!r}, not an integer"
    if not isinstance(row.get("time"), number):
        return f"has time {row.get('time')!r}, not a number of seconds"
    bad = [k for k, v in row.items() if k not in ("step", "time") and not isinstance(v, number)]
    return f"has non-numeric value(s) for {', '.join(bad)}" if bad else None


def logged_metrics(rows: list[dict], first_step: int) -> dict[int, set[str]]:
    """step -> the metric names metrics.jsonl's `rows` hold at it, for the steps from first_step on."""
    logged: dict[int, set[str]] = {}
    for row in rows:
        if row.get("step", -1) >= first_step:
            logged.setdefault(row["step"], set()).update(k for k in row if k not in ("step", "time"))
    return logged


@dataclass(frozen=True)
class SyncResult:
    """What `sync_run` did: `created` a run, `updated` the named one, or found it `up to date` (it
    lacked nothing)."""

    run_id: str
    action: str
    metrics_sent: int
    uri: str
    note: str = ""


def _load_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise TrackingError(f"{path} is missing: it holds the run's {what}. Fix: give the run directory "
                            "written by `repro train` (params.json, tags.json, metrics.jsonl)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TrackingError(f"{path} is not valid JSON ({err}). Fix: restore it from the run's "
                            "artifacts/ or rerun `repro train` in that directory") from None


def _read_run_dir(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    """params, tags and metric rows, all checked before MLflow is contacted."""
    if not run_dir.is_dir():
        raise TrackingError(f"{run_dir} is not a directory: give the run directory of `repro train`")
    params = _load_json(run_dir / "params.json", "parameters")
    tags = _load_json(run_dir / "tags.json", "experiment and run name")
    missing = [k for k in ("experiment", "run_name") if k not in tags]
    if missing:
        raise TrackingError(f"{run_dir / 'tags.json'} lacks {', '.join(missing)}. Fix: add them, e.g. "
                            '{"experiment": "scaling", "run_name": "scale_1b"}')
    if not (run_dir / "metrics.jsonl").is_file():
        raise TrackingError(f"{run_dir / 'metrics.jsonl'} is missing: there are no metrics to upload. "
                            "Fix: give a run directory whose training logged at least one step")
    rows = read_metrics(run_dir)
    if not rows:
        raise TrackingError(f"{run_dir / 'metrics.jsonl'} holds no metrics: nothing to upload")
    return params, tags, rows


@contextmanager
def _tracking_errors(uri: str, run_dir: Path):
    """MLflow and connection failures as a TrackingError naming the store and the retry."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, OSError) as err:
        raise TrackingError(f"MLflow tracking store {uri} failed: {str(err)[:300]}. Fix: start the "
                            "server or set MLFLOW_TRACKING_URI to a reachable store, then rerun "
                            f"`repro tracking sync {run_dir}` (it does not upload a row twice)") from None


def _existing_run(client, run_id: str | None):
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


def _create_run(client, run_dir: Path, tags: dict, **extra: str):
    """A new run with tags.json's tags (and `extra`); its id is recorded first, so a broken sync
    resumes into it."""
    rest = {k: str(v) for k, v in tags.items() if k not in ("experiment", "run_name")}
    run = client.create_run(experiment_id(client, tags["experiment"]), run_name=tags["run_name"],
                            tags={**rest, **extra, RUN_DIR_TAG: str(run_dir.resolve())})
    _write_text(run_dir / RUN_ID_FILE, run.info.run_id)
    return run


def _run_of_dir(client, run_dir: Path, experiment: str):
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


def _metric_rows(rows: list[dict]) -> list:
    from mlflow.entities import Metric

    return [Metric(clean_metric_name(k), float(v), int(row["time"] * 1000), row["step"])
            for row in rows for k, v in row.items() if k not in ("step", "time")]


def _missing_artifacts(client, run_id: str, run_dir: Path) -> list[Path]:
    """Files and folders of run_dir/artifacts the run lacks, or holds at another size (rewritten)."""
    folder = run_dir / "artifacts"
    if not folder.is_dir():
        return []
    held = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    return [p for p in sorted(folder.iterdir())
            if p.name not in held or (p.is_file() and held[p.name] != p.stat().st_size)]


def send_missing_metrics(client, run_id: str, rows: list[dict]) -> int:
    """Log the metric rows (a row = key, step, timestamp) of metrics.jsonl's `rows` the run lacks;
    how many were sent."""
    metrics = _metric_rows(rows)
    logged = {(m.key, m.step, m.timestamp) for key in {m.key for m in metrics}
              for m in client.get_metric_history(run_id, key)}
    new = [m for m in metrics if (m.key, m.step, m.timestamp) not in logged]
    send_metrics(client, run_id, new)
    return len(new)


def _upload(client, run, run_dir: Path, params: dict, tags: dict, rows: list[dict]) -> tuple[int, bool]:
    """Log the params and resume tags, metric rows and artifacts the run lacks: (metric values sent,
    whether anything was)."""
    run_id = run.info.run_id
    new_params = _log_param_changes(client, run, params, tags)
    sent = send_missing_metrics(client, run_id, rows)
    artifacts = _missing_artifacts(client, run_id, run_dir)
    for path in artifacts:
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=path.name)
        else:
            client.log_artifact(run_id, str(path))
    status = run_dir_status(run_dir, rows)
    ended = _end_iteration(run_dir)
    if status is None and run.info.status == "FINISHED" and ended is not None and _rows_after(rows, ended):
        status = "KILLED"  # extended past its end, and that launch ended without a word (a live one is RUNNING)
    finish = status is not None and run.info.status != status
    if finish:
        client.set_terminated(run_id, status)
    return sent, bool(new_params or sent or artifacts or finish)


def run_dir_status(run_dir: Path, rows: list[dict] = ()) -> str | None:
    """The status a run directory shows: KILLED when its last piece stopped for a signal
    (stopped_by_signal); FAILED or KILLED as its last launch's close() recorded it (run_status);
    FINISHED when its end was written (a training run's final_metrics.json from its last logged step,
    not an earlier end of a run extended since; RACE's results.json); else None: still running, or
    killed without a word (the store's status is then left as it is, but for FINISHED: see _upload)."""
    if (run_dir / STOP_MARKER).is_file():
        return "KILLED"
    try:
        recorded = (run_dir / STATUS_FILE).read_text().strip()
    except OSError:
        recorded = ""
    if recorded in ("FAILED", "KILLED"):
        return recorded
    if (run_dir / "results.json").is_file():
        return "FINISHED"
    ended = _end_iteration(run_dir)
    return None if ended is None or _rows_after(rows, ended) else "FINISHED"


def _end_iteration(run_dir: Path) -> int | None:
    """The iteration final_metrics.json was written at, or None without a readable one."""
    try:
        return int(json.loads((run_dir / "final_metrics.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rows_after(rows: list[dict], ended: int) -> bool:
    """Whether metrics.jsonl has rows after final_metrics.json's iteration (a run extended since)."""
    return any(row.get("step", 0) > ended for row in rows)


@contextmanager
def _sync_lock(run_dir: Path):
    """Hold RUN_DIR/.sync.lock: two syncs of a directory at once (two shells, a cron sync overlapping a
    manual one) each found no run and created one. A training run does not take it (sync while it runs)."""
    from repro import run_lock

    path = run_dir / SYNC_LOCK
    try:
        held = run_lock.acquire(path, wait_s=SYNC_LOCK_SECONDS)  # (removed again on release)
    except run_lock.LockHeld as other:
        raise TrackingError(f"another `repro tracking sync {run_dir}` still runs after {SYNC_LOCK_SECONDS:.0f} s "
                            f"({other.holder}). Fix: wait for it to end, then sync again") from None
    except OSError:  # a directory this user may only read (a colleague's run): it cannot record a run id
        held = None  # either, so there is nothing for a lock to keep consistent
    try:
        yield
    finally:
        run_lock.release(held)


def sync_run(run_dir: str | Path) -> SyncResult:
    """Upload what MLflow lacks of a run directory: one logged while MLflow was unreachable or with
    tracking off, whose logger was killed with metrics still queued, or that was synced while it trained.

    Safe to repeat, and never a duplicate: the directory's run in the store is the one `mlflow_run_id`
    names, else (that id is another store's: a sync into another store rewrote it) the one tagged with
    this directory (_run_of_dir), whose id is written back to `mlflow_run_id`. It is compared with the
    directory every time, and only the params, metric rows and artifacts it lacks are logged into it (a
    resumed run keeps one MLflow run); `up to date` when it lacks nothing. Without one a new run is
    created and its id written to `mlflow_run_id` before the upload, so an interrupted sync resumes
    into it. The run directory is read and checked completely before MLflow is contacted."""
    run_dir = Path(run_dir)
    params, tags, rows = _read_run_dir(run_dir)
    uri = default_tracking_uri()
    quiet_http_retries()
    with _sync_lock(run_dir), _tracking_errors(uri, run_dir):
        named = recorded_run_id(run_dir)  # read under the lock: a sync that held it may have created the run
        client = tracking_client(uri)
        run, note = _existing_run(client, named), ""
        if named and run is None:  # (without an id, its tagged runs are launches set aside: begun again offline)
            run = _run_of_dir(client, run_dir, tags["experiment"])
            instead = f"syncing into this directory's run {run.info.run_id} there" if run else "uploading as a new run"
            note = f"{RUN_ID_FILE} named run {named}, which {uri} does not hold; {instead}"
            if run is not None:
                _write_text(run_dir / RUN_ID_FILE, run.info.run_id)
        action = "updated" if run is not None else "created"
        run = run or _create_run(client, run_dir, tags, synced_from=str(run_dir.resolve()))
        sent, changed = _upload(client, client.get_run(run.info.run_id), run_dir, params, tags, rows)
        ended = [i for i in sorted({p.read_text().strip() for p in run_dir.glob(f"{RUN_ID_FILE}.before-*")})
                 if i and i != run.info.run_id and _end_dead_launch(client, i)]
        if ended:  # launches set aside whose restart ran without MLflow: nothing else ends them
            note = "; ".join(filter(None, [note, f"ended the dead launch run(s) {', '.join(ended)} KILLED"]))
    return SyncResult(run.info.run_id, action if changed or action == "created" else "up to date", sent, uri, note)

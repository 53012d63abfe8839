"""Run tracking: every metric goes to `<run_dir>/metrics.jsonl`, and to MLflow when it is reachable.

Only one rank (global rank 0) creates a RunLogger. If the tracking server is down at start or
fails later, training continues with a warning; `repro tracking sync RUN_DIR` (repro/tracking/sync.py)
uploads the run directory (params.json, tags.json, metrics.jsonl, artifacts/) afterwards, losing nothing.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from repro.tracking.mlflow_run import (clean_metric_name, create_run, end_dead_launch, live_run, log_param_changes,
                                       log_params, metrics_past_latest, rows_past_latest, send_metrics)
from repro.tracking.run_dir import (RUN_ID_FILE, STATUS_FILE, STOP_MARKER, drop_partial_line, logged_metrics,
                                    read_metrics, resumed_launch, set_aside_earlier_launch, write_bytes, write_text)
from repro.tracking.store import (default_tracking_uri, quiet_http_retries, quiet_store_errors, tracking_client,
                                  tracking_hint)


class RunLogger:
    """JSONL always; MLflow best-effort. Use as a context manager around training."""

    FLUSH_SECONDS = 10.0
    RETRY_SECONDS = 120.0  # no MLflow request for this long after a failed one; doubled after each failed retry
    MAX_RETRY_SECONDS = 960.0  # (a store down for hours stalls a training step for its timeout this rarely)
    CLOSE_RETRY_SECONDS = 60.0  # close() retries this long (plus one request's timeout) for the run's final status
    MAX_CATCH_UP_VALUES = 200_000  # a resume sends at most this many values the run lacks (~30 s on sqlite); more
    # (an offline launch's rows) are left to `repro tracking sync`, while the other ranks wait in a collective

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
        earlier_run_id = set_aside_earlier_launch(self.run_dir) if starts_over else replaces_run_id
        drop_partial_line(self.metrics_path)
        tags = {**tags, "experiment": experiment, "run_name": run_name}
        if not starts_over:
            params, tags = resumed_launch(self.run_dir, params, tags)
        write_text(self.run_dir / "params.json", json.dumps(params, indent=1, sort_keys=True))
        write_text(self.run_dir / "tags.json", json.dumps(tags, indent=1))
        self.run_id: str | None = None
        self._client = None  # an MlflowClient while MLflow is reachable (no process-global active run)
        self._pending: list = []  # MLflow Metric rows not yet sent (kept through a pause)
        self._paused_until: float | None = None  # after a failed request: no MLflow until then
        self._failures = 0  # failed requests since MLflow last answered
        self._behind = False  # a request failed: the run may hold the first of _pending already
        self._reread = False  # a catch-up from metrics.jsonl failed: the next one reads it again
        self._unsent: list[Path] = []  # artifacts not uploaded yet (MLflow paused or failing)
        self.logged: dict[int, set[str]] = {}
        """step -> metrics an earlier launch logged at it (`resume_at`): a resumed run redoing the
        steps after its checkpoint logs only what they lack (the final evaluation a kill cut short)."""
        if use_mlflow:
            self._start(params, tags, resume_run_id, earlier_run_id)
        self._last_flush = time.monotonic()  # (after _start: MLflow's import and store opening take seconds)

    def _start(self, params, tags, resume_run_id, earlier_run_id=None) -> None:
        """Reopen or create the MLflow run with the run directory's params and tags, as sync would."""
        try:
            quiet_http_retries()
            client = tracking_client(default_tracking_uri())
            resumed = live_run(client, resume_run_id, self.run_dir, tags["experiment"])
            if resumed is not None:
                self.run_id = resumed.info.run_id
                client.update_run(self.run_id, status="RUNNING")
                log_param_changes(client, resumed, params, tags)
            else:
                self.run_id = create_run(client, self.run_dir, tags).info.run_id
                log_params(client, self.run_id, params)
                end_dead_launch(client, earlier_run_id)
            self._client = client
            write_text(self.run_dir / RUN_ID_FILE, self.run_id)
        except Exception as err:  # tracking must never stop training
            self._disable(err)

    def resume_at(self, iteration: int) -> None:
        """A launch resumed from its checkpoint at `iteration` redoes the steps after it: only what
        metrics.jsonl lacks of them is logged (`logged`). MLflow gets the rows its run lacks (catch_up)."""
        rows = read_metrics(self.run_dir)
        self.logged = logged_metrics(rows, iteration)
        self.catch_up(rows)

    def catch_up(self, rows: list[dict] | None = None) -> None:
        """Send the rows of metrics.jsonl (or `rows`, read from it) the MLflow run lacks: those a
        hard-killed launch still had queued, or an offline one's (rows_past_latest). More than
        MAX_CATCH_UP_VALUES are left to `repro tracking sync`, with a warning; a failed request pauses
        MLflow, and the catch-up after the pause reads metrics.jsonl again."""
        if not self._live():
            self._reread = self._client is not None
            return
        try:
            with quiet_store_errors():
                self._send_rows_of_file(read_metrics(self.run_dir) if rows is None else rows)
        except Exception as err:
            self._reread = True
            self._pause(err)

    def _send_rows_of_file(self, rows: list[dict]) -> None:
        missing = rows_past_latest(self._client, self.run_id, rows)
        if len(missing) > self.MAX_CATCH_UP_VALUES:
            warnings.warn(f"MLflow run {self.run_id} lacks {len(missing):,} values of {self.metrics_path} (logged "
                          "while MLflow was off or unreachable); sending them now would hold up training. Fix: "
                          f"`repro tracking sync {self.run_dir}` uploads them (it adds only what the run lacks)",
                          stacklevel=4)
        else:
            send_metrics(self._client, self.run_id, missing)
        self._reread = False

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
        self._behind = True

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
        if self._client is not None:  # queued while MLflow is paused too (sent with the catch-up)
            from mlflow.entities import Metric  # imported only here: a run without MLflow skips its 2 s import

            self._pending += [Metric(k, v, int(now * 1000), step) for k, v in clean.items()]
            if self._live() and time.monotonic() - self._last_flush > self.FLUSH_SECONDS:
                self.flush()
            elif len(self._pending) > self.MAX_CATCH_UP_VALUES:
                self._drop_backlog()
        return True

    def _drop_backlog(self) -> None:
        """MLflow paused for more values than a catch-up sends: they stay in metrics.jsonl only, for
        `repro tracking sync` (holding them would grow this process's memory for as long as the store
        is down); the rows after them still reach the run once the store answers."""
        warnings.warn(f"MLflow has not answered for {len(self._pending):,} values: they stay in {self.metrics_path} "
                      f"only. Fix: once the store answers, `repro tracking sync {self.run_dir}` uploads them (it adds "
                      "only what the run lacks)", stacklevel=3)
        self._pending = []

    def flush(self) -> None:
        """Send the queued metrics to MLflow, after a pause every row it lacks (no-op when tracking is
        off or paused)."""
        if self._live() and (self._pending or self._behind):
            try:
                with quiet_store_errors():
                    self._send()
            except Exception as err:
                self._pause(err)
        self._last_flush = time.monotonic()

    def _send(self) -> None:
        """Send the queued rows; after a failed request, those of them the run lacks (a failed request
        may have reached the store: metrics_past_latest), or of metrics.jsonl after a failed catch_up,
        and the params (of log_params) and artifacts it lacks. Ends a pause."""
        if self._behind:
            if self._reread:  # metrics.jsonl holds the queued rows too
                self._send_rows_of_file(read_metrics(self.run_dir))
            else:
                send_metrics(self._client, self.run_id, metrics_past_latest(self._client, self.run_id, self._pending))
            self._send_param_changes()
            self._send_artifacts()
        else:
            send_metrics(self._client, self.run_id, self._pending)
        self._pending, self._behind, self._paused_until, self._failures = [], False, None, 0

    def _send_param_changes(self) -> None:
        """params.json and tags.json's resumed_with.KEY tags, where the run lacks them."""
        params, tags = resumed_launch(self.run_dir, {}, {})
        log_param_changes(self._client, self._client.get_run(self.run_id), params, tags)

    def _send_artifacts(self) -> None:
        while self._unsent:
            self._client.log_artifact(self.run_id, str(self._unsent[0]))
            self._unsent.pop(0)

    def log_params(self, params: dict[str, str]) -> None:
        """Params known only once the work is done (RACE's median seed): into params.json (what sync
        uploads) and the MLflow run. One an earlier launch logged with another value keeps it, the new
        value in the tag resumed_with.KEY, as at a resume (run_dir.resumed_launch)."""
        params, tags = resumed_launch(self.run_dir, params, {})
        write_text(self.run_dir / "params.json", json.dumps(params, indent=1, sort_keys=True))
        write_text(self.run_dir / "tags.json", json.dumps(tags, indent=1))
        if not self._live():  # off (sync uploads params.json), or paused: sent with the catch-up (_send)
            return
        try:
            with quiet_store_errors():
                self._send_param_changes()
        except Exception as err:  # tracking must never stop the work
            self._pause(err)

    def log_artifact(self, path: str | Path) -> None:
        """Copy into run_dir/artifacts (kept for sync) and upload when MLflow is up."""
        path = Path(path)
        kept = self.run_dir / "artifacts" / path.name
        kept.parent.mkdir(exist_ok=True)
        if path.resolve() != kept.resolve():
            write_bytes(kept, path.read_bytes())  # never a half copy for sync to upload
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
                write_text(self.run_dir / STATUS_FILE, status)
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

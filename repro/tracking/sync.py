"""`repro tracking sync RUN_DIR`: upload what the MLflow run of a run directory lacks (one logged while
MLflow was unreachable or with tracking off, or killed with rows still queued), never a row twice."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from repro.tracking.mlflow_run import (create_run, end_dead_launch, existing_run, log_param_changes, run_of_dir,
                                       send_missing_metrics)
from repro.tracking.run_dir import (RUN_ID_FILE, TrackingError, end_iteration, read_run_dir, recorded_run_id,
                                    rows_after, run_dir_status, write_text)
from repro.tracking.store import default_tracking_uri, quiet_http_retries, tracking_client

SYNC_LOCK = ".sync.lock"  # held by `repro tracking sync RUN_DIR` (not by training): one sync of a directory at a time
SYNC_LOCK_SECONDS = 600.0  # the longest a sync waits for another sync of its directory


@dataclass(frozen=True)
class SyncResult:
    """What `sync_run` did: `created` a run, `updated` the named one, or found it `up to date` (it
    lacked nothing)."""

    run_id: str
    action: str
    metrics_sent: int
    uri: str
    note: str = ""


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


def check_store(uri: str | None = None) -> str:
    """The tracking URI (default: MLFLOW_TRACKING_URI's), checked before any work as `repro report` checks
    it (repro.analysis.runs): a TrackingError for a plain path, an unknown scheme, or a sqlite file that is
    not an MLflow store. An absent sqlite file is fine where MLflow can create it: one under a file, or in
    a directory this process cannot write, is refused too (it would fail only after the work)."""
    from repro.analysis.runs import StoreError, check_sqlite_store, check_uri, store_exists

    uri = uri or default_tracking_uri()
    try:
        check_uri(uri)
        if store_exists(uri):
            check_sqlite_store(uri)
    except StoreError as err:
        raise TrackingError(str(err)) from None
    _check_creatable(uri)
    return uri


def _check_creatable(uri: str) -> None:
    """A TrackingError for a sqlite URI whose absent file could not be created: a file where a folder on
    its path should be, or an ancestor this process cannot write."""
    from repro.provenance import file_in_the_way, unwritable_ancestor

    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri[len("sqlite:///"):].split("?", 1)[0])
    if str(db) in ("", ":memory:") or db.exists():
        return
    fix = "Fix: point MLFLOW_TRACKING_URI at sqlite:///PATH/mlflow.db in a writable directory, or http://HOST:PORT"
    if (blocked := file_in_the_way(db.parent)) is not None:
        raise TrackingError(f"tracking URI {uri}: {blocked} is a file, not a directory, so the store cannot be "
                            f"created. {fix}")
    if (blocked := unwritable_ancestor(db)) is not None:
        raise TrackingError(f"tracking URI {uri}: {blocked} is not writable, so the store cannot be created. {fix}")


def _missing_artifacts(client, run_id: str, run_dir: Path) -> list[Path]:
    """Files and folders of run_dir/artifacts the run lacks, or holds at another size (rewritten)."""
    folder = run_dir / "artifacts"
    if not folder.is_dir():
        return []
    held = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    return [p for p in sorted(folder.iterdir())
            if p.name not in held or (p.is_file() and held[p.name] != p.stat().st_size)]


PROGRESS_DELAY_S = 1.0  # a sync shorter than this shows no bar (most are: a few rows, or nothing to send)


def _metric_progress():
    """A progress bar on stderr over the metric values an upload sends, shown once it has taken
    PROGRESS_DELAY_S (120k values take ~10 s to a sqlite store)."""
    from tqdm import tqdm

    return tqdm(desc="sync metrics", unit=" values", delay=PROGRESS_DELAY_S)


def _upload(client, run, run_dir: Path, params: dict, tags: dict, rows: list[dict]) -> tuple[int, bool]:
    """Log the params and resume tags, metric rows and artifacts the run lacks: (metric values sent,
    whether anything was)."""
    run_id = run.info.run_id
    new_params = log_param_changes(client, run, params, tags)
    with _metric_progress() as bar:
        sent = send_missing_metrics(client, run_id, rows, progress=bar)
    artifacts = _missing_artifacts(client, run_id, run_dir)
    for path in artifacts:
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=path.name)
        else:
            client.log_artifact(run_id, str(path))
    status = run_dir_status(run_dir, rows)
    ended = end_iteration(run_dir)
    if status is None and run.info.status == "FINISHED" and ended is not None and rows_after(rows, ended):
        status = "KILLED"  # extended past its end, and that launch ended without a word (a live one is RUNNING)
    finish = status is not None and run.info.status != status
    if finish:
        client.set_terminated(run_id, status)
    return sent, bool(new_params or sent or artifacts or finish)


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
    this directory (run_of_dir), whose id is written back to `mlflow_run_id`. It is compared with the
    directory every time, and only the params, metric rows and artifacts it lacks are logged into it (a
    resumed run keeps one MLflow run); `up to date` when it lacks nothing. Without one a new run is
    created and its id written to `mlflow_run_id` before the upload, so an interrupted sync resumes
    into it. The run directory is read and checked completely before MLflow is contacted."""
    run_dir = Path(run_dir)
    params, tags, rows = read_run_dir(run_dir)
    uri = default_tracking_uri()
    quiet_http_retries()
    with _sync_lock(run_dir), _tracking_errors(uri, run_dir):
        named = recorded_run_id(run_dir)  # read under the lock: a sync that held it may have created the run
        client = tracking_client(uri)
        run, note = existing_run(client, named), ""
        if named and run is None:  # (without an id, its tagged runs are launches set aside: begun again offline)
            run = run_of_dir(client, run_dir, tags["experiment"])
            instead = f"syncing into this directory's run {run.info.run_id} there" if run else "uploading as a new run"
            note = f"{RUN_ID_FILE} named run {named}, which {uri} does not hold; {instead}"
            if run is not None:
                write_text(run_dir / RUN_ID_FILE, run.info.run_id)
        action = "updated" if run is not None else "created"
        run = run or create_run(client, run_dir, tags, synced_from=str(run_dir.resolve()))
        sent, changed = _upload(client, client.get_run(run.info.run_id), run_dir, params, tags, rows)
        ended = [i for i in sorted({p.read_text().strip() for p in run_dir.glob(f"{RUN_ID_FILE}.before-*")})
                 if i and i != run.info.run_id and end_dead_launch(client, i)]
        if ended:  # launches set aside whose restart ran without MLflow: nothing else ends them
            note = "; ".join(filter(None, [note, f"ended the dead launch run(s) {', '.join(ended)} KILLED"]))
    return SyncResult(run.info.run_id, action if changed or action == "created" else "up to date", sent, uri, note)

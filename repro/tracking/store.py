"""Where runs are tracked: MLFLOW_TRACKING_URI (or the cluster settings' one), else an embedded sqlite store."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STORE_LOCK_SECONDS = 120.0  # the longest a job waits for another to create or open a new sqlite store


def project_root() -> Path:
    """The directory holding pyproject.toml (the repository), or the current directory."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return Path.cwd()


def default_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI; else the one the cluster settings give the Slurm jobs (slurm/cluster.env,
    or the file REPRO_CLUSTER_ENV names), so `repro report` and `repro tracking sync` on a login node
    read the jobs' store; else `sqlite:///<repo>/mlruns/mlflow.db` (artifacts in mlruns/artifacts)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cluster_env_tracking_uri()
    if uri:
        return uri
    store = project_root() / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def cluster_env_tracking_uri() -> str | None:
    """MLFLOW_TRACKING_URI as the cluster settings file sets it for the jobs (None: no file, or none set;
    a file that does not source is launch.sh's error to report, not tracking's)."""
    named = os.environ.get("REPRO_CLUSTER_ENV")
    path = Path(named) if named else project_root() / "slurm" / "cluster.env"
    if not path.is_file():
        return None
    from repro.launch.scripts import ClusterEnvError, cluster_settings

    try:
        return cluster_settings(path).get("MLFLOW_TRACKING_URI") or None
    except ClusterEnvError:
        return None


def tracking_hint(err: Exception, uri: str) -> str:
    """The fix for a tracking failure whose cause is known ('' otherwise). MLflow 3's server accepts
    only localhost and private IP addresses in the Host header unless told others: a compute node
    that names the login node (http://login01:5000) is refused with 403 "Invalid Host header". A
    server with authentication answers 401 without credentials."""
    from urllib.parse import urlsplit

    text = str(err)
    if "Invalid Host header" in text:
        netloc = urlsplit(uri).netloc
        return (f" The server refuses the host name in MLFLOW_TRACKING_URI={uri}: start it with "
                f"`mlflow server --allowed-hosts {netloc} ...` (MLflow 3 allows only localhost and private IP "
                "addresses unless told), or name it by its IP address.")
    if "error code 401" in text:
        given = "were refused" if os.environ.get("MLFLOW_TRACKING_USERNAME") else "are not set"
        return (f" The server wants credentials, and MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD {given}: "
                "put them in ~/.mlflow/credentials (mlflow_tracking_username = ..., mlflow_tracking_password "
                "= ...; every node reads it from a shared home) or export them, or MLFLOW_TRACKING_TOKEN.")
    return ""


def probe_tracking_server(uri: str) -> str | None:
    """None when `uri` is not a server or answers a search; else what went wrong and how to fix it,
    for a warning before the ranks start (training goes on without it, into metrics.jsonl)."""
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    quiet_http_retries()
    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as err:  # noqa: BLE001  (any failure is reported, none stops the job)
        return (f"the MLflow server at {uri} did not answer ({type(err).__name__}: {str(err)[:300]})."
                f"{tracking_hint(err, uri)} Training goes on, logging to RUN_DIR/metrics.jsonl; "
                "`repro tracking sync RUN_DIR` uploads it later.")
    return None


def tracking_client(uri: str | None = None):
    """An MlflowClient for `uri` (default_tracking_uri()). The first client of a new sqlite store creates
    and migrates its tables: jobs starting together on one did so at once, and all but one lost MLflow
    ("duplicate column name: step"). A sqlite store is therefore opened under `<db>.lock` beside it."""
    from mlflow import MlflowClient

    uri = uri or default_tracking_uri()
    lock = sqlite_lock_path(uri)
    if lock is None:
        return MlflowClient(tracking_uri=uri)
    with _store_lock(lock, uri):
        return MlflowClient(tracking_uri=uri)  # (MLflow keeps the opened store for the process's later clients)


def sqlite_lock_path(uri: str) -> Path | None:
    """`<db>.lock` beside a sqlite store's database file; None for a server or an in-memory store."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(db + ".lock") if db and db != ":memory:" else None


def _store_lock(path: Path, uri: str):
    """Hold `path` (repro.run_lock: flock, its holder recorded, the file removed on release), waiting up
    to STORE_LOCK_SECONDS for another job."""
    from repro import run_lock

    path.parent.mkdir(parents=True, exist_ok=True)  # (a new store's folder: MLflow would make it too)
    return run_lock.held(path, STORE_LOCK_SECONDS, lambda holder: TimeoutError(
        f"{path} is still locked after {STORE_LOCK_SECONDS:.0f} s: {holder} holds it while it opens (or creates) "
        f"the MLflow store {uri}. Fix: wait for that process to end and retry"))


def experiment_id(client, name: str) -> str:
    """The id of experiment `name` in the client's store, created (artifacts as below) when absent. Two
    jobs may both find it absent: the one whose create is refused (it exists now) takes the other's."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifact_location(name, client.tracking_uri))
    except MlflowException:
        found = client.get_experiment_by_name(name)  # created by another job since: use it
        if found is None:
            raise
        return found.experiment_id


def default_artifact_location(experiment: str, uri: str) -> str | None:
    """Artifact folder for a new experiment of the store at `uri`: beside a sqlite store's database
    (mlruns/artifacts for the embedded one), None for a server, which keeps them where it is told.
    Decided by the store, not by where its URI came from: a login node that reads cluster.env's
    server must not give the server's experiment a folder on the login node's disk."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "artifacts" / experiment).as_uri()


def all_runs(client, experiment_ids: list[str], filter_string: str = "", order_by: list[str] | None = None,
             page_size: int = 1000) -> Iterator:
    """Every run a search finds, page by page (one search_runs call stops at its max_results: past
    1,000 evaluations of a task, a sync would log a record the store holds again)."""
    token = None
    while True:
        page = client.search_runs(experiment_ids, filter_string, max_results=page_size, order_by=order_by,
                                  page_token=token)
        yield from page
        token = page.token
        if not token:
            return


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

"""Where runs are tracked: MLFLOW_TRACKING_URI (or the cluster settings' one), else an embedded sqlite store."""

from __future__ import annotations

import os
from pathlib import Path


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


def experiment_id(client, name: str) -> str:
    """The id of experiment `name` in the client's store, created (artifacts as below) when absent."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(name, artifact_location=default_artifact_location(name))


def default_artifact_location(experiment: str) -> str | None:
    """Artifact folder for a new experiment in the embedded store (None for a remote server)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (project_root() / "mlruns" / "artifacts" / experiment).as_uri()

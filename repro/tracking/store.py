"""Where runs are tracked: MLFLOW_TRACKING_URI if set, else an embedded sqlite store in the project."""

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
    """MLFLOW_TRACKING_URI, or `sqlite:///<repo>/mlruns/mlflow.db` (artifacts in mlruns/artifacts)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    store = project_root() / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


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

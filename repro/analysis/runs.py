"""Runs from any MLflow tracking URI as pandas rows, with their provenance and an honest label.

    runs = load_runs("sqlite:///mlruns/mlflow.db", "scaling")   # one row per run
    runs.loc[0, "params.tp"], runs.loc[0, "metrics.loss"], provenance(runs.iloc[0])
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from repro.models.sizes import SIZES
from repro.tracking.run_dir import RESUMED_PARAM_TAG
from repro.tracking.store import all_runs, project_root, quiet_http_retries

FAMILY_EXPERIMENTS = ("scaling", "gpt2", "zero-shot", "bert")
PROVENANCE_KEYS = ("device_name", "world_size", "precision", "git_sha")
SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "file", "databricks")
URI_FIX = "use sqlite:///PATH/mlflow.db or http://HOST:PORT (--tracking-uri or MLFLOW_TRACKING_URI)"


class StoreError(RuntimeError):
    """A tracking URI that cannot be read; the message names it and the fix."""


def check_uri(uri: str) -> None:
    """A StoreError for a plain path or a scheme MLflow has no store for."""
    if "://" not in uri:
        raise StoreError(f"tracking URI {uri!r} is a path, not a URI. Fix: sqlite:///{Path(uri).resolve()} "
                         f"for a sqlite store file, or {URI_FIX}")
    scheme = uri.split("://", 1)[0].split("+", 1)[0]
    if scheme not in SCHEMES:
        raise StoreError(f"tracking URI {uri!r} has the unknown scheme {scheme}://. Fix: {URI_FIX}")
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise StoreError(file_store_message(uri))


def file_store_message(uri: str) -> str:
    """The error for a file:// store, which MLflow 3 opens only when MLFLOW_ALLOW_FILE_STORE is set
    (it was a traceback from MlflowClient)."""
    from urllib.parse import urlsplit

    folder = Path(urlsplit(uri).path or "DIR")
    db = folder.parent / f"{folder.name}.db"
    return (f"tracking URI {uri} is an MLflow file store, which MLflow no longer opens. Fix: copy it into a sqlite "
            f"store with `mlflow migrate-filestore --source {folder} --target sqlite:///{db}` and pass "
            f"--tracking-uri sqlite:///{db}, or set MLFLOW_ALLOW_FILE_STORE=true to read it as it is")


@contextmanager
def store_errors(uri: str):
    """MLflow and connection failures as a StoreError naming the store (fails within ~15 s)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, OSError) as err:
        raise StoreError(f"tracking store {uri} could not be read: {str(err)[:300]}. Fix: start the "
                         f"server, or {URI_FIX} naming a reachable store") from None


def resolve_uri(uri: str | None) -> str:
    """The given URI, else the project's default (MLFLOW_TRACKING_URI or the embedded sqlite store),
    a relative sqlite path made absolute: the notebooks run in analysis/, and read from there
    `sqlite:///mlruns/mlflow.db` named a store that is not there (every row 'not run', exit 0)."""
    from repro.tracking.store import default_tracking_uri

    uri = uri or default_tracking_uri()
    path = _sqlite_file(uri)
    if path is not None and not path.is_absolute() and str(path) not in ("", ":memory:"):
        _, sep, query = uri.partition("?")
        uri = f"sqlite:///{path.resolve()}{sep}{query}"
    return uri


def _sqlite_file(uri: str) -> Path | None:
    if not uri.startswith("sqlite:"):
        return None
    return Path(uri[len("sqlite:///"):].split("?")[0])  # sqlite:////abs/path or sqlite:///rel/path


def client(uri: str):
    """An MlflowClient for `uri`; a StoreError for a sqlite file that is absent (never creates one: a
    wrong path is not an empty store) or not an MLflow store, or a store MLflow cannot open. An
    unreachable server fails after one quick retry instead of minutes of them."""
    from mlflow import MlflowClient

    check_uri(uri)
    check_sqlite_store(uri)
    quiet_http_retries()
    with store_errors(uri):
        return MlflowClient(tracking_uri=uri)


MLFLOW_TABLES = {"alembic_version", "experiments", "runs"}


def check_sqlite_store(uri: str) -> None:
    """A StoreError for a sqlite URI naming a file that is not an MLflow store: absent (MLflow would
    create an empty one, and every table would say 'not run'), a directory, not a database, or a
    database of other tables (MLflow would add its own to it, from a read-only report)."""
    import sqlite3

    path = _sqlite_file(uri)
    if path is None or str(path) in ("", ":memory:"):
        return
    fix = f"Fix: {URI_FIX} naming the MLflow store (the mlflow.db `repro train` logged into)"
    if not path.exists():
        raise StoreError(missing_store_message(uri, path, fix))
    if not path.is_file():
        raise StoreError(f"tracking URI {uri} names {path}, which is not a file. {fix}")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:
        raise StoreError(f"tracking URI {uri} names {path}, which is not a sqlite database ({err}). {fix}") from None
    if tables and not MLFLOW_TABLES <= tables:
        raise StoreError(f"tracking URI {uri} names {path}, a sqlite database of other tables "
                         f"({', '.join(sorted(tables)[:5])}), not an MLflow store; nothing was written to it. {fix}")


def missing_store_message(uri: str, path: Path, fix: str) -> str:
    """The error for an absent sqlite store file: the path looked at, where a relative one is read from,
    and, where the checkout holds that relative path, its URI (a notebook kernel's cwd is analysis/)."""
    cwd, root = Path.cwd().resolve(), project_root().resolve()
    try:
        beside = root / Path(path).resolve().relative_to(cwd)
    except ValueError:
        beside = None
    if beside is not None and cwd != root and beside.is_file():
        fix = f"Fix: sqlite:///{beside} (that relative path from the checkout, where it exists)"
    return (f"tracking URI {uri} names {path}, which does not exist (a relative sqlite path is read from the "
            f"current directory, {cwd}; a notebook's is analysis/, not the checkout). {fix}")


def store_exists(uri: str) -> bool:
    """False for a sqlite URI whose file is absent (opening it would create an empty store)."""
    path = _sqlite_file(uri)
    return path is None or path.exists()


def run_counts(uri: str, experiments: tuple[str, ...] = FAMILY_EXPERIMENTS) -> dict[str, int]:
    """Runs per experiment name (0 when the experiment or the sqlite store file does not exist: `repro
    report` then says there are no runs and how to make them); a StoreError for a bad URI or an
    unreachable store."""
    check_uri(uri)
    if not store_exists(uri):
        return {name: 0 for name in experiments}
    mc = client(uri)
    counts = {}
    with store_errors(uri):
        for name in experiments:
            exp = mc.get_experiment_by_name(name)
            counts[name] = sum(1 for _ in all_runs(mc, [exp.experiment_id])) if exp else 0
    return counts


SMOKE_EXPERIMENT = "slurm-smoke"  # where slurm/launch.sh logs a job script's --smoke training (not a table's)


def _row(run, experiment: str) -> dict:
    row = {"run_id": run.info.run_id, "run_name": run.info.run_name, "status": run.info.status,
           "start_time": run.info.start_time, "experiment": experiment}
    row.update({f"params.{k}": v for k, v in run.data.params.items()})
    row.update({f"tags.{k}": v for k, v in run.data.tags.items() if not k.startswith("mlflow.")})
    row.update({f"params.{k[len(RESUMED_PARAM_TAG):]}": v for k, v in run.data.tags.items()  # a resume's change
                if k.startswith(RESUMED_PARAM_TAG)})
    row.update({f"metrics.{k}": v for k, v in run.data.metrics.items()})
    return row


def load_runs(uri: str, experiment: str, finished_only: bool = True) -> pd.DataFrame:
    """One row per run of `experiment`, newest first: run_id, run_name, status, params.*, tags.*, metrics.*.

    An absent experiment gives an empty frame; an absent sqlite store file is a StoreError (client):
    a notebook whose relative URI missed the store wrote tables of 'not run'."""
    mc = client(uri)
    exp = mc.get_experiment_by_name(experiment)
    runs = list(all_runs(mc, [exp.experiment_id], order_by=["attributes.start_time DESC"])) if exp else []
    if finished_only:
        runs = [r for r in runs if r.info.status == "FINISHED"]
    rows = [_row(r, experiment) for r in runs]
    return pd.DataFrame(rows, columns=None if rows else ["run_id", "run_name", "status", "start_time", "experiment"])


def get_run_row(uri: str, run_id: str) -> dict | None:
    """One run by id, from any experiment of the store (`deleted` true for a deleted run); None when
    it is not there."""
    mc = client(uri)
    try:
        run = mc.get_run(run_id)
    except Exception:  # another store's run id, or a deleted run
        return None
    exp = mc.get_experiment(run.info.experiment_id)
    return {**_row(run, exp.name if exp else ""), "deleted": run.info.lifecycle_stage == "deleted"}


def metric_history(uri: str, run_id: str, key: str) -> pd.DataFrame:
    """One metric's value at each logged step, the last logged where a step has several: a resume with
    a new schedule redoes the steps after its checkpoint, and MLflow keeps the values it replaced
    (metrics.jsonl sets them aside). Columns step, value, sorted by step."""
    hist = client(uri).get_metric_history(run_id, key)
    frame = pd.DataFrame([(m.step, m.timestamp, m.value) for m in hist], columns=["step", "time", "value"])
    frame = frame.sort_values(["step", "time"], kind="stable").drop_duplicates("step", keep="last")
    return frame[["step", "value"]].reset_index(drop=True)


WARMUP_METRIC = "warmup_interval"  # 1 on the first logged interval of each launch (repro/train/loop.py)


def after_warmup(history: pd.DataFrame, warmup: pd.DataFrame | None = None) -> pd.DataFrame:
    """A per-interval metric's rows without its warm-up intervals: the steps `warmup` flags (the first
    interval of every launch, resumes included), and for a launch that predates that flag its first
    logged interval. Empty for a run that logged nothing but warm-up."""
    if warmup is not None and len(warmup) and len(history):
        kept = history[~history["step"].isin(warmup.loc[warmup["value"] > 0, "step"])]
        if history["step"].min() < warmup["step"].min():  # a launch from before the flag: its first too
            kept = kept[kept["step"] != history["step"].min()]
        return kept
    return history.iloc[1:]


def median_after_warmup(history: pd.DataFrame, warmup: pd.DataFrame | None = None) -> float:
    """Median of a per-interval metric after_warmup. NaN for an empty history; a run with nothing but
    warm-up keeps it all."""
    if not len(history):
        return float("nan")
    kept = after_warmup(history, warmup)
    return float((kept if len(kept) else history)["value"].median())


LAYOUT_KEYS = ("world_size", "tp", "dp", "train.global_batch_size", "train.micro_batch_size", "device_type",
               "device_name", "precision", "model.activation_checkpointing", "train.compile")
"""Params that set a run's speed: a resume that changed one (a resumed_with.* tag) split its launches in two."""


def layout_changed(row) -> bool:
    """A resume changed the run's layout or recipe (a `resumed_with.` tag on a LAYOUT_KEYS param): its
    row shows the new one, and only its last launch is known to have run it."""
    return any(get(row, f"tags.{RESUMED_PARAM_TAG}{key}") is not None for key in LAYOUT_KEYS)


def last_launch(history: pd.DataFrame, warmup: pd.DataFrame) -> pd.DataFrame:
    """A per-interval metric's rows of the last launch: from the last step `warmup` flags on (a later
    launch logs after an earlier one's steps). Empty when no step is flagged: launches not told apart."""
    flagged = warmup.loc[warmup["value"] > 0, "step"]
    return history[history["step"] >= flagged.max()] if len(flagged) else history.iloc[:0]


def launch_history(uri: str, row, key: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A per-interval metric's history and the warm-up flags of the launches at the layout the row shows:
    every launch, or only the last of a run resumed on another layout (layout_changed)."""
    history, warmup = metric_history(uri, row["run_id"], key), metric_history(uri, row["run_id"], WARMUP_METRIC)
    if layout_changed(row):
        return last_launch(history, warmup), last_launch(warmup, warmup)
    return history, warmup


def sustained(uri: str, row, key: str) -> tuple[float, bool]:
    """A run's steady-state value of a per-interval metric (ms_per_iter, tflops_per_device, ...):
    median_after_warmup of launch_history; and whether it is steady (an interval after warm-up logged)."""
    history, warmup = launch_history(uri, row, key)
    return median_after_warmup(history, warmup), bool(len(after_warmup(history, warmup)))


def get(row, key: str, default=None):
    """row[key] when present and not NaN (rows come from frames with ragged columns)."""
    value = row.get(key, default) if hasattr(row, "get") else default
    return default if value is None or (isinstance(value, float) and value != value) else value


def is_paper_size(name: str | None) -> bool:
    """True for a model size the paper reports (repro.models.sizes)."""
    return bool(name) and name in SIZES


SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _int(value) -> int | None:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def logged_shape(row) -> dict[str, int | None]:
    """The model shape a run logged: the trainer's `model.*` params, else a RACE run's bare ones (its
    seq_length is the fine-tuning length; the paper's 2020 RACE example used 512, the BERT sizes')."""
    return {k: _int(get(row, f"params.model.{k}", get(row, f"params.{k}"))) for k in SHAPE_KEYS}


def shape_text(row) -> str:
    """`L24-h1024-a16-s1024` from the logged shape, `?` where not logged."""
    shape = logged_shape(row)
    return "L{}-h{}-a{}-s{}".format(*("?" if shape[k] is None else shape[k] for k in SHAPE_KEYS))


def paper_size(row) -> str | None:
    """The run's named paper size (params model_size or size) when its logged shape is exactly that
    size's; None for other names, reduced overrides and runs that did not log their shape."""
    name = get(row, "params.model_size") or get(row, "params.size")
    if not is_paper_size(name):
        return None
    size = SIZES[name]
    return name if logged_shape(row) == {k: getattr(size, k) for k in SHAPE_KEYS} else None


def size_name(row) -> str | None:
    """The run's model as the report names it: a paper size only when paper_size confirms it; a paper
    name on another shape, or `custom`, becomes `custom L2-h64-a4-s128`; other names as logged."""
    name = get(row, "params.model_size") or get(row, "params.size")
    if paper_size(row):
        return name
    if is_paper_size(name) or name == "custom":
        return f"custom {shape_text(row)}"
    return name or None


def run_label(row) -> str:
    """"GPU, paper size" style label; CPU and reduced-size runs say so."""
    device = str(get(row, "params.device_type", "") or "")
    name = " ".join(str(get(row, k, "")) for k in ("run_name", "tags.paper_ref"))
    parts = []
    if device == "cpu":
        parts.append("CPU")
    elif not device and "cpu" in name.lower():
        parts.append("CPU (by run name; device not logged)")
    elif device:
        parts.append(str(get(row, "params.device_name", device)))
    else:
        parts.append("device not logged")
    parts.append("paper size" if paper_size(row) else "reduced size (not a paper config)")
    return ", ".join(parts)


def provenance(row) -> str:
    """device, world size, precision, git SHA and run id of a run, 'n/a' where not logged."""
    vals = {k: get(row, f"params.{k}") for k in PROVENANCE_KEYS}
    sha = str(vals["git_sha"])[:8] if vals["git_sha"] else "n/a"
    return (f"device={vals['device_name'] or 'n/a'}; world={vals['world_size'] or 'n/a'}; "
            f"precision={vals['precision'] or 'n/a'}; git={sha}; run={str(get(row, 'run_id', ''))[:8]}")

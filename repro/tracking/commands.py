"""`repro tracking sync RUN_DIR|EVALS.jsonl`: upload a training run or evaluation records logged while
MLflow was unreachable (or with tracking off)."""

from __future__ import annotations

from pathlib import Path

EVAL_FILE = "zero_shot.jsonl"


def _sync(args) -> int:
    from repro.cli import UserError
    from repro.tracking.run_dir import TrackingError
    from repro.tracking.sync import check_store

    path = Path(args.path)
    if not path.exists():
        raise UserError(f"{path} does not exist. Fix: give a training run directory or the "
                        f"{EVAL_FILE} that `repro eval` wrote")
    try:
        check_store()  # a bad MLFLOW_TRACKING_URI is named before anything is read
        if path.is_dir():
            _sync_run_dir(path)
        if path.is_file() or (path / EVAL_FILE).is_file():
            _sync_evals(path if path.is_file() else path / EVAL_FILE)
    except TrackingError as err:
        raise UserError(str(err)) from None
    return 0


def _sync_evals(path: Path) -> None:
    from repro.eval.report import sync_records

    result = sync_records(path)
    print(f"{path}: {len(result.created)} evaluation record(s) logged to experiment zero-shot at {result.uri}"
          f" ({', '.join(result.created) or 'no new runs'}); {result.already} already there")


def _sync_run_dir(run_dir: Path) -> None:
    from repro.tracking.sync import sync_run

    if not (run_dir / "params.json").exists() and (run_dir / EVAL_FILE).is_file():
        return  # an evaluation's output directory, not a training run
    result = sync_run(run_dir)
    if result.note:
        print(f"note: {result.note}")
    if result.action == "up to date":
        print(f"{run_dir} is already in MLflow run {result.run_id} at {result.uri}: nothing to sync")
    else:
        print(f"{result.action} MLflow run {result.run_id} at {result.uri} from {run_dir} "
              f"({result.metrics_sent} metric values sent)")


def register(sub) -> None:
    p = sub.add_parser("tracking", help="MLflow tracking utilities")
    tsub = p.add_subparsers(dest="tracking_command", required=True)
    s = tsub.add_parser("sync", help="upload a training run directory (params, metrics, artifacts, into its "
                                     "MLflow run when the store has it) and its zero_shot.jsonl, or a "
                                     "zero_shot.jsonl file; never anything twice")
    s.add_argument("path", help="a training run directory or a JSON-lines file of `repro eval` records")
    s.set_defaults(func=_sync)

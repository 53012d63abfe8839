"""`repro tracking sync RUN_DIR`: upload a run logged while MLflow was unreachable."""

from __future__ import annotations


def _sync(args) -> int:
    from repro.cli import UserError
    from repro.tracking.logger import TrackingError, sync_run

    try:
        result = sync_run(args.run_dir)
    except TrackingError as err:
        raise UserError(str(err)) from None
    if result.note:
        print(f"note: {result.note}; uploading as a new run")
    if result.action == "up to date":
        print(f"{args.run_dir} is already in MLflow run {result.run_id} at {result.uri}: nothing to sync")
    else:
        print(f"{result.action} MLflow run {result.run_id} at {result.uri} from {args.run_dir} "
              f"({result.metrics_sent} metric values sent)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("tracking", help="MLflow tracking utilities")
    tsub = p.add_subparsers(dest="tracking_command", required=True)
    s = tsub.add_parser("sync", help="upload a run directory's params, metrics and artifacts "
                                     "(into its MLflow run when the store has it; never twice)")
    s.add_argument("run_dir")
    s.set_defaults(func=_sync)

"""`repro tracking sync RUN_DIR`: upload a run logged while MLflow was unreachable."""

from __future__ import annotations


def _sync(args) -> int:
    from repro.cli import UserError
    from repro.tracking.logger import sync_run
    from repro.tracking.store import default_tracking_uri

    try:
        run_id = sync_run(args.run_dir)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    print(f"uploaded {args.run_dir} as MLflow run {run_id} to {default_tracking_uri()}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("tracking", help="MLflow tracking utilities")
    tsub = p.add_subparsers(dest="tracking_command", required=True)
    s = tsub.add_parser("sync", help="upload a run directory's params, metrics and artifacts")
    s.add_argument("run_dir")
    s.set_defaults(func=_sync)

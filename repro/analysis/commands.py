"""`repro report`: execute the analysis notebooks against a tracking store and print the tables.

    repro report                                   # embedded store -> results/
    repro report --tracking-uri http://mlflow:5000 --out /tmp/report
"""

from __future__ import annotations

from pathlib import Path

HOW_TO_MAKE_RUNS = """make some runs first, e.g.
  repro train experiments/tiny/gpt_tiny.yaml --set tracking.experiment=scaling --set data.train_prefix=...
  repro eval wikitext --checkpoint runs/<name>/checkpoints      (experiment zero-shot)
  repro finetune race --race-dir ... --model-config experiments/bert/tiny_cpu.yaml   (experiment bert)
or point --tracking-uri (or MLFLOW_TRACKING_URI) at the store that holds your runs."""


def empty_store_message(uri: str, counts: dict[str, int]) -> str:
    """The error for a store without runs: names the URI, the experiments looked at and the fix."""
    looked = ", ".join(f"{k}" for k in counts)
    return f"no runs in tracking store {uri} (experiments looked at: {looked}); {HOW_TO_MAKE_RUNS}"


STAGING_PREFIX = ".report-"  # a running report's folder inside --out: .report-PID-XXXX (git-ignored)


def run_report(uri: str, out: Path, names: tuple[str, ...]) -> list[Path]:
    """Execute each named notebook with (uri, a staging folder inside `out`) injected, then move what
    they wrote into `out`: a failing notebook leaves `out` as it was, not tables of two reports.
    Returns the tables written."""
    import os
    import shutil
    import tempfile

    from repro.analysis.notebook import TABLES, execute, notebook_path

    remove_stale_staging(out)
    # out's filesystem: the moves are renames
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out))
    try:
        params = {"tracking_uri": uri, "out_dir": str(staging), "bench_dir": str(bench_dir())}
        for name in names:
            print(f"executing analysis/{name}.ipynb ...", flush=True)
            execute(notebook_path(name), params, failed_copy=out / "failed" / f"{name}.ipynb")
        written = [out / t for name in names for t in TABLES[name] if (staging / t).exists()]
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def remove_stale_staging(out: Path) -> None:
    """Remove the staging folders of reports that were killed (their process is gone), with a note."""
    import shutil

    for folder in sorted(out.glob(f"{STAGING_PREFIX}*")):
        if folder.is_dir() and not _running(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            print(f"note: removed {folder}, left by a `repro report` that was killed")


def _running(name: str) -> bool:
    """Whether the report that made staging folder `name` (.report-PID-XXXX) is still running here."""
    import os

    pid = name.removeprefix(STAGING_PREFIX).split("-")[0]
    if not pid.isdigit():  # an older report's .report-XXXX: no owner to ask
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _move_into(staging: Path, out: Path) -> None:
    """Move every file below `staging` to the same place below `out` (replacing what is there), in
    sorted order, with stop signals held until the last is moved: a stop never leaves tables of two
    reports. (`out` is a tracked folder with other files, results/bench: no single rename can swap
    it; a SIGKILL between these renames, a few milliseconds, can still mix them.)"""
    import os

    from repro.train.signals import stop_signals_deferred

    moves = [(path, out / path.relative_to(staging)) for path in sorted(p for p in staging.rglob("*") if p.is_file())]
    with stop_signals_deferred():
        for path, target in moves:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)


def bench_dir() -> Path:
    """The GPU benchmarks the scaling notebook reads: results/bench of the checkout."""
    from repro.tracking.store import project_root

    return project_root() / "results" / "bench"


def _report(args) -> int:
    from repro.analysis.baseline import BenchError, check_benchmarks
    from repro.analysis.notebook import NOTEBOOKS, NotebookError
    from repro.analysis.runs import StoreError, resolve_uri, run_counts
    from repro.cli import UserError
    from repro.provenance import make_out_dir
    from repro.tracking.store import project_root

    out = Path(args.out).resolve() if args.out else project_root() / "results"
    _check_out(out)
    uri = resolve_uri(args.tracking_uri)
    try:
        counts = run_counts(uri)
    except StoreError as err:
        raise UserError(str(err)) from None
    if not any(counts.values()):
        raise UserError(empty_store_message(uri, counts))
    print(f"tracking store {uri}: " + ", ".join(f"{k} {v} run(s)" for k, v in counts.items()))
    try:
        check_benchmarks(bench_dir())  # before any notebook: a broken file is news, not a half-written report
    except BenchError as err:
        raise UserError(str(err)) from None
    make_out_dir(out, "/tmp/report")
    try:
        tables = _stoppable_report(uri, out, tuple(args.only or NOTEBOOKS))
    except NotebookError as err:
        raise UserError(str(err)) from None
    for path in tables:
        print("\n" + path.read_text())
    print(f"wrote tables and figures to {out}")
    return 0


def _check_out(out: Path) -> None:
    """A UserError, before any notebook runs, for an --out this process cannot write into (a file in
    the way is make_out_dir's error)."""
    from repro.cli import UserError
    from repro.provenance import file_in_the_way, unwritable_ancestor

    if file_in_the_way(out) is None and (blocked := unwritable_ancestor(out / "table")) is not None:
        raise UserError(f"--out {out}: {blocked} is not writable. Fix: give a writable path, e.g. --out /tmp/report")


def _stoppable_report(uri: str, out: Path, names: tuple[str, ...]) -> list[Path]:
    """run_report in which SIGTERM or SIGUSR1 (scancel, a time limit, `kill`) ends the report with a
    "stopped" line and exit 128 + signal, its staging folder removed. While a notebook runs the
    signal interrupts its kernel (NotebookStopped); elsewhere it is SystemExit, noted: whatever comes
    out of the report after it is the stop."""
    import signal
    import sys

    from repro.analysis.notebook import NotebookStopped
    from repro.train.signals import exiting_on_stop_signals

    received: list[int] = []
    try:
        with exiting_on_stop_signals(noted=received):  # the caller's handlers are back afterwards
            return run_report(uri, out, names)
    except NotebookStopped as stop:  # (a signal while a kernel ran: it was interrupted and shut down)
        received.append(stop.signum)
    except BaseException:
        if not received:
            raise
    print(f"repro report stopped by {signal.Signals(received[0]).name}: {out} holds the previous report's "
          "tables or all of this one's, never a mix. Rerun `repro report` to make them", file=sys.stderr, flush=True)
    raise SystemExit(128 + received[0])


def register(sub) -> None:
    """Add `repro report`."""
    from repro.analysis.notebook import NOTEBOOKS

    p = sub.add_parser("report", help="execute the analysis notebooks; write the paper's tables and figures")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store (default: MLFLOW_TRACKING_URI, else slurm/cluster.env's, else mlruns/mlflow.db)")
    p.add_argument("--out", default=None, help="directory for tables (CSV, Markdown) and figures (PNG); default: results/")
    p.add_argument("--only", nargs="+", choices=NOTEBOOKS, help="run only these notebooks")
    p.set_defaults(func=_report)

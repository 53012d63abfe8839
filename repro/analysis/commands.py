"""`repro report`: execute the analysis notebooks against a tracking store and print the tables.

    repro report                                   # embedded store -> results/
    repro report --tracking-uri http://mlflow:5000 --out /tmp/report
"""

from __future__ import annotations

import time
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


def run_report(uri: str, out: Path, names: tuple[str, ...]) -> list[Path]:
    """Execute each named notebook with (uri, out) injected; return the tables written."""
    from repro.analysis.notebook import TABLES, execute, notebook_path
    from repro.tracking.store import project_root

    params = {"tracking_uri": uri, "out_dir": str(out), "bench_dir": str(project_root() / "results/bench")}
    written = []
    for name in names:
        print(f"executing analysis/{name}.ipynb ...", flush=True)
        started = time.time() - 1.0  # (a filesystem's coarse mtimes)
        execute(notebook_path(name), params, failed_copy=out / "failed" / f"{name}.ipynb")
        # this run's tables only: one an earlier report left (a baseline without GPU benchmarks now) is not news
        written += [out / t for t in TABLES[name] if (out / t).exists() and (out / t).stat().st_mtime >= started]
    return written


def _report(args) -> int:
    from repro.analysis.notebook import NOTEBOOKS, NotebookError
    from repro.analysis.runs import StoreError, resolve_uri, run_counts
    from repro.cli import UserError
    from repro.provenance import make_out_dir
    from repro.tracking.store import project_root

    uri = resolve_uri(args.tracking_uri)
    try:
        counts = run_counts(uri)
    except StoreError as err:
        raise UserError(str(err)) from None
    if not any(counts.values()):
        raise UserError(empty_store_message(uri, counts))
    print(f"tracking store {uri}: " + ", ".join(f"{k} {v} run(s)" for k, v in counts.items()))
    out = Path(args.out).resolve() if args.out else project_root() / "results"
    make_out_dir(out, "/tmp/report")
    try:
        tables = run_report(uri, out, tuple(args.only or NOTEBOOKS))
    except NotebookError as err:
        raise UserError(str(err)) from None
    for path in tables:
        print("\n" + path.read_text())
    print(f"wrote tables and figures to {out}")
    return 0


def register(sub) -> None:
    """Add `repro report`."""
    from repro.analysis.notebook import NOTEBOOKS

    p = sub.add_parser("report", help="execute the analysis notebooks; write the paper's tables and figures")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI or mlruns/mlflow.db)")
    p.add_argument("--out", default=None, help="directory for tables (CSV, Markdown) and figures (PNG); default: results/")
    p.add_argument("--only", nargs="+", choices=NOTEBOOKS, help="run only these notebooks")
    p.set_defaults(func=_report)

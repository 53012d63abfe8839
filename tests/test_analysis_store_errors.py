"""Stores the tables cannot be built from: an absent sqlite file (a notebook in Jupyter read a relative
MLFLOW_TRACKING_URI from analysis/ and wrote tables of 'not run' over ../results, no error) and an
MLflow file store (`repro report` ended in MlflowClient's traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro.analysis import runs as R

ROOT = Path(__file__).resolve().parents[1]


def test_a_notebook_whose_relative_uri_misses_the_store_fails_and_writes_nothing(tmp_path, monkeypatch):
    """The real bert notebook run as Jupyter runs it (cwd analysis/), MLFLOW_TRACKING_URI relative to
    the checkout root: the cell's error names the file it looked for; the last tables stay as they were."""
    from repro.analysis.notebook import NotebookError, execute, notebook_path

    rel = f"no-store-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{rel}/mlflow.db")
    out = tmp_path / "results"
    out.mkdir()
    (out / "bert_table.md").write_text("last report\n")
    looked = ROOT / "analysis" / rel / "mlflow.db"
    with pytest.raises(NotebookError, match="StoreError") as err:
        execute(notebook_path("bert"), {"tracking_uri": None, "out_dir": str(out)})
    assert f"names {looked}, which does not exist" in str(err.value)
    assert "a notebook's is analysis/" in str(err.value)
    assert [p.name for p in out.iterdir()] == ["bert_table.md"]
    assert (out / "bert_table.md").read_text() == "last report\n"
    assert not looked.parent.exists()  # no empty store made in analysis/


def test_tables_from_an_absent_sqlite_file_are_an_error_naming_the_checkouts_file(tmp_path, monkeypatch):
    """load_runs of an absent sqlite file, and a report function from analysis/ with a relative URI: a
    StoreError, not an empty table; where the checkout holds that relative path, the fix is its
    absolute URI. No file is created."""
    from repro.analysis import zeroshot

    with pytest.raises(R.StoreError, match="which does not exist.*Fix: use sqlite:///PATH/mlflow.db"):
        R.load_runs(f"sqlite:///{tmp_path / 'absent.db'}", "scaling")
    assert not (tmp_path / "absent.db").exists()
    checkout = tmp_path / "checkout"
    (checkout / "analysis").mkdir(parents=True)
    (checkout / "store").mkdir()
    (checkout / "store" / "mlflow.db").write_bytes(b"")
    monkeypatch.setattr(R, "project_root", lambda: checkout)
    monkeypatch.chdir(checkout / "analysis")
    with pytest.raises(R.StoreError) as err:
        zeroshot.report(R.resolve_uri("sqlite:///store/mlflow.db"), tmp_path / "out")
    assert f"names {checkout}/analysis/store/mlflow.db, which does not exist" in str(err.value)
    assert f"Fix: sqlite:///{checkout}/store/mlflow.db (that relative path from the checkout" in str(err.value)
    assert not (checkout / "analysis" / "store").exists() and not (tmp_path / "out").exists()


def test_report_on_a_file_store_is_one_line_naming_migrate_filestore(tmp_path, monkeypatch, capsys):
    """`repro report --tracking-uri file:///DIR`: exit 2 and one line with `mlflow migrate-filestore`
    (was a traceback, exit 1); MLFLOW_ALLOW_FILE_STORE=true still reads the folder (here: no runs)."""
    from repro.cli import main

    store = tmp_path / "fstore"
    store.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run([sys.executable, "-m", "repro.cli", "report", "--tracking-uri", store.as_uri(),
                           "--out", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: tracking URI {store.as_uri()} is an MLflow file store")
    assert f"mlflow migrate-filestore --source {store} --target sqlite:///{tmp_path}/fstore.db" in proc.stderr
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert main(["report", "--tracking-uri", store.as_uri(), "--out", str(tmp_path / "out")]) == 2
    assert "no runs in tracking store" in capsys.readouterr().err

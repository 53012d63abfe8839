"""One tracking-store check for `repro slurm check`, `repro eval` and `repro tracking sync`: a new sqlite
store that cannot be created (a file in its path) is refused up front, exit 2, before any checkpoint is
loaded or any run uploaded. `repro slurm check-checkpoint --family bert FILE` reads the file as `repro
finetune race` would and refuses what is not a save_bert checkpoint. `repro tracking sync` shows its
metric upload on a progress bar (stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval_helpers import mirror, write_tiny_checkpoint
from repro.cli import main

TINY_BERT = dict(vocab_size=100, num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)


def _repro(*argv, uri: str) -> subprocess.CompletedProcess:
    """`repro ARGV` in a fresh process (PYTHONPATH decides which code runs) with MLFLOW_TRACKING_URI=uri."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "repro.cli", *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=300)


def _under_a_file(tmp_path: Path) -> str:
    (tmp_path / "regular").write_text("a file, where the store's folder would go")
    return f"sqlite:///{tmp_path / 'regular' / 'mlruns' / 'mlflow.db'}"


def _assert_refused_store(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"{tmp_path / 'regular'} is a file, not a directory" in proc.stderr
    assert "store cannot be created" in proc.stderr and "Fix:" in proc.stderr, proc.stderr


def _run_dir(path: Path, steps: int = 3) -> Path:
    """A training run directory logged with tracking off: params, tags, `steps` rows of two metrics."""
    path.mkdir()
    (path / "params.json").write_text('{"lr": 0.1}')
    (path / "tags.json").write_text('{"experiment": "progress", "run_name": "r"}')
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "time": {1733300000.0 + s}, "loss": {7.0 - s}, '
                                                f'"lr": 0.1}}\n' for s in range(1, steps + 1)))
    return path


def test_check_store_refuses_a_new_sqlite_store_under_a_file(tmp_path):
    from repro.tracking.run_dir import TrackingError
    from repro.tracking.sync import check_store

    uri = _under_a_file(tmp_path)
    with pytest.raises(TrackingError, match="is a file, not a directory, so the store cannot be created. Fix:"):
        check_store(uri)
    assert check_store(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")  # a folder yet to be made is fine


def test_tracking_sync_refuses_an_uncreatable_store_before_touching_the_run(tmp_path):
    """Before: the run directory was read and locked, then MLflow failed on the path (another message)."""
    run_dir = _run_dir(tmp_path / "run")
    before = sorted(p.name for p in run_dir.iterdir())
    _assert_refused_store(_repro("tracking", "sync", run_dir, uri=_under_a_file(tmp_path)), tmp_path)
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no mlflow_run_id written


def test_eval_refuses_an_uncreatable_store_before_loading_the_checkpoint(tmp_path):
    """Before: the checkpoint was loaded and scored, the record written, and the MLflow log only warned."""
    run = tmp_path / "gpt"
    write_tiny_checkpoint(run, seq_length=64, num_layers=1)
    out = tmp_path / "o.jsonl"
    proc = _repro("eval", "wikitext", "--checkpoint", run, "--data-dir", mirror(), "--window", "64", "--stride",
                  "64", "--max-lines", "5", "--out", out, uri=_under_a_file(tmp_path))
    _assert_refused_store(proc, tmp_path)
    assert "--no-mlflow" in proc.stderr and not out.exists() and "wikitext" not in proc.stdout


def test_slurm_check_keeps_its_prefix_on_the_shared_store_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _under_a_file(tmp_path))
    tiny = str(Path(__file__).resolve().parents[1] / "experiments" / "tiny" / "gpt_tiny.yaml")
    assert main(["slurm", "check", tiny, "--ntasks", "1"]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI: tracking URI" in err and "store cannot be created" in err and "Fix:" in err, err


def _save_bert(path: Path) -> Path:
    from repro.models.bert import BERT, BertConfig
    from repro.models.bert_checkpoint import save_bert

    save_bert(BERT(BertConfig(**TINY_BERT), seed=1), path)
    return path


def _wrong_shape(path: Path) -> None:
    blob = torch.load(_save_bert(path), weights_only=True)
    blob["model"]["embeddings.word.weight"] = torch.zeros(100, 16)  # hidden 16 in a hidden-32 model
    torch.save(blob, path)


def _bad_config(**bad):
    def write(path: Path) -> None:
        blob = torch.load(_save_bert(path), weights_only=True)
        blob["config"].update(bad)
        torch.save(blob, path)
    return write


@pytest.mark.parametrize("write, words", [
    (lambda p: p.write_text("train the 8B model\n"), "is not a readable torch file"),
    (lambda p: p.write_bytes(b""), "is not a readable torch file"),
    (lambda p: torch.save({"weights": torch.zeros(2)}, p), "holds no save_bert 'config' and 'model'"),
    (_wrong_shape, "its weights do not fit its own config"),
    (_bad_config(num_layers=0), "its config is not a valid BertConfig (num_layers=0"),  # was a ConfigError traceback
    (_bad_config(hidden_size="x"), "its config is not a valid BertConfig"),  # was a TypeError traceback
], ids=["text", "empty", "foreign-torch", "wrong-shape", "zero-layers", "text-width"])
def test_check_checkpoint_refuses_a_file_that_is_not_a_save_bert_checkpoint(tmp_path, capsys, write, words):
    """Before: `checkpoint ok: ... is a file (save_bert writes BERTs only)`, exit 0, for any file."""
    path = tmp_path / "bert.pt"
    write(path)
    assert main(["slurm", "check-checkpoint", "--family", "bert", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err and "Fix:" in err and "Traceback" not in err, err


def test_check_checkpoint_passes_a_save_bert_file(tmp_path, capsys):
    path = _save_bert(tmp_path / "bert.pt")
    assert main(["slurm", "check-checkpoint", "--family", "bert", str(path)]) == 0
    assert f"checkpoint ok: {path}" in capsys.readouterr().out


def test_tracking_sync_shows_its_metric_upload_on_a_progress_bar(tmp_path, monkeypatch, capsys):
    """Before: 120k metric values uploaded in silence for ~10 s. The bar appears once the upload has taken
    PROGRESS_DELAY_S (0 here), on stderr even when it is not a terminal, as the project's other bars."""
    from mlflow import MlflowClient

    from repro.tracking import sync

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(sync, "PROGRESS_DELAY_S", 0.0)
    run_dir = _run_dir(tmp_path / "run", steps=5)
    result = sync.sync_run(run_dir)
    err = capsys.readouterr().err
    assert "sync metrics: 100%" in err and "10/10" in err, err  # 5 steps x (loss, lr), of a known total
    assert result.metrics_sent == 10
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(result.run_id, "loss")) == [1, 2, 3, 4, 5]
    monkeypatch.setattr(sync, "PROGRESS_DELAY_S", 1.0)  # the default: a sync of a few rows shows no bar
    with open(run_dir / "metrics.jsonl", "a") as rows:
        rows.write('{"step": 6, "time": 1733300006.0, "loss": 1.0, "lr": 0.1}\n')
    assert sync.sync_run(run_dir).metrics_sent == 2 and "sync metrics" not in capsys.readouterr().err


def test_a_param_logged_while_mlflow_is_paused_reaches_the_run_at_close(tmp_path, monkeypatch):
    """RACE logs median_seed at its end (RunLogger.log_params). With MLflow paused after a failed request
    (a locked sqlite store), the param went to params.json only and the run still closed FINISHED without
    it; now the catch-up that close() (or the next flush after the pause) sends includes it."""
    from mlflow import MlflowClient

    from repro.tracking.logger import RunLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    log = RunLogger(tmp_path / "run", "bert", "race-x", {"task": "race"}, {})
    log.log_metrics({"loss": 1.0}, 1)
    with pytest.warns(UserWarning, match="MLflow request failed"):
        log._pause(RuntimeError("database is locked"))  # what a failed request does: no request for a while
    log.log_params({"median_seed": "2"})
    log.close()
    run = MlflowClient(uri).get_run(log.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"task": "race", "median_seed": "2"}
    assert json.loads((tmp_path / "run" / "params.json").read_text())["median_seed"] == "2"

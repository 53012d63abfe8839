"""`repro checkpoint` review fixes: a resharded copy keeps its training run, shards that do not fit
meta.json are refused, SIGTERM leaves no temporary directory, bad --out and import-hf sources exit 2.
Checkpoints here are written directly (random weights in the layout `repro train` writes): no training."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from repro.cli import main
from repro.models.bert import BertConfig
from repro.parallel.checks import tiny_config
from repro.parallel.groups import ProcessGroups
from repro.train import checkpoint as ck
from repro.train import reshard as rs

ROOT = Path(__file__).resolve().parents[1]


def _write_checkpoint(ckpt: Path, cfg, family: str = "gpt", tp: int = 2, **meta) -> Path:
    """A TP=`tp` checkpoint of random weights in the layout `repro train` writes (as iteration 2)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in rs._build(cfg, family).state_dict().items()}
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    full = {n: t[:cfg.vocab_size] if n in rs.VOCAB_ROWS else t for n, t in full.items()}
    spec = rs.partition_spec(cfg, family)
    for rank in range(tp):
        torch.save(rs.shard_state(full, spec, rank, tp, cfg.padded_vocab_size(tp)), ckpt / f"model_tp{rank:02d}.pt")
    meta = {"format": 1, "family": family, "iteration": 2, "tp": tp, "model": dataclasses.asdict(cfg), **meta}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def _training_run(run_dir: Path, run_id: str | None) -> Path:
    """A run directory whose checkpoint's meta.json has no run id (trained while MLflow was unreachable)
    and whose `mlflow_run_id` file holds the id `repro tracking sync` recorded."""
    ckpt = _write_checkpoint(run_dir / "checkpoints" / "iter_0000002", tiny_config(4), mlflow_run_id=None)
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)
    if run_id:
        (run_dir / "mlflow_run_id").write_text(run_id)
    return run_dir


def _snapshot(root: Path) -> dict[str, tuple | None]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


# ---- 1: a resharded copy is credited to the run that trained it ---------------------------------

def test_a_resharded_copy_keeps_its_training_run_wherever_it_is_written(tmp_path):
    run_a = _training_run(tmp_path / "runA", "run-a")
    run_b = _training_run(tmp_path / "runB", "run-b")
    inside_b = rs.reshard(run_a, run_b / "tp1", 1)  # --out inside another run's directory
    elsewhere = rs.reshard(run_a, tmp_path / "copies" / "tp1", 1)
    for out in (inside_b, elsewhere):
        assert ck.read_meta(out)["mlflow_run_id"] == "run-a"
        assert ck.checkpoint_run_id(out) == "run-a"
        assert ck.training_provenance(out)["training_run_id"] == "run-a"


def test_an_older_resharded_copy_follows_its_source_and_an_import_has_no_run(tmp_path):
    """A copy written before the fix (mlflow_run_id null) takes its resharded_from source's id, not
    the id of the directory it sits in; an import (model only, no source run) has none."""
    run_a = _training_run(tmp_path / "runA", "run-a")
    run_b = _training_run(tmp_path / "runB", "run-b")
    old = rs.reshard(run_a, run_b / "tp1", 1)
    meta = ck.read_meta(old)
    (old / "meta.json").write_text(json.dumps({**meta, "mlflow_run_id": None}))
    assert ck.checkpoint_run_id(old) == "run-a"
    gone = {**meta, "mlflow_run_id": None, "resharded_from": str(tmp_path / "gone")}
    (old / "meta.json").write_text(json.dumps(gone))
    assert ck.checkpoint_run_id(old) is None
    imported = _write_checkpoint(run_b / "imported", tiny_config(1), tp=1, model_only=True, imported_from="x")
    assert ck.checkpoint_run_id(imported) is None


# ---- 2: shards are checked against meta.json's model -------------------------------------------

def test_a_shard_of_another_model_is_refused_naming_the_file(tmp_path, capfd):
    run = _training_run(tmp_path / "run", "run-a")
    ckpt = run / "checkpoints" / "iter_0000002"
    _write_checkpoint(run / "checkpoints" / "iter_0000001", tiny_config(4))  # an earlier one to go back to
    bert_cfg = BertConfig(**{**dataclasses.asdict(tiny_config(4)), "num_tokentypes": 2, "layernorm_order": "post"})
    bert = _write_checkpoint(tmp_path / "bert", bert_cfg, "bert")
    (ckpt / "model_tp01.pt").write_bytes((bert / "model_tp01.pt").read_bytes())
    before = _snapshot(tmp_path)
    for cmd in (["reshard", str(run), "--tp", "4"], ["export-hf", str(run)], ["export-megatron", str(run)]):
        assert main(["checkpoint", *cmd, "--out", str(tmp_path / "out")]) == 2
        err = capfd.readouterr().err
        assert f"checkpoint file {ckpt / 'model_tp01.pt'} does not hold the model of" in err, err
        assert "lacks ['transformer." in err and "Fix: write it again" in err, err
        assert f"`echo iter_0000001 > {run / 'checkpoints' / 'latest'}`" in err, err
    assert _snapshot(tmp_path) == before


def test_shards_narrower_than_meta_json_says_are_refused(tmp_path, capfd):
    """meta.json says hidden 128, the shards are 64 wide: reshard used to exit 0 writing a checkpoint
    that eval and export-hf then failed on with size-mismatch tracebacks."""
    narrow = tiny_config(4)
    ckpt = _write_checkpoint(tmp_path / "ck", narrow)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"]["hidden_size"] = 2 * narrow.hidden_size
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert main(["checkpoint", "reshard", str(ckpt), "--tp", "4", "--out", str(tmp_path / "tp4")]) == 2
    err = capfd.readouterr().err
    assert f"checkpoint file {ckpt / 'model_tp00.pt'} does not hold the model" in err, err
    assert "transformer.wte.weight is (512, 64), not (512, 128);" in err, err
    assert not (tmp_path / "tp4").exists() and not list(tmp_path.glob(".tp4*"))
    meta["tp"] = 1  # eval at the saved TP reads the file directly
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="model_tp00.pt does not hold the model"):
        rs.load_model_for_eval(ckpt, ProcessGroups.single())


# ---- 3: SIGTERM leaves no temporary directory; stale ones are removed ---------------------------

SLOW_SAVE = """
import time, torch
_save = torch.save
def _slow(*args, **kwargs):
    _save(*args, **kwargs)
    time.sleep(60)
torch.save = _slow
"""


def test_sigterm_during_reshard_removes_its_temporary_directory(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(4))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVE)  # each saved shard takes a minute, in this test only
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "repro.cli", "checkpoint", "reshard", str(ckpt), "--tp", "2",
                             "--out", str(tmp_path / "out")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.*.tmp/model_tp00.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not (tmp_path / "out").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_temporary_directories_of_dead_processes_are_removed(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(4))
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale, live, other_host = (tmp_path / f".out.{host}.{dead.pid}.tmp", tmp_path / f".out.{host}.{os.getppid()}.tmp",
                               tmp_path / f".out.elsewhere.{dead.pid}.tmp")
    for path in (stale, live, other_host):
        path.mkdir()
        (path / "model_tp00.pt").write_bytes(b"partial")
    rs.reshard(ckpt, tmp_path / "out", 1)
    assert not stale.exists() and live.exists() and other_host.exists()
    assert (tmp_path / "out" / "model_tp00.pt").is_file()


# ---- 4, 5: an --out that cannot be a new directory; an import-hf source that does not exist ---------

def test_an_out_under_a_file_or_naming_no_directory_is_refused(tmp_path, capfd, monkeypatch):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(4))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "afile").write_text("keep me")
    empty = tmp_path / "empty"
    empty.mkdir()
    before = _snapshot(tmp_path)
    for cmd in (["reshard", str(ckpt), "--tp", "1"], ["export-hf", str(ckpt)]):
        assert main(["checkpoint", *cmd, "--out", str(tmp_path / "bad" / "afile" / "sub")]) == 2
        err = capfd.readouterr().err
        assert f"{tmp_path / 'bad' / 'afile'} is a file, not a directory: choose an --out" in err, err
        monkeypatch.chdir(empty)
        assert main(["checkpoint", *cmd, "--out", "."]) == 2
        assert "--out . names no new directory: give the path of one to create" in capfd.readouterr().err
    assert _snapshot(tmp_path) == before


def test_import_hf_of_a_missing_directory_says_so(tmp_path, capfd):
    for source in (str(tmp_path / "nonexistent"), "./nonexistent", "a/b/c"):
        assert main(["checkpoint", "import-hf", source, "--out", str(tmp_path / "out")]) == 2
        err = capfd.readouterr().err
        assert f"{source}: no such directory. Fix: give a directory written by transformers' save_pretrained" in err
    assert not list(tmp_path.iterdir())

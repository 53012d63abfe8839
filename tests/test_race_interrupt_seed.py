"""`repro finetune race` after a review: a Ctrl-C ended its MLflow run FAILED (training's Ctrl-C ends it
KILLED), and the median seed was an MLflow metric, a float (a seed is an identifier: 2**62+1 was
logged as 4.611686018427388e+18)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro.cli import main
from test_race import FIXTURE, write_fixture_vocab
from test_race_inputs_review import TINY_YAML

BIG_SEEDS = (2**62 + 1, 2**62 + 3)  # above 2**53: no float holds either exactly


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def _argv(vocab: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny random BERT on the RACE fixture (10 training questions, batch 5: 2 steps an epoch)."""
    return ["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab), "--model-config",
            str(TINY_YAML), "--run-dir", str(run_dir), "--batch-size", "5", "--seq-length", "32", *extra]


def _store(tmp_path: Path, name: str = "mlflow.db") -> dict[str, str]:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / name}"}


def _launch(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """The command in a process group of its own (a terminal's Ctrl-C reaches the whole group); from
    tmp (not the checkout), so PYTHONPATH picks the code under test."""
    return subprocess.Popen([sys.executable, "-m", "repro.cli", *argv], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            cwd=log.parent, env=env, start_new_session=True)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _signal_while_fine_tuning(proc: subprocess.Popen, run_dir: Path, seed: int, sig: int, log: Path) -> str:
    """Send `sig` to the command's group once seed `seed` has logged a training step; its output."""
    deadline = time.monotonic() + 120
    while not any(f"seed{seed}/train/loss" in r for r in _rows(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, sig)
    proc.wait(timeout=120)
    return log.read_text()


def _mlflow_run(env: dict, run_dir: Path):
    import mlflow

    return mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run((run_dir / "mlflow_run_id").read_text())


def test_ctrl_c_ends_the_run_killed_exits_130_and_the_rerun_goes_on(tmp_path, vocab):
    """Ctrl-C during seed 2: exit 130 in one line, the MLflow run and run_status KILLED (were FAILED), seed
    2's logged steps noted; the same command then skips seed 1, redoes seed 2 into the same MLflow run
    without logging a step twice, and finishes it (median_seed a param there too)."""
    import mlflow

    run, env, log = tmp_path / "run", _store(tmp_path), tmp_path / "out.log"
    argv = _argv(vocab, run, "--seeds", "1", "2", "--epochs", "50")  # 100 steps a seed
    proc = _launch(argv, env, log)
    try:
        out = _signal_while_fine_tuning(proc, run, 2, signal.SIGINT, log)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    first = _mlflow_run(env, run)
    assert first.info.status == "KILLED"
    assert out.rstrip().endswith("interrupted (Ctrl-C)") and "interrupted seed 2;" in out, out[-3000:]
    assert (run / "run_status").read_text() == "KILLED" and (run / "stopped_by_signal").read_text() == "race seed 2"
    logged = max(r["step"] for r in _rows(run) if "seed2/train/loss" in r)
    stopped = json.loads((run / "seeds" / "stopped.json").read_text())
    assert (stopped["seed"], stopped["step"]) == (2, logged) and logged < 100

    again = subprocess.run([sys.executable, "-m", "repro.cli", *argv], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path, env=env)
    assert again.returncode == 0 and "seed 1: finished by an earlier run" in again.stdout, again.stdout + again.stderr
    done = _mlflow_run(env, run)
    assert done.info.run_id == first.info.run_id and done.info.status == "FINISHED"
    history = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_metric_history(done.info.run_id, "seed2/train/loss")
    assert sorted(m.step for m in history) == list(range(10, 101, 10))  # once each
    results = json.loads((run / "results.json").read_text())
    assert done.data.params["median_seed"] == str(results["median_seed"])


def test_sigterm_while_fine_tuning_stops_the_seed_killed_for_a_requeue(tmp_path, vocab):
    """TERM (scancel, a supervisor) stops after the step: exit 0 and the marker slurm/launch.sh requeues
    on, the MLflow run KILLED."""
    run, env, log = tmp_path / "run", _store(tmp_path), tmp_path / "out.log"
    proc = _launch(_argv(vocab, run, "--seeds", "1", "--epochs", "50"), env, log)
    try:
        out = _signal_while_fine_tuning(proc, run, 1, signal.SIGTERM, log)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopping: seed 1 stopped at step" in out, out[-3000:]
    assert _mlflow_run(env, run).info.status == "KILLED" and (run / "run_status").read_text() == "KILLED"
    assert (run / "stopped_by_signal").read_text() == "race seed 1"


def test_the_median_seed_is_an_exact_param_live_and_synced(tmp_path, vocab, monkeypatch):
    """median_seed was a metric: a float, 4.611686018427388e+18 for seed 2**62+1. Now the param
    "4611686018427387905", as logged live and as `repro tracking sync` uploads the run directory."""
    import mlflow

    run = tmp_path / "run"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _store(tmp_path)["MLFLOW_TRACKING_URI"])
    assert main(_argv(vocab, run, "--epochs", "1", "--seeds", *map(str, BIG_SEEDS))) == 0
    chosen = json.loads((run / "results.json").read_text())["median_seed"]
    assert chosen in BIG_SEEDS
    live = _mlflow_run(_store(tmp_path), run)
    assert live.data.params["median_seed"] == str(chosen) and "median_seed" not in live.data.metrics
    assert live.info.status == "FINISHED"
    assert json.loads((run / "params.json").read_text())["median_seed"] == str(chosen)
    assert not any("median_seed" in r for r in _rows(run))

    other = _store(tmp_path, "other.db")["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert main(["tracking", "sync", str(run)]) == 0
    synced = mlflow.MlflowClient(other).search_runs(
        [mlflow.MlflowClient(other).get_experiment_by_name("bert").experiment_id])
    assert [r.data.params["median_seed"] for r in synced] == [str(chosen)]
    assert "median_seed" not in synced[0].data.metrics and synced[0].info.status == "FINISHED"

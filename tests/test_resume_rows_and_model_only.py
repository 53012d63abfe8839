"""A relaunch after a kill -9 that redoes the steps after its checkpoint at another lr (a new
train.train_iters with optim.lr_decay_iters unset) or ends sooner replaces the killed launch's rows of
those steps, in metrics.jsonl and as MLflow's last value a step; one that changes nothing keeps them, once.
A model-only checkpoint at RUN/checkpoints or RUN is refused by `repro train run_dir=RUN`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro.tracking.run_dir import read_metrics
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")

# `repro train` that SIGKILLs itself at its KILL_AT-th step (the steps before it logged, and sent to MLflow)
_KILLED_TRAIN = """
import os, signal, sys
from repro.cli import main
from repro.tracking.logger import RunLogger
from repro.train import loop

RunLogger.FLUSH_SECONDS = 0.0
calls, step = [], loop.train_step

def step_or_die(eng, batches):
    calls.append(None)
    if len(calls) == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return step(eng, batches)

loop.train_step = step_or_die
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _train(corpus: dict, run_dir: Path, iters: int, kill_at: int = 0, store: str = "", **extra):
    """`repro train` of the tiny GPT from outside the checkout (the repro on PYTHONPATH is under test), a
    row every step, a checkpoint every 4; killed at step call `kill_at` when given."""
    over = tiny_overrides(corpus, run_dir, **{"train.train_iters": iters, "train.log_interval": 1,
                                              "train.save_interval": 4, "tracking.enabled": str(bool(store)).lower(),
                                              "tracking.experiment": "resume-rows", **extra})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT": str(kill_at), "MLFLOW_TRACKING_URI": store}
    done = subprocess.run([sys.executable, "-c", _KILLED_TRAIN, "train", TINY, *sum((["--set", o] for o in over), [])],
                          cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == (-9 if kill_at else 0), done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (lr, loss) of metrics.jsonl's step rows, each step once."""
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len({r["step"] for r in rows}) == len(rows), [r["step"] for r in rows]
    return {r["step"]: (r["lr"], r["loss"]) for r in rows}


def _mlflow_steps(store: str, run_id: str) -> dict[int, tuple[float, float]]:
    """step -> (lr, loss) as the analysis reads the MLflow run (the last value logged a step)."""
    from repro.analysis.runs import metric_history

    lr, loss = (metric_history(store, run_id, key) for key in ("lr", "loss"))
    assert list(lr["step"]) == list(loss["step"])
    return {int(s): (a, b) for s, a, b in zip(lr["step"], lr["value"], loss["value"])}


def test_a_longer_relaunch_after_a_kill_relogs_the_steps_it_redoes_at_the_new_lr(corpus, tmp_path, store):
    """Killed at step 7 of 8 (checkpoint 4); relaunched to 12 with optim.lr_decay_iters unset, so steps 5-6
    are redone at the stretched schedule's lr: their rows (and MLflow's last values) are the relaunch's, bit
    for bit those of a run killed right after checkpoint 4 and relaunched to 12 (they were the killed
    launch's lr and losses)."""
    _train(corpus, tmp_path / "reference", 8, kill_at=5)
    _train(corpus, tmp_path / "reference", 12)
    reference = _steps(tmp_path / "reference")
    assert sorted(reference) == list(range(1, 13))
    run_dir = tmp_path / "run"
    _train(corpus, run_dir, 8, kill_at=7, store=store)
    relaunch = _train(corpus, run_dir, 12, store=store)
    assert _steps(run_dir) == reference
    assert "new schedule from iteration 5: train.train_iters 8 -> 12" in relaunch.stdout, relaunch.stdout
    assert list(run_dir.glob("metrics.jsonl.before-*"))
    assert _mlflow_steps(store, (run_dir / "mlflow_run_id").read_text().strip()) == reference


def test_an_unchanged_relaunch_keeps_the_rows_and_a_shorter_one_drops_those_past_its_end(corpus, tmp_path, store):
    """Killed at step 8 of 8 (checkpoint 4; lr_decay_iters=8: the lr does not follow train_iters). A
    relaunch with the same config, killed at 8 again, keeps the rows it redoes, once, nothing set aside;
    one shortened to 6 leaves no row past 6 in metrics.jsonl, nor in the MLflow run the run dir names (a
    new one, as MLflow deletes no metric value; the killed launches' run ends KILLED). The killed
    launch's rows at 7 stayed."""
    from mlflow import MlflowClient

    run_dir, fixed = tmp_path / "run", {"optim.lr_decay_iters": 8}
    _train(corpus, run_dir, 8, kill_at=8, store=store, **fixed)
    first = _steps(run_dir)
    again = _train(corpus, run_dir, 8, kill_at=4, store=store, **fixed)  # redoes 5-7, killed at 8
    assert "new schedule" not in again.stdout and not list(run_dir.glob("metrics.jsonl.before-*"))
    assert _steps(run_dir) == first and sorted(first) == list(range(1, 8))
    dead = (run_dir / "mlflow_run_id").read_text().strip()
    shorter = _train(corpus, run_dir, 6, store=store, **fixed)
    first.pop(7)
    assert _steps(run_dir) == first and max(r["step"] for r in read_metrics(run_dir)) == 6
    assert json.loads((run_dir / "final_metrics.json").read_text())["iteration"] == 6
    assert "the run now ends at iteration 6 (train.train_iters 8 -> 6)" in shorter.stdout, shorter.stdout
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert run_id != dead and MlflowClient(store).get_run(dead).info.status == "KILLED"
    assert _mlflow_steps(store, run_id) == first
    assert MlflowClient(store).get_run(run_id).data.metrics["loss"] == first[6][1]


def test_a_model_only_checkpoint_at_the_run_dir_or_its_checkpoints_is_refused(corpus, tmp_path):
    """A reshard's output at RUN/checkpoints or RUN is not a run to resume: `repro train run_dir=RUN` exits
    2 naming it (it trained from a fresh init and wrote iter_* beside it)."""
    from repro.train.reshard import reshard

    _train(corpus, tmp_path / "src", 1)
    for out in (tmp_path / "a" / "checkpoints", tmp_path / "b"):
        reshard(tmp_path / "src" / "checkpoints", out, tp=1)
        run_dir = out.parent if out.name == "checkpoints" else out
        over = tiny_overrides(corpus, run_dir, **{"train.train_iters": 2})
        done = subprocess.run([sys.executable, "-m", "repro.cli", "train", TINY, *sum((["--set", o] for o in over), [])],
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert (f"{out} is a model-only (resharded) checkpoint without optimizer state: it cannot be resumed; "
                "train in a new run_dir") in done.stderr, done.stderr
        assert not list(run_dir.rglob("iter_*")) and not (run_dir / "metrics.jsonl").exists()

"""A run resumed on another layout is measured by its last launch only, whether the launch before was
SIGKILLed (its last rows were logged already, and still queued for MLflow) or ran offline and was
synced; a JSON-lines file whose last whole line lacks its newline keeps that line."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from repro.tracking.logger import RunLogger
from repro.tracking.run_dir import read_metrics
from repro.tracking.sync import sync_run
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")
UNREACHABLE = "http://127.0.0.1:9"

# `repro train` on one rank in this process, which sends itself STOP_SIGNAL right after the rows of
# step STOP_AFTER_STEP are written, with every MLflow row still queued (no batched flush yet)
_STOPPED_TRAIN = """
import os, signal, sys
from repro.cli import main
from repro.tracking.logger import RunLogger

step_to_stop, log = int(os.environ["STOP_AFTER_STEP"]), RunLogger.log_metrics
RunLogger.FLUSH_SECONDS = float("inf")

def log_then_stop(self, metrics, step):
    written = log(self, metrics, step)
    if step == step_to_stop and "loss" in metrics:
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))
    return written

RunLogger.log_metrics = log_then_stop
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _train(corpus: dict, run_dir: Path, experiment: str, *, nproc: int | None = None, stop: tuple = (),
           **extra) -> subprocess.CompletedProcess:
    """`repro train` of the tiny GPT for 12 iterations (a log line every 2) from outside the checkout (the
    repro under test is the one on PYTHONPATH); `stop` = (signal name, step) stops it after that step."""
    over = tiny_overrides(corpus, run_dir, **{"train.train_iters": 12, "train.log_interval": 2,
                                              "tracking.experiment": experiment, **extra})
    args = ["train", TINY, *sum((["--set", o] for o in over), []), *(["--nproc", str(nproc)] if nproc else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STOP_SIGNAL": stop[0] if stop else "",
           "STOP_AFTER_STEP": str(stop[1] if stop else -1)}
    return subprocess.run([sys.executable, "-c", _STOPPED_TRAIN, *args], cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=240)


def _intervals(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, warmup_interval, hw_tflops_per_device) of each logged interval."""
    return [(r["step"], r["warmup_interval"], r["hw_tflops_per_device"]) for r in read_metrics(run_dir)
            if "hw_tflops_per_device" in r]


def _table_row(uri: str, experiment: str):
    from repro.analysis import scaling

    measured = scaling.measured_runs(uri, experiment)
    assert len(measured) == 1, measured
    return measured.iloc[0]


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_a_resume_on_two_ranks_after_a_kill_9_is_measured_by_its_own_launch(corpus, tmp_path, store):
    """1 rank SIGKILLed after step 7 (checkpoint 4), its rows still queued for MLflow; resumed with
    --nproc 2. Steps 5-7 are redone, and the interval at 6 is logged already: the resumed launch's warm-up
    flag goes on its first interval written (8), so Table 1 measures it alone, from 10 and 12 (the flag
    went on the unwritten 6: the table took the killed launch's flag at 2 for the last launch's start and
    pooled 1 rank's 4 and 6 in). MLflow gets the killed launch's queued rows at the resume, before any
    sync (it lacked steps 1-7)."""
    run_dir = tmp_path / "run"
    killed = _train(corpus, run_dir, "hard-kill", stop=("SIGKILL", 7), **{"train.save_interval": 4,
                                                                           "tracking.enabled": "true"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    resumed = _train(corpus, run_dir, "hard-kill", nproc=2, **{"train.save_interval": 4, "tracking.enabled": "true"})
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "at iteration 4 (" in resumed.stdout, resumed.stdout
    intervals, row = _intervals(run_dir), _table_row(store, "hard-kill")
    assert row["tflops_per_device"] == pytest.approx(statistics.median(v for s, _, v in intervals if s > 8))
    assert (row["gpus"], row["dp"]) == (2, 2) and "layout changed at resume" in row["label"], row
    assert [(s, w) for s, w, _ in intervals] == [(2, 1), (4, 0), (6, 0), (8, 1), (10, 0), (12, 0)]
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert _steps(store, run_id, "loss") == list(range(1, 13))
    assert _steps(store, run_id, "warmup_interval") == [2, 4, 6, 8, 10, 12]


def test_an_offline_run_resumed_on_two_ranks_is_synced_with_the_layout_change(corpus, tmp_path, store):
    """Tracking off: 1 rank stopped by SIGTERM after step 5 (checkpointed there), resumed with --nproc 2,
    then `repro tracking sync`. params.json keeps the first launch's layout and tags.json the resume's
    change, so the synced run is labelled and measured by its last launch (it showed launch 2's layout
    alone, unlabelled, and pooled the 1-rank launch's 4 with launch 2's intervals)."""
    run_dir = tmp_path / "run"
    stopped = _train(corpus, run_dir, "offline", stop=("SIGTERM", 5))
    assert stopped.returncode == 0 and "stopping at iteration 5" in stopped.stdout, stopped.stdout + stopped.stderr
    resumed = _train(corpus, run_dir, "offline", nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    sync_run(run_dir)
    intervals, row = _intervals(run_dir), _table_row(store, "offline")
    assert [(s, w) for s, w, _ in intervals] == [(2, 1), (4, 0), (6, 1), (8, 0), (10, 0), (12, 0)]
    assert row["tflops_per_device"] == pytest.approx(statistics.median(v for s, _, v in intervals if s > 6))
    assert (row["gpus"], row["dp"]) == (2, 2) and "layout changed at resume" in row["label"], row
    params, tags, _ = _logged_run(store, row["run_id"])
    assert (params["world_size"], tags["resumed_with.world_size"], tags["resumed_with.dp"]) == ("1", "2", "2")


def _launch(run_dir: Path, params: dict, online: bool, steps: tuple, resume_run_id: str | None = None) -> RunLogger:
    """One launch of a run logging `steps` (resumed from the step before), MLflow up or down."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not online:
            patch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        logger = RunLogger(run_dir, "exp-layout", "r", params, {"slurm_job_id": params["world_size"]},
                           resume_run_id=resume_run_id)
        if steps[0] > 1:
            logger.resume_at(steps[0] - 1)
        for step in steps:
            logger.log_metrics({"loss": 10.0 - step}, step)
        logger.close()
    return logger


def _logged_run(uri: str, run_id: str) -> tuple[dict, dict, list[int]]:
    """A run's params, its tags but those naming where it came from, and its loss steps."""
    from mlflow import MlflowClient

    data = MlflowClient(uri).get_run(run_id).data
    tags = {k: v for k, v in data.tags.items() if not k.startswith("mlflow.") and k not in ("run_dir", "synced_from")}
    return data.params, tags, _steps(uri, run_id, "loss")


@pytest.mark.parametrize("first_online, then_online", [(False, False), (True, False), (False, True)])
def test_a_layout_change_at_resume_gives_the_same_run_live_or_synced(tmp_path, store, first_online, then_online):
    """Launch 1 on 1 rank, a resume on 2 (a new param too), each MLflow up or down, then a sync: the
    same params (the first launch's, the new one added), tags (the first launch's, resumed_with.*) and
    rows as a run logged live throughout."""
    layouts = ({"world_size": "1", "lr": "0.1"}, {"world_size": "2", "lr": "0.1", "num_hosts": "1"})

    def run(name: str, online: tuple[bool, bool]) -> tuple[dict, dict, list[int]]:
        run_dir = tmp_path / name
        first = _launch(run_dir, layouts[0], online[0], (1, 2))
        _launch(run_dir, layouts[1], online[1], (3, 4), resume_run_id=first.run_id)
        sync_run(run_dir)
        return _logged_run(store, (run_dir / "mlflow_run_id").read_text().strip())

    live = run("live", (True, True))
    assert live == ({"world_size": "1", "lr": "0.1", "num_hosts": "1"},
                    {"slurm_job_id": "1", "resumed_with.world_size": "2"}, [1, 2, 3, 4])
    assert run("mixed", (first_online, then_online)) == live


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    """zero_shot.jsonl saved by an editor without a final newline: the next evaluation's record goes
    after it (the record was cut: [5, 9]); a line a killed writer left unfinished is still cut."""
    from repro.eval.report import EvalRecord, read_records, write_json

    path = tmp_path / "zero_shot.jsonl"
    records = [EvalRecord("wikitext", {"ppl": 30.0}, {"iteration": i}) for i in (5, 7, 9)]
    path.write_text("\n".join(json.dumps(r.__dict__, sort_keys=True) for r in records[:2]))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        write_json(records[2], path)
    assert [r.params["iteration"] for r in read_records(path)] == [5, 7, 9] and not said
    path.write_text(path.read_text() + '{"task": "wikitext", "metr')
    with pytest.warns(UserWarning, match="dropped an unfinished last line"):
        write_json(records[2], path)
    assert [r.params["iteration"] for r in read_records(path)] == [5, 7, 9, 9]


def test_a_metrics_row_without_its_newline_is_kept_by_the_next_launch(tmp_path):
    """The same for metrics.jsonl, which a resumed launch appends to (the row was cut: [2])."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": 9.0}')
    logger = RunLogger(run_dir, "exp", "r", {}, {}, use_mlflow=False)
    logger.log_metrics({"loss": 8.0}, 2)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_ctrl_c_of_a_run_without_a_launcher_ends_its_mlflow_run_killed_not_failed(corpus, tmp_path, store):
    """`repro train` on one process (or a torchrun rank) takes Ctrl-C as a KeyboardInterrupt wherever it
    stands: the run was closed FAILED, as a crash is. Now KILLED (as `--nproc`'s forwarded stop and RACE's
    Ctrl-C end it), exit 130 with one line, and the checkpoint before it is kept."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    out = _train(corpus, run_dir, "ctrl-c", stop=("SIGINT", 6), **{"train.save_interval": 4, "tracking.enabled": "true"})
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.rstrip().endswith("interrupted (Ctrl-C)"), out.stderr[-2000:]
    assert (run_dir / "run_status").read_text().strip() == "KILLED"
    run = MlflowClient(store).get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "KILLED"
    assert (run_dir / "checkpoints" / "latest").exists()

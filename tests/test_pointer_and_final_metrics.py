"""A damaged checkpoints/latest, and a kill between the last checkpoint and final_metrics.json.

Every run is a real `repro train` of the tiny GPT in a subprocess whose cwd is outside the checkout and
which inherits PYTHONPATH (so PYTHONPATH=<an older tree> runs that tree's code: the old-code check).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import train_fixtures
from train_fixtures import tiny_overrides

corpus, data_dir, data_mirror = train_fixtures.corpus, train_fixtures.data_dir, train_fixtures.data_mirror  # fixtures

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")
LAYOUT = {"train.train_iters": 10, "train.save_interval": 5, "train.eval_interval": 5, "train.log_interval": 2}
KILL_MARK = "[kill-before-final-metrics]"
# SIGKILL the process at the os.replace that publishes final_metrics.json: after the last checkpoint
# (finish_save's replaces precede it) and before the file exists. Deterministic: no timer.
KILL_HOOK = f"""
import os, signal, sys
_replace = os.replace
def replace(src, dst, *a, **k):
    if str(dst).endswith("final_metrics.json"):
        sys.stderr.write("{KILL_MARK}\\n"); sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return _replace(src, dst, *a, **k)
os.replace = replace
"""


def _repro(cwd: Path, *args: str, hook: Path | None = None) -> subprocess.CompletedProcess:
    path = os.environ.get("PYTHONPATH") or str(ROOT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hook}{os.pathsep}{path}" if hook else path}
    return subprocess.run([sys.executable, "-m", "repro.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _train(corpus: dict, run_dir: Path, hook: Path | None = None) -> subprocess.CompletedProcess:
    sets = [arg for kv in tiny_overrides(corpus, run_dir, **LAYOUT) for arg in ("--set", kv)]
    return _repro(run_dir.parent, "train", TINY, *sets, hook=hook)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    """A finished tiny run: checkpoints iter_0000005 and iter_0000010, final_metrics.json."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = _train(corpus, run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def _eval(tmp_path: Path, run_dir: Path, mirror: Path) -> subprocess.CompletedProcess:
    return _repro(tmp_path, "eval", "lambada", "--checkpoint", str(run_dir), "--data-dir", str(mirror),
                  "--max-examples", "2", "--batch-size", "2", "--no-mlflow")


def _refused_with_the_fix(done: subprocess.CompletedProcess, pointer: Path, what: str) -> None:
    """Exit 2, no traceback, the complete checkpoints newest first and the command that points `latest`
    at the newest; no advice to remove anything."""
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert what in out, out[-3000:]
    assert "iter_0000010, iter_0000005" in out and f"`echo iter_0000010 > {pointer}`" in out, out[-3000:]
    assert "remove" not in out.lower(), out[-3000:]


@pytest.mark.parametrize("content", [b"", b"\x00\xff garbage"], ids=["empty", "binary"])
def test_train_refuses_a_damaged_latest_pointer_with_the_fix(uninterrupted, corpus, tmp_path, content):
    """`latest` empty (the checkpoints root itself under the old read, with advice to remove it) or binary
    (UnicodeDecodeError): `repro train` exits 2 and says how to point it at the newest complete checkpoint;
    the checkpoints are all still there, and the fix given works."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    pointer = run_dir / "checkpoints" / "latest"
    pointer.write_bytes(content)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    _refused_with_the_fix(_train(corpus, run_dir), pointer, f"{pointer} is damaged")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    if content:
        return
    pointer.write_text("iter_0000010")  # the fix given: a finished run, nothing to train
    done = _train(corpus, run_dir)
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_eval_refuses_a_damaged_latest_pointer_with_the_fix(uninterrupted, tmp_path, data_mirror):
    """`repro eval` of the run dir likewise, for any `latest` that is not a name finish_save writes; and
    `latest` naming a directory without meta.json gets the same fix, not `remove the broken directory`."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    pointer = run_dir / "checkpoints" / "latest"
    for content in (b"\n", b"\xff\xfe\x00", b"../..", b"iter_12", b"iter_0000010/../.."):
        pointer.write_bytes(content)
        _refused_with_the_fix(_eval(tmp_path, run_dir, data_mirror), pointer, f"{pointer} is damaged")
    (run_dir / "checkpoints" / "iter_0000015").mkdir()  # a kill mid-copy, say: no meta.json
    pointer.write_text("iter_0000015")
    _refused_with_the_fix(_eval(tmp_path, run_dir, data_mirror), pointer, "names iter_0000015, which has no meta.json")


def test_a_relaunch_after_a_kill_before_final_metrics_writes_the_same_final_metrics(
        uninterrupted, corpus, tmp_path):
    """SIGKILL after the checkpoint at train_iters, before final_metrics.json: the relaunch runs no step,
    and its final_metrics.json has the uninterrupted run's keys, with the same values for the deterministic
    ones (same process count, CPU, no dropout: equal up to 1e-12 relative, in practice bit-equal). The
    timings (ms/iter and what follows from it, memory) are the killed launch's, which differ from run to run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    run_dir = tmp_path / "run"
    killed = _train(corpus, run_dir, hook=hook)
    assert killed.returncode == -signal.SIGKILL and KILL_MARK in killed.stderr, killed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000010"
    assert not (run_dir / "final_metrics.json").exists()
    done = _train(corpus, run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "running only its held-out evaluation and final metrics" in done.stdout, done.stdout[-3000:]
    want = json.loads((uninterrupted / "final_metrics.json").read_text())
    got = json.loads((run_dir / "final_metrics.json").read_text())
    assert sorted(got) == sorted(want), sorted(set(want) ^ set(got))
    timing = {"ms_per_iter", "tokens_per_s", "tflops_per_device", "mfu", "hw_tflops_per_device", "hfu", "memory_gb"}
    for key in sorted(set(want) - timing):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=0), (key, got[key], want[key])
    for key in sorted(timing & set(want)):
        assert isinstance(got[key], float) and got[key] >= 0, (key, got[key])

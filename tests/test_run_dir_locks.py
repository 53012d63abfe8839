"""One job at a time in a run dir or on a dataset prefix (RUN_DIR/.lock, PREFIX.lock), and a repeated
`--set KEY` whose last value wins. Real processes: a training holds its run dir while a second
`repro train` is refused; a `repro data prepare` paused mid-publish (sitecustomize.py) holds its
prefix while a second is refused. Only the CLI and files are used, so the tests also run against
another checkout of repro (PYTHONPATH, with the subprocesses' cwd outside this one)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_fixtures
from train_fixtures import tiny_overrides

corpus, data_dir, data_mirror = train_fixtures.corpus, train_fixtures.data_dir, train_fixtures.data_mirror  # fixtures

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")
PAUSE_AT_PUBLISH = '''\
import os, time
_replace = os.replace
def replace(src, dst, *a, **k):  # the first rename to a PAUSE_PREFIX* name waits for PAUSE_GO (<= 120 s)
    prefix = os.environ.get("PAUSE_PREFIX")
    if prefix and str(dst).startswith(prefix) and not os.path.exists(os.environ["PAUSE_AT"]):
        open(os.environ["PAUSE_AT"], "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.environ["PAUSE_GO"]) and time.time() < deadline:
            time.sleep(0.05)
    return _replace(src, dst, *a, **k)
os.replace = replace
'''


def _cli(cwd: Path, *args, env_extra=None, log: Path | None = None) -> subprocess.Popen:
    """`repro ARGS` in a subprocess run from `cwd` (the repro imported is PYTHONPATH's, else the installed
    one); its output in `log`, else a pipe (for a command that ends soon: a full pipe would block it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "repro.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=out, stderr=subprocess.STDOUT)


def _train_args(corpus, run_dir: Path, **extra) -> list[str]:
    return ["train", TINY, *(a for o in tiny_overrides(corpus, run_dir, **extra) for a in ("--set", o))]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def _loss_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "loss" in row]


# ---- 1: a second training in a run dir in use is refused on every rank; a later one resumes -------

def test_a_second_training_in_a_run_dir_in_use_is_refused_and_a_later_one_resumes(corpus, tmp_path):
    """Job A trains (Slurm job 4242); B in its run dir, on one rank and on two, exits 2 at once naming
    the run dir, A's host, pid and Slurm job and the fix, with no traceback, and writes nothing: a
    half-written checkpoint directory (A's save under way) survives and A's metrics have each step once
    (before: B trained too and exited 0, its rows among A's and its save removing A's .tmp). After A
    stops (SIGTERM: it checkpoints), C in that run dir resumes from A's checkpoint."""
    run_dir, log = tmp_path / "run", tmp_path / "a.log"
    schedule = {"optim.lr_decay_iters": 100000, "train.save_interval": 100000}
    a = _cli(tmp_path, *_train_args(corpus, run_dir, **schedule, **{"train.train_iters": 100000}),
             env_extra={"SLURM_JOB_ID": "4242"}, log=log)
    try:
        _wait_for(run_dir / "config.yaml", a)  # A is past setup
        live = run_dir / "checkpoints" / "iter_0099999.tmp"  # as a save under way leaves it
        live.mkdir(parents=True)
        for extra in ([], ["--nproc", "2"]):
            b = _cli(tmp_path, *_train_args(corpus, run_dir, **schedule, **{"train.train_iters": 4}), *extra)
            out = b.communicate(timeout=300)[0]
            assert b.returncode == 2, out[-3000:]
            assert f"run_dir {run_dir} is in use by another training job" in out, out[-3000:]
            assert f"host {socket.gethostname()}, pid {a.pid}, Slurm job 4242" in out, out[-3000:]
            assert "Fix:" in out and "REPRO_RUN_NAME" in out and "Traceback" not in out, out[-3000:]
            assert "iteration" not in out and live.is_dir(), out[-3000:]
        assert a.poll() is None, log.read_text()[-3000:]
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if a.poll() is None:
            a.kill()
    steps = _loss_steps(run_dir)
    assert steps == sorted(set(steps)), steps
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("iter_"))
    c = _cli(tmp_path, *_train_args(corpus, run_dir, **schedule, **{"train.train_iters": stopped_at + 1}))
    out = c.communicate(timeout=300)[0]
    assert c.returncode == 0 and f"at iteration {stopped_at}" in out and "resumed from" in out, out[-3000:]


# ---- 2: a second prepare of one prefix is refused, even in the first one's publishing window --------

def _jsonl(path: Path, n: int, word: str) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} {i} " * 40}) + "\n" for i in range(n)))
    return path


def _prepare_args(data_dir: Path, source: Path, prefix: Path) -> list[str]:
    return ["data", "prepare", "--input", str(source), "--output-prefix", str(prefix), "--data-dir",
            str(data_dir), "--workers", "1", "--no-progress", "--no-eval-filter", "--min-tokens", "0",
            "--split", "1,0,0"]


def test_a_second_prepare_of_one_prefix_is_refused_while_the_first_publishes(data_dir, tmp_path):
    """A prepare held (sitecustomize) just before its first rename into the prefix, its temporary
    files named by host and pid; B of another corpus to that prefix, without --overwrite, exits 2
    naming the prefix, A's pid and the fix, no traceback; A then publishes a whole dataset of its own
    (before: B passed check_outputs, which ran only at its start, and published between A's renames:
    exit 0 both, and a .bin of one corpus with the .idx of the other)."""
    (tmp_path / "sc").mkdir()
    (tmp_path / "sc" / "sitecustomize.py").write_text(PAUSE_AT_PUBLISH)
    prefix, paused, go = tmp_path / "out" / "corp", tmp_path / "paused", tmp_path / "go"
    a_corpus, b_corpus = _jsonl(tmp_path / "a.jsonl", 30, "alpha"), _jsonl(tmp_path / "b.jsonl", 50, "beta")
    path = os.pathsep.join(filter(None, [str(tmp_path / "sc"), os.environ.get("PYTHONPATH")]))
    a = _cli(tmp_path, *_prepare_args(data_dir, a_corpus, prefix),
             env_extra={"PYTHONPATH": path, "PAUSE_PREFIX": f"{prefix}_", "PAUSE_AT": str(paused), "PAUSE_GO": str(go)})
    try:
        _wait_for(paused, a)
        staged = sorted(p.name for p in prefix.parent.glob("corp.tmp*"))
        b = _cli(tmp_path, *_prepare_args(data_dir, b_corpus, prefix))
        out = b.communicate(timeout=300)[0]
        go.touch()
        assert a.wait(timeout=300) == 0, a.stdout.read()[-3000:]
    finally:
        go.touch()
        if a.poll() is None:
            a.kill()
    assert b.returncode == 2, out[-3000:]
    assert f"--output-prefix {prefix}: another `repro data prepare` is writing this dataset" in out, out
    assert f"pid {a.pid}" in out and "Fix:" in out and "Traceback" not in out, out
    assert staged and all(f"{socket.gethostname()}-{a.pid}" in name for name in staged), staged
    report = json.loads(Path(f"{prefix}_prepare.json").read_text())
    assert report["options"]["input"] == [str(a_corpus)], report["options"]
    check = _cli(tmp_path, "data", "verify", str(prefix))
    assert check.wait(timeout=300) == 0, check.stdout.read()[-3000:]


# ---- 3: a repeated --set key: the last value wins ---------------------------------------------------

def test_a_repeated_set_key_takes_its_last_value(tmp_path):
    """slurm/launch.sh's smoke mode sets data.cache_dir and tracking.experiment; a user's own --set of
    them comes later and wins (before: a RunConfigError saying YAML reads the value as the other one,
    ' #' starting a comment). The text check still applies to the value that is kept."""
    from repro.train.config import RunConfigError, load_config

    sets = [f"data.cache_dir={tmp_path}/a", "tracking.experiment=slurm-smoke", f"data.cache_dir={tmp_path}/b",
            "tracking.experiment=mine"]
    cfg = load_config(TINY, sets)
    assert (cfg.data.cache_dir, cfg.tracking.experiment) == (f"{tmp_path}/b", "mine")
    assert load_config(TINY, ["name=x #1", "name=y"]).name == "y"
    with pytest.raises(RunConfigError, match=r"--set name=y #2: YAML reads the value as 'y'"):
        load_config(TINY, ["name=x", "name=y #2"])

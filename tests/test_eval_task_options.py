"""`repro eval wikitext|lambada` refuses the other task's options (`eval lambada --window 32` was accepted
and ignored), and slurm/zeroshot_eval.sh, which holds one argument list for both tasks, gives each task
its own (through `repro eval TASK ... --print-args`): lambada gets no --window, a user's --max-examples
reaches lambada only."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eval_helpers import mirror, write_tiny_checkpoint

WRONG = [("lambada", ["--window", "32"], "--window", "wikitext"),
         ("lambada", ["--stride", "16"], "--stride", "wikitext"),
         ("lambada", ["--file", "raw"], "--file", "wikitext"),
         ("lambada", ["--max-lines", "5"], "--max-lines", "wikitext"),
         ("lambada", ["--win", "0"], "--window", "wikitext"),  # argparse's abbreviation, and a 0
         ("wikitext", ["--max-examples", "10"], "--max-examples", "lambada"),
         ("wikitext", ["--non-strict"], "--non-strict", "lambada"),
         ("wikitext", ["--megatron-split"], "--megatron-split", "lambada")]
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo localhost ;;
  "show job") echo "JobId=$3 JobName=zeroshot_eval Requeue=1 Command=/x.sh WorkDir=/w" ;;
esac
"""


def _code_root() -> Path:
    """The checkout whose `repro` package runs (PYTHONPATH's when set): its slurm/ scripts go with it."""
    import repro

    return Path(repro.__file__).resolve().parents[1]


def _repro(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m repro.cli ARGV` outside the checkout (the package on the path runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "repro.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A training run directory holding a tiny untrained GPT (64 positions)."""
    run_dir = tmp_path_factory.mktemp("gpt") / "run"
    write_tiny_checkpoint(run_dir, seq_length=64, num_layers=1)
    return run_dir


@pytest.mark.parametrize("task, given, named, other", WRONG, ids=[f"{t}-{g[0]}" for t, g, _, _ in WRONG])
def test_eval_refuses_the_other_tasks_option(run, tmp_path, task, given, named, other):
    """Exit 2 naming the option, the task it belongs to and the fix, before the checkpoint loads."""
    done = _repro(tmp_path, "eval", task, "--checkpoint", str(run), "--data-dir", str(tmp_path), *given)
    assert done.returncode == 2, done.stderr
    assert f"error: {named} applies to `repro eval {other}` only, not {task}" in done.stderr, done.stderr
    assert f"Fix: drop {named} from the `repro eval {task}` command" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "" and not (run / "zero_shot.jsonl").exists()


def test_eval_names_every_option_of_the_other_task_at_once(run, tmp_path):
    done = _repro(tmp_path, "eval", "lambada", "--checkpoint", str(run), "--stride", "8", "--max-lines", "3")
    assert done.returncode == 2 and "--stride, --max-lines apply to `repro eval wikitext` only" in done.stderr


@pytest.mark.parametrize("task, own, expected", [
    ("lambada", ["--max-examples", "2", "--non-strict", "--megatron-split", "--batch-size", "2"],
     {"max_examples": 2, "strict": False, "megatron_split": True}),
    ("wikitext", ["--window", "64", "--max-lines", "5", "--file", "tokens"],
     {"window": 64, "stride": 32, "max_lines": 5, "file": "wikitext-2.test.tokens"}),  # stride: the default
])
def test_eval_with_its_own_and_the_common_options_runs_them(run, tmp_path, task, own, expected):
    out = tmp_path / "eval.jsonl"
    done = _repro(tmp_path, "eval", task, "--checkpoint", str(run), "--data-dir", str(mirror()), "--tp", "1",
                  "--no-mlflow", "--out", str(out), *own)
    assert done.returncode == 0, done.stderr[-3000:]
    params = json.loads(out.read_text())["params"]
    assert {key: params[key] for key in expected} == expected, params


def test_print_args_keeps_the_common_options_and_the_tasks_own(tmp_path):
    given = ["--checkpoint", "/runs/a b", "--window", "64", "--max-examples", "3", "--tp", "0", "--non-strict",
             "--file=raw", "--no-mlflow", "--out=-o.jsonl"]
    lines = {task: _repro(tmp_path, "eval", task, *given, "--print-args") for task in ("wikitext", "lambada")}
    assert [d.returncode for d in lines.values()] == [0, 0], [d.stderr for d in lines.values()]
    assert lines["wikitext"].stdout == "'--checkpoint=/runs/a b' --tp=0 --out=-o.jsonl --no-mlflow --window=64 --file=raw\n"
    assert lines["lambada"].stdout == \
        "'--checkpoint=/runs/a b' --tp=0 --out=-o.jsonl --no-mlflow --max-examples=3 --non-strict\n"
    again = _repro(tmp_path, "eval", "lambada", *shlex.split(lines["lambada"].stdout), "--print-args")
    assert again.stdout == lines["lambada"].stdout, again.stderr  # (a value starting with "-" survives: --out=-o.jsonl)


def test_every_eval_option_is_common_or_one_tasks():
    """--print-args passes on only the options it knows: a new `repro eval` option must be classified."""
    import argparse

    from repro.eval import commands

    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    (eval_parser,) = parser._subparsers._group_actions[0].choices.values()
    dests = {a.dest for a in eval_parser._actions} - {"help", "task", "print_args"}
    assert dests == set(commands.COMMON_OPTIONS) | {d for own in commands.TASK_OPTIONS.values() for d in own}


def _eval_job(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`bash slurm/zeroshot_eval.sh ARGS` as a job runs it, with the real `repro`, a fake scontrol and no
    Slurm, on a run dir whose checkpoint is a GPT: its exit status and everything it printed."""
    root, bin_dir = _code_root(), tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    ckpt = tmp_path / "train" / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"tp": 1, "family": "gpt", "iteration": 1}))
    (ckpt.parent / "latest").write_text("iter_0000001")
    (tmp_path / "cluster.env").write_text(f"REPRO_RUNS_DIR={tmp_path}/runs\nREPRO_DATA_DIR={tmp_path}/data\n"
                                          "REPRO_ENV_ACTIVATE=none\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "REPRO_", "NCCL_SOCKET", "GLOO_SOCKET", "MLFLOW_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               REPRO_ROOT=str(root), REPRO_CLUSTER_ENV=str(tmp_path / "cluster.env"), SLURM_JOB_ID="42",
               SLURM_NTASKS="2", SLURM_JOB_NAME="zeroshot_eval", SLURM_JOB_NODELIST="localhost",
               REPRO_EVAL_CHECKPOINT=str(tmp_path / "train"), OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(root / "slurm" / "zeroshot_eval.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "runs").glob("*/logs/*.out")))
    return done.returncode, logs + done.stdout + done.stderr


def _steps(log: str) -> dict[str, list[str]]:
    """The `repro eval TASK` arguments of each step the job printed."""
    found = re.findall(r"step: srun .* repro eval (\w+) (.*)$", log, re.M)
    return {task: rest.split() for task, rest in found}


def test_smoke_job_gives_each_task_its_own_options_and_the_users_go_to_their_task(tmp_path):
    """--smoke's settings and a user's `--max-examples 3` (after them: it wins) are split per task."""
    code, log = _eval_job(tmp_path, "--smoke", "--dry-run", "--max-examples", "3")
    assert code == 0, log
    steps = _steps(log)
    assert list(steps) == ["wikitext", "lambada"], log
    common = [f"--checkpoint={tmp_path / 'train'}", f"--data-dir={tmp_path / 'data'}", "--tp=2"]
    assert steps["wikitext"] == [*common, "--window=64", "--stride=32", "--file=tokens", "--max-lines=40"]
    assert steps["lambada"] == [*common, "--max-examples=3"]


def test_job_with_a_misspelt_option_stops_before_either_step(tmp_path):
    code, log = _eval_job(tmp_path, "--dry-run", "--max-exmaples", "3")
    assert code == 2 and "unrecognized arguments: --max-exmaples 3" in log and "step:" not in log, log

"""Bad input to the smaller commands (tracking sync, report, data prepare, slurm, selftest, eval,
finetune race, scaling-model): exit code 2, a message naming the problem and the fix, nothing
already written changed."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest

from eval_helpers import mirror

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = "http://127.0.0.1:9"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from repro.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""What repro.tracking.store.quiet_http_retries puts in force (MLflow reads both at every request):
one retry, 10 s per request, against MLflow's default 7 retries backing off to 120 s each (minutes)."""


def _unset_retry_settings(monkeypatch) -> None:
    """Neither MLflow retry setting set (as on a fresh login), restored after the test: the command
    under test must put its own in force. (A plain delenv of an absent variable would not undo what
    the command sets.)"""
    for name in FAIL_FAST:
        monkeypatch.setenv(name, "unset by the test")
        monkeypatch.delenv(name)


def _retry_settings() -> dict[str, str | None]:
    import os

    return {name: os.environ.get(name) for name in FAIL_FAST}


# --- repro tracking sync ---------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _offline_run(run_dir: Path, steps: int = 3) -> Path:
    """A run directory as `repro train` leaves it when MLflow was unreachable (a closed port)."""
    from repro.tracking.logger import RunLogger

    with pytest.MonkeyPatch.context() as mp, pytest.warns(UserWarning, match="MLflow tracking unavailable"):
        mp.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        logger = RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {"family": "gpt"})
    assert logger.run_id is None and not (run_dir / "mlflow_run_id").exists()
    for step in range(1, steps + 1):
        logger.log_metrics({"loss": 1.0 / step}, step)
    logger.close()
    return run_dir


def _runs(uri: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("exp-sync")
    return client.search_runs([exp.experiment_id]) if exp else []


def test_sync_twice_and_a_live_run_never_duplicate(tmp_path, store, capsys):
    from mlflow import MlflowClient

    from repro.tracking.logger import RunLogger

    run_dir = _offline_run(tmp_path / "run")
    assert _cli(capsys, "tracking", "sync", str(run_dir))[0] == 0
    first = (run_dir / "mlflow_run_id").read_text()
    rc, out, _ = _cli(capsys, "tracking", "sync", str(run_dir))
    assert rc == 0 and "nothing to sync" in out and first in out
    assert [r.info.run_id for r in _runs(store)] == [first] == [(run_dir / "mlflow_run_id").read_text()]
    # a live run: already in the store, so sync changes nothing
    with RunLogger(tmp_path / "live", "exp-sync", "live", {"lr": "0.1"}, {}) as live:
        live.log_metrics({"loss": 2.0}, 1)
    rc, out, _ = _cli(capsys, "tracking", "sync", str(tmp_path / "live"))
    assert rc == 0 and "nothing to sync" in out and len(_runs(store)) == 2
    # the live run lost its server after step 1: sync completes that run, sending only step 2
    with open(tmp_path / "live" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "time": time.time(), "loss": 1.5}) + "\n")
    rc, out, _ = _cli(capsys, "tracking", "sync", str(tmp_path / "live"))
    assert rc == 0 and f"updated MLflow run {live.run_id}" in out and "1 metric values" in out
    assert [m.step for m in MlflowClient(store).get_metric_history(live.run_id, "loss")] == [1, 2]
    assert len(_runs(store)) == 2
    rc, out, _ = _cli(capsys, "tracking", "sync", str(tmp_path / "live"))
    assert rc == 0 and "nothing to sync" in out


def test_a_synced_run_resumes_into_the_same_mlflow_run(tmp_path, store, capsys):
    """What repro.train.loop does on resume, given the id sync leaves in RUN_DIR/mlflow_run_id."""
    from mlflow import MlflowClient

    from repro.tracking.logger import RunLogger
    from repro.tracking.run_dir import recorded_run_id

    run_dir = _offline_run(tmp_path / "run")
    assert _cli(capsys, "tracking", "sync", str(run_dir))[0] == 0
    with RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {}, resume_run_id=recorded_run_id(run_dir)) as resumed:
        resumed.log_metrics({"loss": 0.2}, 4)
    assert [r.info.run_id for r in _runs(store)] == [resumed.run_id] == [recorded_run_id(run_dir)]
    assert [m.step for m in MlflowClient(store).get_metric_history(resumed.run_id, "loss")] == [1, 2, 3, 4]


def test_sync_skips_a_truncated_last_line_and_names_a_bad_middle_line(tmp_path, store, capsys):
    from mlflow import MlflowClient

    run_dir = _offline_run(tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "time": 1.0, "lo')  # a killed run's last line
    (run_dir / "final_metrics.json").write_text('{"iteration": 3}')  # its end was written: sync finishes it
    with pytest.warns(UserWarning, match="truncated last line"):
        assert _cli(capsys, "tracking", "sync", str(run_dir))[0] == 0
    run_id = (run_dir / "mlflow_run_id").read_text()
    assert MlflowClient(store).get_run(run_id).info.status == "FINISHED"
    assert len(MlflowClient(store).get_metric_history(run_id, "loss")) == 3
    bad = _offline_run(tmp_path / "bad")
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    (bad / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    before = _snapshot(bad)
    rc, _, err = _cli(capsys, "tracking", "sync", str(bad))
    assert rc == 2 and "metrics.jsonl:2 is not JSON" in err and "Fix:" in err
    assert _snapshot(bad) == before and len(_runs(store)) == 1


def test_a_resumed_run_drops_the_killed_runs_unfinished_row(tmp_path):
    from repro.tracking.logger import RunLogger
    from repro.tracking.run_dir import read_metrics

    run_dir = _offline_run(tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "time": 1.0, "lo')
    with pytest.warns(UserWarning, match="dropped an unfinished last line"):
        logger = RunLogger(run_dir, "exp-sync", "r1", {"lr": "0.1"}, {}, use_mlflow=False)
    logger.log_metrics({"loss": 0.2}, 4)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.parametrize("missing, needle", [("metrics.jsonl", "no metrics to upload"),
                                             ("tags.json", "experiment and run name")])
def test_sync_names_a_missing_file(tmp_path, store, capsys, missing, needle):
    run_dir = _offline_run(tmp_path / "run")
    (run_dir / missing).unlink()
    before = _snapshot(run_dir)
    rc, _, err = _cli(capsys, "tracking", "sync", str(run_dir))
    assert rc == 2 and f"{missing} is missing" in err and needle in err and "Fix:" in err
    assert _snapshot(run_dir) == before and _runs(store) == []


def test_sync_to_an_unreachable_server_names_the_uri(tmp_path, monkeypatch, capsys):
    """Fails fast (one quick retry, not MLflow's minutes of them: the settings in force are the
    mechanism, not a wall-clock bound a loaded runner could break) and changes nothing."""
    run_dir = _offline_run(tmp_path / "run")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
    _unset_retry_settings(monkeypatch)
    before = _snapshot(run_dir)
    rc, _, err = _cli(capsys, "tracking", "sync", str(run_dir))
    assert rc == 2 and UNREACHABLE in err and "rerun `repro tracking sync" in err
    assert _snapshot(run_dir) == before and _retry_settings() == FAIL_FAST


# --- repro report ----------------------------------------------------------------------------------

@pytest.mark.parametrize("uri, needle", [(UNREACHABLE, "could not be read"), ("foo://bar", "unknown scheme foo://"),
                                         ("mlruns/mlflow.db", "is a path, not a URI")])
def test_report_names_a_bad_or_unreachable_store(tmp_path, capsys, monkeypatch, uri, needle):
    """Refused before any notebook runs (no --out folder); the unreachable server after one quick
    retry (the settings in force), a bad URI before any request (none in force)."""
    _unset_retry_settings(monkeypatch)
    rc, out, err = _cli(capsys, "report", "--tracking-uri", uri, "--out", str(tmp_path / "out"))
    assert rc == 2 and needle in err and uri in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and "executing" not in out
    assert _retry_settings() == (FAIL_FAST if uri == UNREACHABLE else dict.fromkeys(FAIL_FAST))


# --- repro data prepare ----------------------------------------------------------------------------

@pytest.fixture
def data_dir() -> Path:
    return mirror()


def _prepare(capsys, data_dir: Path, src: Path, prefix: Path, *extra: str) -> tuple[int, str, str]:
    return _cli(capsys, "data", "prepare", "--input", str(src), "--output-prefix", str(prefix), "--data-dir",
                str(data_dir), "--workers", "1", "--split", "1,0,0", "--min-tokens", "0", "--no-dedup",
                "--no-eval-filter", "--no-progress", *extra)


def test_prepare_refuses_to_overwrite_and_overwrite_loses_nothing_on_failure(data_dir, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} " * 5}) + "\n" for i in range(6)))
    prefix = tmp_path / "out" / "c"
    assert _prepare(capsys, data_dir, src, prefix)[0] == 0
    first = _snapshot(tmp_path / "out")
    rc, _, err = _prepare(capsys, data_dir, src, prefix)
    assert rc == 2 and "already there" in err and "c_train.bin" in err and "--overwrite" in err
    rc, _, err = _prepare(capsys, data_dir, src, prefix, "--overwrite", "--min-tokens", "100000")
    assert rc == 2 and "none of its 6 documents survived" in err
    assert _snapshot(tmp_path / "out") == first  # a failed overwrite leaves the old dataset whole
    src.write_text(json.dumps({"text": "just one other document"}) + "\n")
    assert _prepare(capsys, data_dir, src, prefix, "--overwrite")[0] == 0
    assert json.loads((tmp_path / "out" / "c_prepare.json").read_text())["report"]["kept"] == 1
    assert sorted(_snapshot(tmp_path / "out")) == sorted(first)  # no temporary files left behind


BAD_PREPARE_FLAGS = {"threshold": ["--dedup-threshold", "2"], "min_tokens": ["--min-tokens", "-1"],
                     "matches": ["--eval-min-matches", "0"]}


@pytest.mark.parametrize("bad, needle", [("threshold", "--dedup-threshold 2.0 is not"),
                                         ("min_tokens", "--min-tokens -1 is negative"),
                                         ("matches", "--eval-min-matches 0 would mark every document"),
                                         ("dir", "is a directory without corpus files")])
def test_prepare_names_a_bad_threshold_or_a_directory_without_corpus(data_dir, tmp_path, capsys, bad, needle):
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a corpus file")
    argv = ["data", "prepare", "--input", str(tmp_path / "notes" if bad == "dir" else src), "--output-prefix",
            str(tmp_path / "out" / "c"), "--data-dir", str(data_dir), "--no-progress"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc, _, err = _cli(capsys, *argv, *BAD_PREPARE_FLAGS.get(bad, []))
    assert rc == 2 and needle in err and "Fix:" in err and not (tmp_path / "out").exists()
    if bad == "dir":  # the file it passes over is named too
        assert any("1 files are not read, e.g. README.md" in str(w.message) for w in seen), seen


# --- repro slurm submit / sweep --------------------------------------------------------------------

@pytest.mark.parametrize("env_text, needle", [
    (None, "does not exist"),
    ("REPRO_PARTITION=gpu\n", "REPRO_RUNS_DIR (the shared directory for run directories)"),
    ("REPRO_RUNS_DIR=/shared/runs\nif then\n", "syntax error"),
])
def test_submit_refuses_cluster_settings_launch_sh_would_refuse(tmp_path, monkeypatch, capsys, env_text, needle):
    env_file = tmp_path / "cluster.env"
    if env_text is not None:
        env_file.write_text(env_text)
    monkeypatch.setenv("REPRO_CLUSTER_ENV", str(env_file))
    monkeypatch.delenv("REPRO_RUNS_DIR", raising=False)
    rc, out, err = _cli(capsys, "slurm", "submit", "--dry-run", str(ROOT / "slurm/gpt2_355m.sh"))
    assert rc == 2 and needle in err and "cluster.env" in err and "sbatch" not in out
    if env_text is not None:
        assert str(env_file) in err or "cp slurm/cluster.env.example slurm/cluster.env" in err
    rc, _, err = _cli(capsys, "slurm", "sweep", "table8", "--dry-run")
    assert rc == 2 and needle in err


def test_slurm_sweep_help_lists_every_table(capsys):
    from repro.launch.scripts import TABLES

    with pytest.raises(SystemExit):
        _cli(capsys, "slurm", "sweep", "--help")
    out = capsys.readouterr().out
    assert all(name in out for name in TABLES)


# --- repro selftest, repro scaling-model -----------------------------------------------------------

def test_selftest_needs_a_rank(capsys):
    rc, out, err = _cli(capsys, "selftest", "--nproc", "0")
    assert rc == 2 and "--nproc 0" in err and "--nproc 2" in err and "checks passed" not in out


def test_scaling_model_names_an_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "table.md"
    out.write_text("mine")
    rc, _, err = _cli(capsys, "scaling-model", "--out", str(out))
    assert rc == 2 and "is a file, not a directory" in err and "Fix:" in err and out.read_text() == "mine"


@pytest.mark.parametrize("below", ["", "plan"])
def test_plan_paper_names_an_out_that_is_a_file(tmp_path, capsys, below):
    """Before, `repro plan --paper --out FILE` ended in mkdir's FileExistsError traceback."""
    mine = tmp_path / "paper_configs.md"
    mine.write_text("mine")
    rc, out, err = _cli(capsys, "plan", "--paper", "--out", str(mine / below if below else mine))
    assert rc == 2 and f"{mine} is a file, not a directory" in err and "Fix:" in err, err
    assert "Traceback" not in err and out == "" and mine.read_text() == "mine"


@pytest.mark.parametrize("command", [["bench", "--tiny", "--no-zero"], ["comm-bench", "--sizes", "8", "--iters", "1"]])
@pytest.mark.parametrize("below", ["", "sub"])
def test_bench_and_comm_bench_refuse_an_out_that_is_a_file_before_measuring(tmp_path, capsys, monkeypatch,
                                                                           command, below):
    """Before, FileExistsError / NotADirectoryError tracebacks (comm-bench's after the whole measurement).
    "Before measuring": neither measurement (bench's run_bench, comm-bench's ranks) is started."""
    from repro.parallel import spawn
    from repro.perf import bench, comm_bench

    started = []

    def measuring(name: str):
        def started_it(*args, **kwargs):
            started.append(name)
            raise AssertionError(f"{name} started before --out was checked")
        return started_it

    for module, name in ((bench, "run_bench"), (spawn, "run_ranks"), (comm_bench, "rank_main")):
        monkeypatch.setattr(module, name, measuring(name))
    mine = tmp_path / "afile"
    mine.write_text("mine")
    rc, out, err = _cli(capsys, *command, "--out", str(mine / below if below else mine))
    assert rc == 2 and f"{mine} is a file, not a directory" in err and "Fix:" in err, err
    assert "Traceback" not in err and mine.read_text() == "mine" and started == []


@pytest.mark.parametrize("argv, needle", [
    (["experiments/scaling/scale_8b.yaml", "--gpus", "8", "--out", "x"], "--out writes the --paper table"),
    (["--paper", "--json"], "--json would be ignored"),
    (["--paper", "experiments/scaling/scale_8b.yaml", "--gpus", "3", "--set", "train.micro_batch_size=1"],
     "a config, --gpus, --set would be ignored"),
])
def test_plan_refuses_flags_its_mode_would_ignore(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    rc, out, err = _cli(capsys, "plan", *argv)
    assert rc == 2 and needle in err and "Fix:" in err and out == "", err
    assert not Path("x").exists()


# --- repro eval, repro finetune race ---------------------------------------------------------------

def _gpt_checkpoint(run_dir: Path, family: str = "gpt") -> Path:
    """A trainer-format checkpoint of a tiny untrained GPT (meta.json only for another family)."""
    import torch

    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT
    from repro.parallel.groups import ProcessGroups
    from repro.train import checkpoint as ck

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=128,
                      hidden_dropout=0.0, attention_dropout=0.0)
    root, pg = run_dir / "checkpoints", ProcessGroups.single()
    tmp = ck.begin_save(root, 5, pg)
    if family == "gpt":
        torch.save(GPT(cfg, seed=1).state_dict(), tmp / "model_tp00.pt")
    meta = {"format": ck.FORMAT_VERSION, "family": family, "iteration": 5, "tp": 1, "dp": 1,
            "world_size": 1, "model": cfg.__dict__, "mlflow_run_id": None}
    (tmp / "meta.json").write_text(json.dumps(meta))
    ck.finish_save(root, 5, pg)
    return run_dir


def _eval(capsys, ckpt: Path, *extra: str) -> tuple[int, str, str]:
    return _cli(capsys, "eval", "lambada", "--checkpoint", str(ckpt), "--data-dir", str(mirror()),
                "--max-examples", "2", "--batch-size", "2", *extra)


def test_eval_refuses_a_bert_checkpoint(tmp_path, capsys):
    run = _gpt_checkpoint(tmp_path / "b1", family="bert")
    rc, _, err = _eval(capsys, run, "--no-mlflow")
    assert rc == 2 and "is a BERT checkpoint; zero-shot eval needs a GPT" in err and "repro finetune race" in err


def test_lambada_refuses_the_wikitext_window_and_wikitext_still_checks_it(tmp_path, capsys):
    """LAMBADA has no window: --window 16 is refused as wikitext's option (it once failed as a bad stride,
    then was ignored), and wikitext checks it against the default stride."""
    run = _gpt_checkpoint(tmp_path / "g5")
    rc, _, err = _eval(capsys, run, "--no-mlflow", "--window", "16", "--out", str(tmp_path / "l.jsonl"))
    assert rc == 2 and "--window applies to `repro eval wikitext` only" in err
    assert not (tmp_path / "l.jsonl").exists()
    rc, _, err = _cli(capsys, "eval", "wikitext", "--checkpoint", str(run), "--window", "16", "--no-mlflow")
    assert rc == 2 and "--stride 32 must be between 1 and --window 16" in err


def test_eval_default_out_is_the_run_dir_and_a_bad_out_fails_first(tmp_path, capsys):
    run = _gpt_checkpoint(tmp_path / "g5")
    assert _eval(capsys, run / "checkpoints" / "latest", "--no-mlflow")[0] == 0
    assert json.loads((run / "zero_shot.jsonl").read_text())["task"] == "lambada"
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    rc, out, err = _eval(capsys, run, "--no-mlflow", "--out", str(blocker / "eval.jsonl"))
    assert rc == 2 and "is a file, not a directory" in err and "Fix:" in err
    assert "lambada" not in out and blocker.read_text() == "mine"  # refused before evaluating


def test_eval_with_mlflow_unreachable_keeps_the_results_warns_and_says_how_to_retry(tmp_path, monkeypatch, capsys):
    run = _gpt_checkpoint(tmp_path / "g5")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
    _unset_retry_settings(monkeypatch)
    rc, _, err = _eval(capsys, run, "--out", str(tmp_path / "eval.jsonl"))
    # the evaluation is done and saved: exit 0 with a warning (it exited 2, and slurm/zeroshot_eval.sh
    # then stopped before its LAMBADA step)
    assert rc == 0 and "warning:" in err and UNREACHABLE in err and "--no-mlflow" in err
    assert f"`repro tracking sync {tmp_path / 'eval.jsonl'}` uploads them" in err
    assert json.loads((tmp_path / "eval.jsonl").read_text())["task"] == "lambada"
    assert _retry_settings() == FAIL_FAST  # one quick retry, not MLflow's minutes of them


def test_eval_records_sync_once_into_the_store_at_their_time(tmp_path, monkeypatch, capsys):
    """The records an outage (or --no-mlflow) left in zero_shot.jsonl go up with `repro tracking sync`,
    at the time they were evaluated, linked to the training run its directory names; never twice."""
    from mlflow import MlflowClient

    run = _gpt_checkpoint(tmp_path / "g5")
    assert _eval(capsys, run, "--no-mlflow")[0] == 0
    assert _eval(capsys, run, "--no-mlflow", "--max-examples", "3")[0] == 0
    (run / "mlflow_run_id").write_text("0123abcd")  # what `repro tracking sync` of the training run leaves
    with open(run / "zero_shot.jsonl", "a") as f:
        f.write('{"task": "lamb')  # an append cut short
    records = [json.loads(line) for line in (run / "zero_shot.jsonl").read_text().splitlines()[:2]]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.warns(UserWarning, match="truncated last line"):
        rc, out, _ = _cli(capsys, "tracking", "sync", str(run))
    assert rc == 0 and "2 evaluation record(s) logged" in out and "0 already there" in out, out
    client = MlflowClient(uri)
    runs = sorted(client.search_runs([client.get_experiment_by_name("zero-shot").experiment_id]),
                  key=lambda r: r.info.start_time)
    assert [r.info.start_time for r in runs] == [int(r["time"] * 1000) for r in records]
    for run_, record in zip(runs, records):
        assert run_.data.tags["training_run_id"] == "0123abcd" and run_.info.status == "FINISHED"
        assert run_.data.metrics["lambada/accuracy"] == record["metrics"]["accuracy"]
        assert run_.data.params["max_examples"] == str(record["params"]["max_examples"])
    with pytest.warns(UserWarning, match="truncated last line"):
        rc, out, _ = _cli(capsys, "tracking", "sync", str(run / "zero_shot.jsonl"))
    assert rc == 0 and "0 evaluation record(s) logged" in out and "2 already there" in out
    (run / "zero_shot.jsonl").write_text("{oops\n" + json.dumps(records[0]) + "\n")
    rc, _, err = _cli(capsys, "tracking", "sync", str(run / "zero_shot.jsonl"))
    assert rc == 2 and "zero_shot.jsonl:1 is not an evaluation record" in err and "Fix:" in err
    assert len(client.search_runs([runs[0].info.experiment_id])) == 2


def test_an_eval_after_a_cut_short_append_keeps_every_record_whole(tmp_path, capsys):
    """A killed write's partial last line is cut before the next record is appended (before, the record
    ran on from it, and that line, no longer the last, made every later sync refuse the file)."""
    from repro.eval.report import read_records

    run = _gpt_checkpoint(tmp_path / "g5")
    assert _eval(capsys, run, "--no-mlflow")[0] == 0
    with open(run / "zero_shot.jsonl", "a") as f:
        f.write('{"task": "lamb')  # an append cut short
    with pytest.warns(UserWarning, match="dropped an unfinished last line"):
        assert _eval(capsys, run, "--no-mlflow", "--max-examples", "3")[0] == 0
    records = read_records(run / "zero_shot.jsonl")
    assert [r.params["max_examples"] for r in records] == [2, 3], [r.params for r in records]


@pytest.mark.parametrize("task, option, value", [
    ("lambada", "--max-examples", "0"), ("lambada", "--max-examples", "-5100"), ("lambada", "--batch-size", "0"),
    ("wikitext", "--batch-size", "-1"), ("wikitext", "--max-lines", "-4300"), ("wikitext", "--max-lines", "0"),
])
def test_eval_counts_below_one_name_the_option(tmp_path, capsys, task, option, value):
    """Zero or negative counts are refused before the model loads (not a ZeroDivisionError, an
    empty range or a silent slice from the end): exit 2 naming the option and the fix."""
    run = _gpt_checkpoint(tmp_path / "g5")
    rc, out, err = _cli(capsys, "eval", task, "--checkpoint", str(run), "--data-dir", str(mirror()),
                        "--no-mlflow", option, value)
    assert rc == 2 and f"{option} {value} must be at least 1" in err and "Fix: give a positive number" in err, err
    assert "Traceback" not in err and not out and not (run / "zero_shot.jsonl").exists()


@pytest.mark.parametrize("command", [["eval", "lambada"], ["eval", "wikitext"], ["generate", "--prompt", "x"]])
@pytest.mark.parametrize("tp", ["0", "-1"])
def test_eval_and_generate_refuse_a_tp_below_one(tmp_path, capsys, command, tp):
    """Before, eval took --tp 0 for "not given" and ran at the default, and --tp -1 (and generate's 0
    and -1) ran serially: an impossible TP silently accepted."""
    run = _gpt_checkpoint(tmp_path / "g6")
    extra = ["--no-mlflow"] if command[0] == "eval" else ["--max-new-tokens", "1"]
    rc, out, err = _cli(capsys, *command, "--checkpoint", str(run), "--data-dir", str(mirror()), *extra, "--tp", tp)
    assert rc == 2 and f"--tp {tp}: give a tensor-parallel size of 1 or more" in err, err
    assert "Traceback" not in err and not out and not (run / "zero_shot.jsonl").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--size", "bert-999"], "--size bert-999 is not a BERT size"),
    (["--checkpoint", "EMPTY"], "no checkpoint at"),
    (["--model-config", "nope.yaml"], "--model-config nope.yaml does not exist"),
    (["--model-config", str(ROOT / "experiments/bert/tiny_cpu.yaml"), "--size", "bert-336m"],
     "--size bert-336m is the paper's L24-h1024-a16-s512, but the model is L2-h64-a4-s128 (not a paper size)"),
])
def test_finetune_race_names_a_bad_model_choice(tmp_path, capsys, extra, needle):
    extra = [str(tmp_path) if x == "EMPTY" else x for x in extra]
    rc, _, err = _cli(capsys, "finetune", "race", "--race-dir", str(ROOT / "tests/fixtures/race"), "--data-dir",
                      str(mirror()), "--run-dir", str(tmp_path / "run"), "--no-mlflow", *extra)
    assert rc == 2 and needle in err and ("Fix:" in err or "give a run directory" in err), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_script_arguments_before_the_separator_name_the_separator(capsys):
    """`repro slurm submit SCRIPT --smoke` (a natural slip): exit 2 naming `--`, nothing submitted."""
    from repro.cli import main

    for argv in (["slurm", "submit", "slurm/scale_8b.sh", "--smoke"], ["slurm", "sweep", "table1-tp", "--set", "a=1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "unrecognized arguments" in err and "go after `--`" in err, err


def test_selftest_refuses_forced_tf32_on_gpus(monkeypatch):
    """NGC containers force TF32 for fp32 matmuls: the GPU selftest says so instead of failing the fp32
    checks of a correct implementation (gloo on CPU is unaffected)."""
    from repro.cli import UserError
    from repro.parallel.selftest import _refuse_forced_tf32

    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    with pytest.raises(UserError, match="TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 repro selftest"):
        _refuse_forced_tf32("nccl")
    _refuse_forced_tf32("gloo")
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0")
    _refuse_forced_tf32("nccl")

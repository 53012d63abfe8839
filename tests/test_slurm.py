"""Issue 7 against a real Slurm (tests/slurm_cluster.py): smoke training through sbatch + srun at TP=2
with MLflow, preemption by USR1 -> checkpoint -> requeue -> exact resume (also for a TERM to the batch
shell; a TERM to srun is a hard kill), a clear error for a missing
cluster variable before launch, the zero-shot and RACE scripts in smoke mode on trained checkpoints,
the data-preparation script in smoke mode,
`repro slurm submit | sweep | status` against the cluster (not only --dry-run), and a cluster that
stops without leaving a process behind."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)
from slurm_cluster import SlurmCluster, activation, job_site, require_slurm, slurm_cluster  # noqa: F401
from train_fixtures import corpus, run_losses, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
ITERS = 12  # smoke iterations; ~0.6 s each at TP=2 on a shared 2-core machine
SMOKE = ["-p", "debug", "-N1", "-n2", "--gres=none"]


@pytest.fixture(scope="module")
def site(slurm_cluster, data_dir, tmp_path_factory) -> dict:  # noqa: F811
    """Cluster settings the way a user gives them (variables), and a fresh MLflow store made once."""
    return job_site(slurm_cluster, data_dir, tmp_path_factory.mktemp("site"))


def _submit(cluster: SlurmCluster, site: dict, *args: str, env: dict | None = None) -> str:
    return cluster.sbatch([*SMOKE, "-o", str(site["out"] / "job-%j.out"), *args], env=env or site["env"], cwd=ROOT)


def _job_output(site: dict, job: str) -> str:
    logs = sorted(site["runs"].glob(f"*-{job}/logs/*.out"))
    first = site["out"] / f"job-{job}.out"
    return "\n".join(p.read_text() for p in ([first] if first.exists() else []) + logs)


@pytest.fixture(scope="module")
def smoke_job(slurm_cluster, site) -> tuple[str, dict]:  # noqa: F811
    """`sbatch -p debug -N1 -n2 --gres=none slurm/scale_8b.sh --smoke`, run to the end."""
    job = _submit(slurm_cluster, site, "slurm/scale_8b.sh", "--smoke", "--set", f"train.train_iters={ITERS}")
    record = slurm_cluster.wait_job(job, timeout=240)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", _job_output(site, job)
    return job, record


def test_smoke_trains_at_tp2_through_srun_and_tracks_in_mlflow(smoke_job, site):
    import mlflow

    job, _ = smoke_job
    run_dir = site["runs"] / f"scale_8b-{job}"
    assert [s for s, _ in run_losses(run_dir)] == list(range(1, ITERS + 1))
    client = mlflow.MlflowClient(site["uri"])
    runs = client.search_runs([client.get_experiment_by_name("slurm-smoke").experiment_id],
                              f"params.slurm_job_id = '{job}'")
    assert len(runs) == 1, _job_output(site, job)
    run = runs[0]
    assert (run.data.params["tp"], run.data.params["dp"], run.data.params["world_size"]) == ("2", "1", "2")
    assert run.data.tags["slurm_job_id"] == job and run.info.status == "FINISHED"
    assert len(run.data.params["git_sha"]) == 40
    assert "srun --export=ALL --kill-on-bad-exit=1" in _job_output(site, job)


def test_usr1_checkpoints_requeues_and_resumes_exactly(slurm_cluster, site, smoke_job):  # noqa: F811
    """USR1 to the batch shell mid-run: the trainer checkpoints, the job requeues itself, and the
    restart resumes: steps 1..N once each, losses equal to the uninterrupted smoke run's, bit for bit
    (the tiny config has no dropout; the trainer restores data position and RNG)."""
    import mlflow

    job = _submit(slurm_cluster, site, "slurm/scale_8b.sh", "--smoke", "--set", f"train.train_iters={ITERS}")
    run_dir = site["runs"] / f"scale_8b-{job}"
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, _job_output(site, job)
        time.sleep(0.2)
    slurm_cluster.client("scancel", "--batch", "--signal=USR1", job)
    record = slurm_cluster.wait_job(job, timeout=240)
    out = _job_output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert record["Restarts"] == "1" and "requeueing job" in out, out
    stopped_at = int(re.search(r"signal at iteration (\d+)", out).group(1))
    assert 3 <= stopped_at < ITERS, out
    losses = run_losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, ITERS + 1)), out
    assert losses == run_losses(site["runs"] / f"scale_8b-{smoke_job[0]}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    history = mlflow.MlflowClient(site["uri"]).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, ITERS + 1))  # one MLflow run across restarts
    assert mlflow.MlflowClient(site["uri"]).get_run(run_id).info.status == "FINISHED"  # KILLED, reopened, done
    status = subprocess.run([sys.executable, "-m", "repro.cli", "slurm", "status", job], env=site["env"],
                            capture_output=True, text=True, cwd=ROOT)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stderr


def _wait_for_steps(site: dict, run_dir: Path, job: str, steps: int = 3) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert time.monotonic() < deadline, _job_output(site, job)
        time.sleep(0.2)


def test_term_to_the_batch_shell_checkpoints_and_requeues_like_usr1(slurm_cluster, site, smoke_job, tmp_path):  # noqa: F811
    """C1: srun answers a TERM by SIGKILLing its tasks, so launch.sh forwards a TERM that reaches the
    batch shell as USR1: the trainer checkpoints, the job requeues and resumes exactly. C2/C3: the run
    dir comes from the submitting environment (REPRO_RUNS_DIR, REPRO_RUN_NAME), although cluster.env
    names another REPRO_RUNS_DIR, in both pieces."""
    settings = tmp_path / "cluster.env"
    settings.write_text(f"REPRO_RUNS_DIR={tmp_path}/file-runs\n")
    env = {**site["env"], "REPRO_CLUSTER_ENV": str(settings), "REPRO_RUN_NAME": "term-stop"}
    job = _submit(slurm_cluster, site, "slurm/scale_8b.sh", "--smoke", "--set", f"train.train_iters={ITERS}", env=env)
    run_dir = site["runs"] / "term-stop"
    _wait_for_steps(site, run_dir, job)
    slurm_cluster.client("scancel", "--batch", "--signal=TERM", job)
    record = slurm_cluster.wait_job(job, timeout=240)
    out = "\n".join(p.read_text() for p in [site["out"] / f"job-{job}.out", *run_dir.glob("logs/*.out")] if p.exists())
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert "received SIGTERM" in out and "forwarding SIGUSR1 to the step" in out, out
    assert record["Restarts"] == "1" and "requeueing job" in out and "holds no checkpoint" not in out, out
    assert run_losses(run_dir) == run_losses(site["runs"] / f"scale_8b-{smoke_job[0]}"), out
    assert not (tmp_path / "file-runs").exists()


def test_term_to_srun_is_a_hard_kill(slurm_cluster, site):  # noqa: F811
    """What slurm/README.md says of a TERM that Slurm sends to the job's steps (time limit, plain
    scancel, preemption): srun kills the tasks ("forcing job termination"), no checkpoint, no requeue."""
    job = _submit(slurm_cluster, site, "slurm/scale_1b.sh", "--smoke", "--set", f"train.train_iters={ITERS}")
    run_dir = site["runs"] / f"scale_1b-{job}"
    _wait_for_steps(site, run_dir, job)
    slurm_cluster.client("scancel", "--full", "--signal=TERM", job)
    record = slurm_cluster.wait_job(job, timeout=120)
    out = _job_output(site, job)
    assert record["JobState"] != "COMPLETED" and record["Restarts"] == "0", out
    assert "forcing job termination" in out and not (run_dir / "stopped_by_signal").exists(), out


def test_tasks_get_the_batch_environment_when_the_job_exports_only_its_settings(slurm_cluster, site, tmp_path):  # noqa: F811
    """`sbatch --export=REPRO_CLUSTER_ENV=FILE` (like a site's SBATCH_EXPORT=NONE): the batch shell starts
    with only that variable and SLURM_*, and srun inherits that export setting, so without launch.sh's
    `srun --export=ALL` the tasks would lack the venv, MASTER_ADDR/PORT and REPRO_*: the run fails."""
    settings = tmp_path / "cluster.env"
    venv = "".join(f"{k}={v}\n" for k, v in activation().items())  # a venv elsewhere, as the user's file names it
    settings.write_text(f"REPRO_RUNS_DIR={site['runs']}\nREPRO_DATA_DIR={site['env']['REPRO_DATA_DIR']}\n"
                        f"MLFLOW_TRACKING_URI={site['uri']}\n{venv}")
    job = _submit(slurm_cluster, site, f"--export=REPRO_CLUSTER_ENV={settings}", "slurm/scale_1b.sh", "--smoke",
                  "--set", "train.train_iters=2")
    record = slurm_cluster.wait_job(job, timeout=240)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", _job_output(site, job)
    assert [s for s, _ in run_losses(site["runs"] / f"scale_1b-{job}")] == [1, 2]


LAUNCH_ENV = ("from repro.parallel.groups import discover_launch_env as d; e = d(); "
              "print('{where}: launched', e.launched, 'world', e.world_size)")


def test_a_batch_script_running_repro_train_nproc_itself_spawns_its_ranks(slurm_cluster, site, corpus, tmp_path):  # noqa: F811
    """A batch script's own shell carries SLURM_PROCID=0 and the job's SLURM_NTASKS, but is no rank:
    `repro train --nproc 2` run there (not through srun) spawns its two ranks. Before, it took itself for
    rank 0 of the job's 2 tasks and waited for a rank 1 that never came (REPRO_DIST_TIMEOUT_S); with
    one task, it would have trained on one rank and ignored --nproc. srun's tasks are still ranks, and
    a one-task step (`srun -n1`, as an interactive `srun --pty bash` is) spawns --nproc's ranks too."""
    run_dir, step_run_dir = tmp_path / "run", tmp_path / "step_run"

    def train(where: Path) -> str:
        sets = " ".join(f"--set {o}" for o in tiny_overrides(corpus, where, **{
            "parallel.tp": 2, "train.train_iters": 2, "train.log_interval": 1, "train.eval_iters": 1}))
        return f"{sys.executable} -m repro.cli train experiments/tiny/gpt_tiny.yaml --nproc 2 {sets}"

    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
set -euo pipefail
{sys.executable} -c "{LAUNCH_ENV.format(where='batch shell')}"
srun {sys.executable} -c "{LAUNCH_ENV.format(where='srun task')}"
srun -n1 --preserve-env {sys.executable} -c "{LAUNCH_ENV.format(where='preserve-env step')}"
{train(run_dir)}
srun -n1 {train(step_run_dir)}
""")
    env = {**site["env"], "REPRO_DIST_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1"}
    job = _submit(slurm_cluster, site, str(script), env=env)
    record = slurm_cluster.wait_job(job, timeout=240)
    out = _job_output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert "batch shell: launched False world 1" in out, out
    assert out.count("srun task: launched True world 2") == 2, out
    assert "preserve-env step: launched True world 1" in out, out  # SLURM_NTASKS is still the job's 2 there
    for where in (run_dir, step_run_dir):
        assert [s for s, _ in run_losses(where)] == [1, 2], out
        assert json.loads((where / "final_metrics.json").read_text())["iteration"] == 2


def test_missing_cluster_variable_fails_before_launch(slurm_cluster, site):  # noqa: F811
    env = {k: v for k, v in site["env"].items() if k != "REPRO_DATA_DIR"}
    before = set(site["runs"].glob("*")) if site["runs"].exists() else set()
    job = _submit(slurm_cluster, site, "slurm/scale_8b.sh", "--smoke", env=env)
    record = slurm_cluster.wait_job(job, timeout=60)
    out = (site["out"] / f"job-{job}.out").read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert "REPRO_DATA_DIR is not set" in out and "slurm/cluster.env.example" in out, out
    assert "step:" not in out and (set(site["runs"].glob("*")) if site["runs"].exists() else set()) == before


def test_run_dir_override_is_refused_naming_the_variable(slurm_cluster, site, tmp_path):  # noqa: F811
    """launch.sh looks for the requeue marker in its own run dir: `--set run_dir=X` would lose it."""
    job = _submit(slurm_cluster, site, "slurm/scale_1b.sh", "--smoke", "--dry-run", "--set", f"run_dir={tmp_path}")
    record = slurm_cluster.wait_job(job, timeout=60)
    out = _job_output(site, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert "run_dir is set by launch.sh" in out and "REPRO_RUN_NAME" in out and "step:" not in out, out


def test_bert_script_smoke_trains_a_tiny_bert(slurm_cluster, site):  # noqa: F811
    """`sbatch ... slurm/bert_336m.sh --smoke` (a 16-node script, shrunk to 2 tasks): a tiny BERT at TP=2 on
    a WordPiece smoke corpus, so the MLM/SOP data and masking path runs; before, every --smoke trained GPT."""
    job = _submit(slurm_cluster, site, "--ntasks-per-node=2", "slurm/bert_336m.sh", "--smoke", "--set",
                  "train.train_iters=3")
    record = slurm_cluster.wait_job(job, timeout=240)
    out = _job_output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    run_dir = site["runs"] / f"bert_336m-{job}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mlm_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["sop_loss"]) for r in steps), out
    params = json.loads((run_dir / "params.json").read_text())
    assert (params["family"], params["parallel.tp"], params["model.vocab_size"]) == ("bert", "2", "30522"), params
    assert (site["runs"] / "smoke-data" / "wiki_bert_train.idx").is_file()


def _eval_job(cluster: SlurmCluster, site: dict, script: str, **env: str) -> Path:
    """`sbatch ... SCRIPT --smoke` with extra variables, run to exit 0; the job's run dir."""
    job = _submit(cluster, site, script, "--smoke", env={**site["env"], **env})
    record = cluster.wait_job(job, timeout=240)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", _job_output(site, job)
    return site["runs"] / f"{Path(script).stem}-{job}"


def _mlflow_runs(site: dict, experiment: str, where: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(site["uri"])
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], where)


def test_zeroshot_eval_smoke_scores_the_smoke_checkpoint(slurm_cluster, site, smoke_job):  # noqa: F811
    """slurm/zeroshot_eval.sh --smoke at TP=2 on the TP=2 smoke run: both records in the training run's
    zero_shot.jsonl, finite, below uniform-guess loss (the trained weights were loaded), and linked in MLflow."""
    train_dir = site["runs"] / f"scale_8b-{smoke_job[0]}"
    run_dir = _eval_job(slurm_cluster, site, "slurm/zeroshot_eval.sh", REPRO_EVAL_CHECKPOINT=str(train_dir))
    assert not (run_dir / "zero_shot.jsonl").exists()  # the records are the training run's
    records = {r["task"]: r for r in map(json.loads, (train_dir / "zero_shot.jsonl").read_text().splitlines())}
    wiki, lamb = records["wikitext"]["metrics"], records["lambada"]["metrics"]
    params = records["wikitext"]["params"]
    assert (params["tp"], params["window"], params["stride"], params["max_lines"]) == (2, 64, 32, 40)
    assert wiki["num_targets"] == wiki["num_bpe_tokens"] - 1 and math.isfinite(wiki["word_ppl"])
    assert wiki["avg_token_loss"] < math.log(50257)
    assert lamb["num_examples"] == 64 and 0 <= lamb["accuracy"] <= 1 and math.isfinite(lamb["target_ppl"])
    train_id = (train_dir / "mlflow_run_id").read_text()
    runs = {r.data.tags["task"]: r for r in _mlflow_runs(site, "zero-shot", f"tags.training_run_id = '{train_id}'")}
    assert sorted(runs) == ["lambada", "wikitext"] and all(r.info.status == "FINISHED" for r in runs.values())
    assert runs["wikitext"].data.metrics["wikitext/word_ppl"] == wiki["word_ppl"]
    assert runs["lambada"].data.metrics["lambada/accuracy"] == lamb["accuracy"]


@pytest.fixture(scope="module")
def bert_run(data_dir, tmp_path_factory) -> Path:  # noqa: F811
    """A tiny BERT run dir (experiments/bert/tiny_cpu.yaml, 128 positions) from 1 step of `repro train`
    on the first 400 lines of WikiText-2 valid (also its held-out set: no evaluation runs)."""
    from repro.data.filters import FilterOptions
    from repro.data.preprocess import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("bert")
    text = (data_dir / "wikitext" / "wikitext-2.valid.tokens").read_text().splitlines(keepends=True)
    (root / "wiki.tokens").write_text("".join(text[:400]))
    prepare(PrepareOptions(input=root / "wiki.tokens", output_prefix=str(root / "wt2"), tokenizer="bert",
                           data_dir=data_dir, workers=1, layout="wikitext", split="1,0,0", progress=False,
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    sets = {"data.train_prefix": root / "wt2_train", "data.valid_prefix": root / "wt2_train",
            "data.vocab_dir": data_dir, "data.cache_dir": root / "cache", "run_dir": root / "run",
            "tracking.enabled": "false", "train.train_iters": 1}
    cmd = [sys.executable, "-m", "repro.cli", "train", "experiments/bert/tiny_cpu.yaml"]
    out = subprocess.run(cmd + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return root / "run"


def test_race_finetune_smoke_fine_tunes_a_trained_bert(slurm_cluster, site, bert_run):  # noqa: F811
    """slurm/race_finetune.sh --smoke at TP=2 on the fixture RACE: results.json with every accuracy,
    one MLflow run. The checkpoint has 128 positions, the smoke run 64 (cut, no longer a load error)."""
    run_dir = _eval_job(slurm_cluster, site, "slurm/race_finetune.sh", REPRO_BERT_CHECKPOINT=str(bert_run))
    results = json.loads((run_dir / "results.json").read_text())
    assert [s["seed"] for s in results["seeds"]] == [1234, 1235]
    assert all(math.isfinite(s["final_loss"]) for s in results["seeds"])
    assert set(results["median"]) == {"dev", "test"}  # the training split only with --eval-train
    accs = [v for split in ("dev", "test") for v in results["median"][split].values()]
    assert len(accs) == 6 and all(0 <= v <= 100 for v in accs)
    runs = _mlflow_runs(site, "bert", f"params.checkpoint = '{bert_run}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    params, metrics = runs[0].data.params, runs[0].data.metrics
    assert (params["size"], params["tp"], params["seq_length"], params["seeds"]) == ("smoke", "2", "64", "1234 1235")
    assert params["checkpoint_iteration"] == "1"  # which pretraining checkpoint was fine-tuned
    assert metrics["test/acc_total"] == results["median"]["test"]["total"]


def test_eval_script_refuses_a_checkpoint_pointer_file(slurm_cluster, site, smoke_job):  # noqa: F811
    """checkpoints/latest is a text file naming the iteration, not a checkpoint: stopped before srun."""
    latest = site["runs"] / f"scale_8b-{smoke_job[0]}" / "checkpoints" / "latest"
    job = _submit(slurm_cluster, site, "slurm/zeroshot_eval.sh", "--smoke",
                  env={**site["env"], "REPRO_EVAL_CHECKPOINT": str(latest)})
    record, out = slurm_cluster.wait_job(job, timeout=60), _job_output(site, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert "is not a directory: give the training run directory" in out and "step:" not in out, out


def test_prepare_data_smoke_writes_the_corpus_with_a_worker_per_allocated_cpu(slurm_cluster, site):  # noqa: F811
    """slurm/prepare_data.sh --smoke on 1 task of 1 CPU (the test node has more, and binds no task to
    its CPUs): the WikiText-2 articles through the paper's filters into the run dir's train/valid/test,
    tokenized by 1 worker, the allocation's count; without --input/--output-prefix (here spelled
    --input=...) the job stops before srun, naming them."""
    job = _submit(slurm_cluster, site, "-n1", "-c1", "slurm/prepare_data.sh", "--smoke")
    record = slurm_cluster.wait_job(job, timeout=240)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", _job_output(site, job)
    prefix = site["runs"] / f"prepare_data-{job}" / "data" / "wiki"
    saved = json.loads(Path(f"{prefix}_prepare.json").read_text())
    assert saved["options"]["workers"] == "1" and saved["filters"]["dedup"] and saved["filters"]["eval_overlap"]
    from repro.data.indexed_dataset import IndexedDataset

    counts = [IndexedDataset(f"{prefix}_{name}").num_documents for name in ("train", "valid", "test")]
    assert counts == [54, 6, 0] and saved["report"]["kept"] == 60, saved["report"]
    job = _submit(slurm_cluster, site, "-n1", "-c1", "slurm/prepare_data.sh", "--tokenizer", "bert", "--input=x.jsonl")
    record, out = slurm_cluster.wait_job(job, timeout=60), _job_output(site, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert "give prepare's --input FILE... and --output-prefix PREFIX" in out and "step:" not in out, out


def _repro_slurm(site: dict, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`repro slurm ARGS` from the repository root with the site's variables, the cluster's
    partition as REPRO_PARTITION (so sbatch gets `-p debug` from the command, not the test), and
    the sbatch options a CPU test node needs as sbatch's own variables, so that the printed commands
    stay the user's: SBATCH_GRES (the scripts ask for GPUs) and SBATCH_OUTPUT (else slurm-%j.out
    lands in the checkout)."""
    env = {**site["env"], "REPRO_PARTITION": "debug", "SBATCH_GRES": "none",
           "SBATCH_OUTPUT": str(site["out"] / "job-%j.out"), **env}
    return subprocess.run([sys.executable, "-m", "repro.cli", "slurm", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_repro_slurm_submit_and_status_run_a_smoke_job(slurm_cluster, site):  # noqa: F811
    """`repro slurm submit slurm/scale_1b.sh -- --smoke ...` (one task, TP=1, 2 iterations): the
    printed job id is the job Slurm ran from the repository root to COMPLETED, and `repro slurm
    status` reports it; without ids it shows the queue."""
    out = _repro_slurm(site, "submit", "slurm/scale_1b.sh", "--", "--smoke", "--set", "train.train_iters=2")
    assert out.returncode == 0, out.stderr
    command, submitted = out.stdout.splitlines()
    assert command == f"sbatch --parsable -p debug {ROOT}/slurm/scale_1b.sh --smoke --set train.train_iters=2"
    job = re.fullmatch(r"submitted job (\d+)", submitted).group(1)
    record = slurm_cluster.wait_job(job, timeout=180)
    status = _repro_slurm(site, "status", job)  # at once: the record goes MinJobAge (5 s) after the end
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", _job_output(site, job)
    assert (record["JobName"], record["Partition"], record["NumTasks"]) == ("scale_1b", "debug", "1")
    assert record["WorkDir"] == str(ROOT)
    assert status.returncode == 0, status.stderr
    header, row = status.stdout.splitlines()
    assert header.split() == ["job", "name", "state", "exit", "restarts", "runtime"]
    assert row.split()[:5] == [job, "scale_1b", "COMPLETED", "0:0", "0"]
    run_dir = site["runs"] / f"scale_1b-{job}"
    assert [s for s, _ in run_losses(run_dir)] == [1, 2], _job_output(site, job)
    assert "config ok: smoke-scale_1b tp=1 dp=1" in _job_output(site, job)
    queue = _repro_slurm(site, "status")
    assert queue.returncode == 0 and queue.stdout.split()[:3] == ["JOBID", "NAME", "STATE"], queue.stderr
    purged = _repro_slurm(site, "status", "987654")  # a job the controller does not know: a row, exit 0
    assert purged.returncode == 0 and purged.stdout.splitlines()[1].split()[:3] == ["987654", "?", "unknown"]


DEAD_CONTROLLER = """ClusterName=dead
SlurmctldHost=localhost
SlurmctldPort=6999
MessageTimeout=2
NodeName=localhost CPUs=1
PartitionName=debug Nodes=localhost
"""


@pytest.mark.parametrize("args", [("status", "123"), ("status",)])
def test_repro_slurm_status_fails_when_slurm_cannot_answer(tmp_path, args):
    """A controller that does not answer (nothing listens on its port): exit 2 with Slurm's own
    message and no table (it used to print every job as 'unknown' and exit 0)."""
    require_slurm()
    (tmp_path / "slurm.conf").write_text(DEAD_CONTROLLER)
    out = subprocess.run([sys.executable, "-m", "repro.cli", "slurm", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert ("scontrol could not report job 123" if len(args) == 2 else "squeue failed") in out.stderr
    assert "Unable to contact slurm controller" in out.stderr, out.stderr


def test_repro_slurm_sweep_submits_a_table_through_sbatch(slurm_cluster, site, tmp_path):  # noqa: F811
    """`repro slurm sweep table3 -- --dry-run`: table 3 is one job (zeroshot_eval.sh, 8 tasks: over-
    committed on the 2-CPU test node), the job's launch.sh checks and prints both evaluation steps
    but runs none (its --dry-run), so the real sbatch path of the sweep costs seconds."""
    out = _repro_slurm(site, "sweep", "table3", "--", "--dry-run", SBATCH_OVERCOMMIT="1",
                       REPRO_EVAL_CHECKPOINT=str(tmp_path))
    assert out.returncode == 0, out.stderr
    command, queued, summary = out.stdout.splitlines()
    assert command == f"sbatch --parsable -p debug {ROOT}/slurm/zeroshot_eval.sh --dry-run"
    job = re.fullmatch(r"table3: jobs (\d+); follow with `repro slurm status \1`", summary).group(1)
    assert queued == f"submitted job {job} (zeroshot_eval.sh)"  # printed as soon as sbatch answered
    record = slurm_cluster.wait_job(job, timeout=60)
    log = _job_output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    assert (record["JobName"], record["NumTasks"]) == ("zeroshot_eval", "8")
    task_sh = re.escape(f"step: srun --export=ALL --kill-on-bad-exit=1 --label bash {ROOT}/slurm/task.sh repro eval ")
    steps = re.findall(task_sh + r"(\w+) --checkpoint=(\S+) --data-dir=\S+( --file=tokens)?$", log, re.M)
    assert " --tp " not in log  # repro eval picks the checkpoint's own TP
    assert steps == [("wikitext", str(tmp_path), " --file=tokens"), ("lambada", str(tmp_path), "")], log
    assert "step exited" not in log and not (site["runs"] / f"zeroshot_eval-{job}" / "zero_shot.jsonl").exists()


def _wait_jobs(cluster: SlurmCluster, jobs: list[str], timeout: float) -> dict[str, dict[str, str]]:
    """Each job's record at its end, polling all together (one waited for alone may be purged meanwhile)."""
    records: dict[str, dict[str, str]] = {}
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    deadline = time.monotonic() + timeout
    while any(records.get(job, {}).get("JobState") not in ended for job in jobs):
        assert time.monotonic() < deadline, records
        records.update({job: cluster.job(job) or records.get(job, {}) for job in jobs})
        time.sleep(0.2)
    return records


def test_repro_slurm_submit_chains_a_job_after_another_with_sbatch_options(slurm_cluster, site, tmp_path):  # noqa: F811
    """`--after JOB` starts a job only once JOB has COMPLETED, and never after a failed one; `--sbatch`
    options reach sbatch, overriding REPRO_PARTITION (here a partition that does not exist). The jobs are
    table 3's zero-shot evaluation with launch.sh's --dry-run (seconds); the failing one names a missing
    checkpoint."""
    def submit(checkpoint: Path, *options: str) -> str:
        out = _repro_slurm(site, "submit", "zeroshot_eval.sh", *options, "--", "--dry-run", SBATCH_OVERCOMMIT="1",
                           REPRO_EVAL_CHECKPOINT=str(checkpoint), REPRO_PARTITION="nonesuch")
        assert out.returncode == 0, out.stderr
        return re.fullmatch(r"submitted job (\d+)", out.stdout.splitlines()[-1]).group(1)

    first = submit(tmp_path, "--sbatch=-p debug --job-name=first")
    second = submit(tmp_path, "--after", first, "--sbatch=--partition=debug", "--sbatch=--job-name=second")
    broken = submit(tmp_path / "missing", "--sbatch=-p debug")
    never = submit(tmp_path, "--after", broken, "--sbatch=-p debug")
    done = _wait_jobs(slurm_cluster, [first, second, broken], timeout=90)
    assert [done[job]["JobState"] for job in (first, second, broken)] == ["COMPLETED", "COMPLETED", "FAILED"]
    assert (done[first]["JobName"], done[second]["JobName"]) == ("first", "second")
    assert done[second]["StartTime"] >= done[first]["EndTime"], (done[first], done[second])
    waiting = slurm_cluster.wait_job(never, timeout=30, states=("PENDING",))
    deadline = time.monotonic() + 30
    while waiting.get("Reason") != "DependencyNeverSatisfied" and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = slurm_cluster.job(never) or waiting
    slurm_cluster.client("scancel", never)
    assert (waiting["JobState"], waiting["Reason"]) == ("PENDING", "DependencyNeverSatisfied"), waiting


def test_cluster_stops_running_jobs_and_leaves_no_process(tmp_path):
    require_slurm()
    cluster = SlurmCluster(tmp_path).start()
    try:
        job = cluster.sbatch(["-n1", "-o", str(tmp_path / "sleep.out"), "--wrap", "srun sleep 300"])
        cluster.wait_job(job, timeout=30, states=("RUNNING",))
        cluster._wait(lambda: any(p.name() == "sleep" for p in cluster.leftovers()), 30, "the job step")
    finally:
        cluster.stop()
    assert cluster.leftovers() == []

"""Issue 7 against a real Slurm (tests/slurm_cluster.py): smoke training through sbatch + srun at TP=2
with MLflow, preemption by USR1 -> checkpoint -> requeue -> exact resume, a clear error for a missing
cluster variable before launch, and a cluster that stops without leaving a process behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)
from slurm_cluster import SlurmCluster, require_slurm, slurm_cluster  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
ITERS = 12  # smoke iterations; ~0.6 s each at TP=2 on a shared 2-core machine
SMOKE = ["-p", "debug", "-N1", "-n2", "--gres=none"]


@pytest.fixture(scope="module")
def site(slurm_cluster, data_dir, tmp_path_factory) -> dict:  # noqa: F811
    """Cluster settings the way a user gives them (variables), and a fresh MLflow store made once."""
    import mlflow

    root = tmp_path_factory.mktemp("site")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_experiments()  # creates the store before any rank starts
    env = slurm_cluster.env(REPRO_RUNS_DIR=str(root / "runs"), REPRO_DATA_DIR=str(data_dir),
                            MLFLOW_TRACKING_URI=uri, REPRO_CLUSTER_ENV=str(root / "cluster.env"))
    (root / "cluster.env").write_text("# the test passes everything as variables\n")
    return {"env": env, "runs": root / "runs", "uri": uri, "out": root}


def _submit(cluster: SlurmCluster, site: dict, *args: str, env: dict | None = None) -> str:
    return cluster.sbatch([*SMOKE, "-o", str(site["out"] / "job-%j.out"), *args], env=env or site["env"], cwd=ROOT)


def _job_output(site: dict, job: str) -> str:
    logs = sorted(site["runs"].glob(f"*-{job}/logs/*.out"))
    first = site["out"] / f"job-{job}.out"
    return "\n".join(p.read_text() for p in ([first] if first.exists() else []) + logs)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


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
    assert [s for s, _ in _losses(run_dir)] == list(range(1, ITERS + 1))
    client = mlflow.MlflowClient(site["uri"])
    runs = client.search_runs([client.get_experiment_by_name("slurm-smoke").experiment_id],
                              f"params.slurm_job_id = '{job}'")
    assert len(runs) == 1, _job_output(site, job)
    run = runs[0]
    assert (run.data.params["tp"], run.data.params["dp"], run.data.params["world_size"]) == ("2", "1", "2")
    assert run.data.tags["slurm_job_id"] == job and run.info.status == "FINISHED"
    assert len(run.data.params["git_sha"]) == 40
    assert "srun --kill-on-bad-exit=1" in _job_output(site, job)


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
    stopped_at = int(re.search(r"checkpointed at iteration (\d+)", out).group(1))
    assert 3 <= stopped_at < ITERS, out
    losses = _losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, ITERS + 1)), out
    assert losses == _losses(site["runs"] / f"scale_8b-{smoke_job[0]}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    history = mlflow.MlflowClient(site["uri"]).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, ITERS + 1))  # one MLflow run across restarts
    status = subprocess.run([sys.executable, "-m", "repro.cli", "slurm", "status", job], env=site["env"],
                            capture_output=True, text=True, cwd=ROOT)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stderr


def test_missing_cluster_variable_fails_before_launch(slurm_cluster, site):  # noqa: F811
    env = {k: v for k, v in site["env"].items() if k != "REPRO_DATA_DIR"}
    before = set(site["runs"].glob("*")) if site["runs"].exists() else set()
    job = _submit(slurm_cluster, site, "slurm/scale_8b.sh", "--smoke", env=env)
    record = slurm_cluster.wait_job(job, timeout=60)
    out = (site["out"] / f"job-{job}.out").read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", out
    assert "REPRO_DATA_DIR is not set" in out and "slurm/cluster.env.example" in out, out
    assert "step:" not in out and (set(site["runs"].glob("*")) if site["runs"].exists() else set()) == before


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

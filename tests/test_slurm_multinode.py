"""Multi-node jobs on a real two-node Slurm cluster (tests/slurm_multinode.py: each node in its own
network, host-name and mount namespace, one machine). A TP x DP script's smoke run on 2 nodes x 2
tasks keeps each TP group inside a node and spreads DP over the nodes, meets at node1 by name,
checkpoints on USR1, requeues and resumes to the same losses as the same config on 4 local
processes; a TP group split over the two nodes trains too, and the trainer warns about it;
slurm/selftest.sh checks every layout of the 4 ranks against the serial model across the nodes;
DeepSpeed ZeRO-1 across them gives the local losses; a rank killed on node2 ends the job at once;
slurm/comm_bench.sh measures inside and across the nodes; a GLOO_SOCKET_IFNAME the nodes lack stops
the job before launch. The jobs track to a real MLflow server on the login node (the machine running
slurmctld), which the nodes reach by name; one it refuses costs no metric."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)
from mlflow_server import MlflowServer
from slurm_cluster import job_site
from slurm_multinode import NamespacedSlurmCluster, require_namespaces
from train_fixtures import local_reference, run_losses

ROOT = Path(__file__).resolve().parents[1]
ITERS = 16
SCRIPT = "slurm/scale_8b_dp512.sh"  # Table 1's 8-way TP x 64-way DP script, at smoke size


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """node1 and node2; teardown fails if a process, namespace or bridge of theirs survives."""
    require_namespaces()
    cluster = NamespacedSlurmCluster(tmp_path_factory.mktemp("slurm2"), nodes=2, login_names=("login", "login2")).start()
    yield cluster
    cluster.stop()
    left, network = cluster.leftovers(), cluster.network_left()
    assert not left and not network, f"left after stopping the cluster: {[(p.pid, p.name()) for p in left]}, {network}"


@pytest.fixture(scope="module")
def tracking_server(two_nodes, tmp_path_factory):
    """An MLflow server on the machine that runs slurmctld (the login node), which the nodes name
    `login`; admitted Host names: login and 127.0.0.1 (the tests' own client), not login2."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server"), allowed_hosts=["login"]) as server:
        yield server


@pytest.fixture(scope="module")
def site(two_nodes, tracking_server, data_dir, tmp_path_factory) -> dict:  # noqa: F811
    """The jobs track to http://login:PORT from the compute nodes, as a cluster's jobs would."""
    return job_site(two_nodes, data_dir, tmp_path_factory.mktemp("site2"), jobs_uri=tracking_server.uri("login"),
                    uri=tracking_server.local_uri)


def _submit(cluster: NamespacedSlurmCluster, site: dict, layout: list[str], *args: str, script: str = SCRIPT,
            env: dict | None = None) -> str:
    return cluster.sbatch(["-p", "debug", *layout, "--gres=none", "-o", str(site["out"] / "job-%j.out"),
                           script, "--smoke", *args], env=env or site["env"], cwd=ROOT)


def _output(site: dict, job: str) -> str:
    files = [site["out"] / f"job-{job}.out", *sorted(site["runs"].glob(f"*-{job}/logs/*.out"))]
    return "\n".join(p.read_text() for p in files if p.exists())


def _run(site: dict, job: str):
    """The job's MLflow run, read from the tracking server."""
    import mlflow

    client = mlflow.MlflowClient(site["uri"])
    runs = client.search_runs([client.get_experiment_by_name("slurm-smoke").experiment_id],
                              f"params.slurm_job_id = '{job}'")
    assert len(runs) == 1, _output(site, job)
    return runs[0]


def test_tp_inside_nodes_dp_across_them_requeues_and_resumes_like_one_host(two_nodes, site, tmp_path):
    """2 nodes x 2 tasks: smoke TP = one node's tasks, so TP=2 inside each node and DP=2 across; rank
    0 listens on node1, found by name; ranks 2 and 3 run on node2 as its local ranks 0 and 1. USR1
    mid-run: checkpoint, requeue, resume. Every step's loss equals that of the same config on 4 local
    processes, bit for bit (gloo reduces 2 ranks the same way over a network as over loopback)."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=2"], "--set", f"train.train_iters={ITERS}")
    run_dir = site["runs"] / f"scale_8b_dp512-{job}"
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and two_nodes.job(job).get("JobState") != "FAILED", _output(site, job)
        time.sleep(0.2)
    two_nodes.client("scancel", "--batch", "--signal=USR1", job)
    record = two_nodes.wait_job(job, timeout=400)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert record["NodeList"] == "node[1-2]" and record["Restarts"] == "1" and "requeueing job" in out, out
    assert "rank-0 rendezvous node1:" in out and "UserWarning: TP group" not in out, out
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["hosts"] == ["node1", "node1", "node2", "node2"], placement
    assert placement["local_ranks"] == [0, 1, 0, 1], placement
    run = _run(site, job)  # one run over both pieces, reopened over HTTP from node1
    assert {k: run.data.params[k] for k in ("tp", "dp", "world_size", "num_hosts", "tp_groups_within_host")} == \
        {"tp": "2", "dp": "2", "world_size": "4", "num_hosts": "2", "tp_groups_within_host": "true"}
    assert run.info.status == "FINISHED" and run.info.run_id == (run_dir / "mlflow_run_id").read_text()
    import mlflow

    client = mlflow.MlflowClient(site["uri"])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, ITERS + 1))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}  # uploaded through the server
    assert {"config.yaml", "placement.json", "final_metrics.json"} <= artifacts, artifacts
    losses = run_losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, ITERS + 1)), out
    assert losses == local_reference(run_dir / "config.yaml", 4, tmp_path / "local")


def test_a_tp_group_split_over_two_nodes_trains_and_is_warned_about(two_nodes, site):
    """1 task per node with parallel.tp=2: the TP all-reduces cross the (virtual) network. It trains,
    and the trainer names the split group, its hosts and the fix, and logs tp_groups_within_host=false."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=1"], "--set", "train.train_iters=2",
                  "--set", "parallel.tp=2")
    record = two_nodes.wait_job(job, timeout=300)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert "UserWarning: TP group [0, 1] runs on 2 hosts (node1, node2)" in out, out
    assert "--ntasks-per-node=K, K a multiple of 2" in out, out
    placement = json.loads((site["runs"] / f"scale_8b_dp512-{job}" / "placement.json").read_text())
    assert placement["hosts"] == ["node1", "node2"] and placement["local_ranks"] == [0, 0], placement
    params = _run(site, job).data.params
    assert (params["tp"], params["dp"], params["num_hosts"], params["tp_groups_within_host"]) == ("2", "1", "2", "false")


def test_selftest_script_checks_every_layout_across_the_nodes(two_nodes, site):
    """slurm/selftest.sh --smoke on 2 nodes x 2 tasks: every (tp, dp) of 4 ranks reproduces the serial
    model (the DP groups of tp=1 and tp=2, and tp=4's TP group, span the nodes); the job's log names
    where the ranks ran and holds the table."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=2"], script="slurm/selftest.sh")
    record = two_nodes.wait_job(job, timeout=300)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert "placement: 2 host(s); node1: ranks 0,1; node2: ranks 2,3" in out, out
    assert "repro selftest: 4 ranks, gloo" in out and "tp=4: collectives == 2L fwd + 2L bwd" in out, out
    passed = re.search(r"(\d+)/(\d+) checks passed", out)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(2)) >= 30, out


def test_a_server_refusing_the_login_name_costs_no_metric(two_nodes, site, tracking_server):
    """MLFLOW_TRACKING_URI=http://login2:PORT, a name the server was not given (MLflow 3 answers 403
    "Invalid Host header"): the check before launch warns, naming `--allowed-hosts login2:PORT`; the
    job trains all the same into metrics.jsonl; `repro tracking sync` from the login node uploads it."""
    import mlflow

    env = {**site["env"], "MLFLOW_TRACKING_URI": tracking_server.uri("login2")}
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=1"], "--set", "train.train_iters=3", env=env)
    record = two_nodes.wait_job(job, timeout=300)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert f"WARNING: the MLflow server at {tracking_server.uri('login2')} did not answer" in out, out
    assert out.count(f"mlflow server --allowed-hosts login2:{tracking_server.port}") >= 2, out  # check, then trainer
    run_dir = site["runs"] / f"scale_8b_dp512-{job}"
    assert [s for s, _ in run_losses(run_dir)] == [1, 2, 3] and not (run_dir / "mlflow_run_id").exists()
    sync = subprocess.run([sys.executable, "-m", "repro.cli", "tracking", "sync", str(run_dir)], cwd=ROOT,
                          env={**site["env"], "MLFLOW_TRACKING_URI": tracking_server.local_uri},
                          capture_output=True, text=True, timeout=300)
    assert sync.returncode == 0, sync.stdout + sync.stderr
    run = mlflow.MlflowClient(site["uri"]).get_run((run_dir / "mlflow_run_id").read_text())
    assert (run.data.params["num_hosts"], run.data.params["slurm_job_id"], run.info.status) == ("2", job, "FINISHED")
    history = mlflow.MlflowClient(site["uri"]).get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == run_losses(run_dir)


def _rank_process(cluster: NamespacedSlurmCluster, rank: int):
    """The training process of global rank `rank` (a task of this cluster whose RANK it is)."""
    for proc in cluster.leftovers():
        try:
            env, cmdline = proc.environ(), " ".join(proc.cmdline())
        except Exception:  # noqa: BLE001  (gone meanwhile)
            continue
        if env.get("RANK") == str(rank) and "repro" in cmdline and " train " in f" {cmdline} ":
            return proc
    return None


def test_a_rank_killed_on_node2_ends_the_whole_job_at_once(two_nodes, site):
    """SIGKILL to rank 3 (node2) mid-run, as the OOM killer would: srun's --kill-on-bad-exit ends the
    other three ranks at once instead of leaving them in a collective until its timeout (600 s), the
    job fails without a requeue, and the log names the node and task."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=2"], "--set", "train.train_iters=100000")
    run_dir = site["runs"] / f"scale_8b_dp512-{job}"
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, _output(site, job)
        time.sleep(0.2)
    victim = _rank_process(two_nodes, 3)
    assert victim is not None, _output(site, job)
    victim.kill()
    killed_at = time.monotonic()
    record = two_nodes.wait_job(job, timeout=120)
    out = _output(site, job)
    assert record["JobState"] == "FAILED" and record["Restarts"] == "0", out
    assert time.monotonic() - killed_at < 60, out
    assert "node2: task 3: Killed" in out and "requeueing" not in out, out
    assert not [rank for rank in range(4) if _rank_process(two_nodes, rank)], out


def test_gloo_socket_ifname_is_checked_on_the_node_before_launch(two_nodes, site):
    """GLOO_SOCKET_IFNAME=ib0 in the job's settings, on nodes that have eth0 and lo: the check before
    srun fails the job naming node1's interfaces, and no rank starts. GLOO_SOCKET_IFNAME=eth0: the
    ranks on both nodes open their sockets on eth0 and train."""
    bad = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=1"], "--set", "train.train_iters=2",
                  env={**site["env"], "GLOO_SOCKET_IFNAME": "ib0"})
    record = two_nodes.wait_job(bad, timeout=300)
    out = _output(site, bad)
    assert record["JobState"] == "FAILED" and "srun --export=ALL" not in out, out
    assert "GLOO_SOCKET_IFNAME=ib0 names ib0, which node1 lacks (it has: eth0, lo)" in out, out
    good = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=1"], "--set", "train.train_iters=2",
                   env={**site["env"], "GLOO_SOCKET_IFNAME": "eth0"})
    record = two_nodes.wait_job(good, timeout=300)
    out = _output(site, good)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    assert [s for s, _ in run_losses(site["runs"] / f"scale_8b_dp512-{good}")] == [1, 2], out


def test_deepspeed_zero_shards_optimizer_state_over_dp_ranks_on_both_nodes(two_nodes, site, tmp_path):
    """train.zero_stage=1 on 2 nodes x 2 tasks: DeepSpeed starts under srun with our process groups
    (TP=2 inside each node, ZeRO over the DP pair across the nodes) and its per-step losses equal the
    same config on 4 local processes, bit for bit (ZeRO-1 only partitions the optimizer state)."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=2"], "--set", "train.train_iters=6",
                  "--set", "train.zero_stage=1")
    record = two_nodes.wait_job(job, timeout=400)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    run_dir = site["runs"] / f"scale_8b_dp512-{job}"
    params = _run(site, job).data.params
    assert (params["zero_stage"], params["tp"], params["dp"], params["num_hosts"]) == ("1", "2", "2", "2")
    losses = run_losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, 7)), out
    assert losses == local_reference(run_dir / "config.yaml", 4, tmp_path / "local"), out


def test_comm_bench_script_measures_inside_and_across_the_nodes(two_nodes, site):
    """slurm/comm_bench.sh --smoke on 2 nodes x 2 tasks: both ranks of each node, and the two pairs of
    equal local rank across the nodes (at once), all-reduce every size; the report ends with the
    cluster-file fields of both kinds."""
    job = _submit(two_nodes, site, ["-N2", "--ntasks-per-node=2"], script="slurm/comm_bench.sh")
    record = two_nodes.wait_job(job, timeout=300)
    out = _output(site, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", out
    report = json.loads((site["runs"] / f"comm_bench-{job}" / "comm_bench.json").read_text())
    assert report["hosts_line"] == "2 host(s); node1: ranks 0,1; node2: ranks 2,3"
    rows = [(r["scope"], r["ranks"], r["groups"], r["bytes"]) for r in report["results"]]
    assert rows == [(scope, 2, 2, size) for scope in ("intra-node", "inter-node") for size in (8, 65536, 1 << 20)]
    assert all(r["seconds"] > 0 for r in report["results"])
    assert set(report["cluster_fields"]) == {"intra_gbps", "alpha_intra_s", "node_net_gbps", "alpha_inter_s"}
    assert "node_net_gbps:" in out, out

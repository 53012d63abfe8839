"""The rank-0 host on a cluster whose Slurm NodeName is no host name (cloud/dynamic nodes:
`NodeName=cloudnode1 NodeAddr=10.0.0.5`): launch.sh and `_first_slurm_host` rendezvous at the node's
NodeAddr, and stop naming the fix when neither resolves. Before, every rank retried getaddrinfo(cloudnode1)
for REPRO_DIST_TIMEOUT_S, again and again, with only c10d warnings in the log."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)
from repro.parallel.groups import _resolves, discover_launch_env
from slurm_cluster import SlurmCluster, job_site, require_slurm

ROOT = Path(__file__).resolve().parents[1]
NAME = "cloudnode1"


class CloudNodeCluster(SlurmCluster):
    """One node named NAME in Slurm, reached at NodeAddr 127.0.0.1 (its NodeHostname is this host's)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.node, self.nodes = NAME, [NAME]

    def _node_lines(self, mem: int) -> list[str]:
        return [f"NodeName={NAME} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} "
                f"CPUs={os.cpu_count()} RealMemory={mem}"]


@pytest.fixture(scope="module")
def cloud_cluster(tmp_path_factory):
    require_slurm()
    assert not _resolves(NAME), f"{NAME} resolves on this machine: the tests need a NodeName that does not"
    cluster = CloudNodeCluster(tmp_path_factory.mktemp("cloud-slurm")).start()
    yield cluster
    cluster.stop()
    left = cluster.leftovers()
    assert not left, f"processes left after stopping the Slurm cluster: {[(p.pid, p.name()) for p in left]}"


def test_a_node_name_that_does_not_resolve_rendezvous_at_its_node_addr(cloud_cluster, data_dir, tmp_path):  # noqa: F811
    site = job_site(cloud_cluster, data_dir, tmp_path)
    env = {**site["env"], "REPRO_DIST_TIMEOUT_S": "20"}  # the old code's ranks give up (and retry) sooner
    job = cloud_cluster.sbatch(["-p", "debug", "-N1", "-n2", "--gres=none", "--time=3", "-o", str(tmp_path / "job.out"),
                                "slurm/scale_8b.sh", "--smoke", "--set", "train.train_iters=2"], env=env, cwd=ROOT)
    record = cloud_cluster.wait_job(job, timeout=150)
    log = "\n".join(p.read_text() for p in [tmp_path / "job.out", *site["runs"].glob(f"*-{job}/logs/*.out")])
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    assert f"Slurm name {NAME} does not resolve" in log and "MASTER_ADDR is its NodeAddr 127.0.0.1" in log, log
    assert "rank-0 rendezvous 127.0.0.1:" in log, log


def test_first_slurm_host_falls_back_to_the_node_addr(cloud_cluster, monkeypatch):
    """Plain `srun repro ...` (no launch.sh, no MASTER_ADDR): the same rule, from the real scontrol."""
    monkeypatch.setenv("SLURM_CONF", str(cloud_cluster.conf))
    monkeypatch.setenv("SLURM_JOB_NODELIST", NAME)
    assert discover_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}).master_addr == "127.0.0.1"
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nowhere1")  # no such node: no NodeAddr either
    with pytest.raises(RuntimeError, match="Slurm name nowhere1 does not resolve on .*: export MASTER_ADDR="):
        discover_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})


FAKE_SCONTROL = """#!/bin/bash
echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=$FAKE_NODE_ADDR NodeHostName=$3 Version=23.11 State=IDLE"
"""


def _pick_master_addr(tmp_path: Path, node_addr: str, **env: str) -> subprocess.CompletedProcess:
    """launch.sh's pick_master_addr NAME, with a fake `scontrol show node` giving `node_addr` (the real getent)."""
    (tmp_path / "scontrol").write_text(FAKE_SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    script = ('set -euo pipefail; die() { echo "launch.sh: error: $*" >&2; exit 2; }; '
              'note() { echo "launch.sh: $*"; }; for f in resolves node_addr pick_master_addr; do '
              'eval "$(sed -n "/^$f()/,/^}/p" slurm/launch.sh)"; done; '
              f'pick_master_addr {NAME}; echo "MASTER_ADDR=$MASTER_ADDR"')
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_NODE_ADDR": node_addr, **env})


def test_launch_sh_takes_the_node_addr_or_stops_naming_the_fix(tmp_path):
    """When the NodeAddr does not resolve either: one line naming the node, this host and the fix, exit 2
    (so no srun); an address given with REPRO_MASTER_ADDR is taken as it is."""
    out = _pick_master_addr(tmp_path, "127.0.0.1")
    assert out.returncode == 0 and out.stdout.splitlines() == [
        f"launch.sh: the first node's Slurm name {NAME} does not resolve on {socket.gethostname().split('.')[0]}: "
        "MASTER_ADDR is its NodeAddr 127.0.0.1", "MASTER_ADDR=127.0.0.1"], out
    out = _pick_master_addr(tmp_path, "nowhere.invalid")
    assert out.returncode == 2 and out.stdout == "" and out.stderr == (
        f"launch.sh: error: MASTER_ADDR={NAME} (the first node's Slurm name) does not resolve on "
        f"{socket.gethostname().split('.')[0]}, nor does its NodeAddr nowhere.invalid: give an address of that "
        "node with REPRO_MASTER_ADDR=ADDR sbatch ..., or fix DNS\n"), out
    out = _pick_master_addr(tmp_path, "nowhere.invalid", REPRO_MASTER_ADDR="10.1.2.3")
    assert out.returncode == 0 and out.stdout == "MASTER_ADDR=10.1.2.3\n", out

"""`repro comm-bench` (repro/perf/comm_bench.py): which groups it measures, nccl-tests' bus
bandwidth, the cluster-file fields it derives, and a real run on local gloo ranks; across two real
Slurm nodes in tests/test_slurm_multinode.py."""

from __future__ import annotations

import json

import pytest

from repro.cli import main
from repro.parallel.placement import Placement
from repro.perf.comm_bench import CommResult, cluster_fields, comm_groups


def test_groups_inside_each_host_and_across_hosts_by_local_rank():
    two_by_four = Placement(hosts=["a"] * 4 + ["b"] * 4, local_ranks=[0, 1, 2, 3] * 2)
    assert comm_groups(two_by_four) == {"intra-node": [[0, 1, 2, 3], [4, 5, 6, 7]],
                                        "inter-node": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    one_host = Placement(hosts=["a", "a"], local_ranks=[0, 1])
    assert comm_groups(one_host) == {"intra-node": [[0, 1]], "inter-node": []}
    one_per_host = Placement(hosts=["a", "b", "c"], local_ranks=[0, 0, 0])
    assert comm_groups(one_per_host) == {"intra-node": [], "inter-node": [[0, 1, 2]]}


def test_cluster_fields_follow_the_ring_model():
    """busbw at the largest message (times the groups sharing a node's NICs across nodes); the
    smallest message's time over the ring's 2 (n - 1) steps as the latency."""
    rows = [CommResult("intra-node", 8, 2, 8, 14e-6, 0.0, 0.0),
            CommResult("intra-node", 8, 2, 1 << 26, 2e-4, 335.5, 293.6),
            CommResult("inter-node", 2, 8, 8, 40e-6, 0.0, 0.0),
            CommResult("inter-node", 2, 8, 1 << 26, 2e-3, 33.55, 33.55)]
    assert cluster_fields(rows) == pytest.approx({"intra_gbps": 293.6, "alpha_intra_s": 1e-6,
                                                  "node_net_gbps": 8 * 33.55, "alpha_inter_s": 20e-6})


ONE_TASK_STEP = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}


@pytest.mark.parametrize("slurm_env", [{}, ONE_TASK_STEP], ids=["plain", "one-task-srun-step"])
def test_comm_bench_on_local_ranks_writes_its_report(tmp_path, capsys, monkeypatch, slurm_env):
    """--nproc's ranks, also from the one task of an srun step (an interactive `srun --pty bash`):
    before, such a step measured itself alone."""
    for key in ("RANK", "WORLD_SIZE", *ONE_TASK_STEP):
        monkeypatch.delenv(key, raising=False)
    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    assert main(["comm-bench", "--nproc", "2", "--out", str(tmp_path), "--sizes", "8,64K", "--iters", "3"]) == 0
    report = json.loads((tmp_path / "comm_bench.json").read_text())
    rows = report["results"]
    assert [(r["scope"], r["ranks"], r["bytes"]) for r in rows] == [("intra-node", 2, 8), ("intra-node", 2, 65536)]
    for r in rows:  # a 2-rank ring: each link carries the message once
        assert r["seconds"] > 0 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"]) == pytest.approx(
            r["bytes"] / r["seconds"] / 1e9)
    assert set(report["cluster_fields"]) == {"intra_gbps", "alpha_intra_s"}
    md = (tmp_path / "comm_bench.md").read_text()
    assert "one host: nothing measured across nodes" in md and "Measured by `repro comm-bench`" in md
    assert f"intra_gbps: {report['cluster_fields']['intra_gbps']:.4g}" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--sizes", "8,lots"], "'LOTS' is not a size in bytes"),
    (["--nproc", "1"], "an all-reduce needs at least 2 ranks"),
    (["--iters", "0"], "time at least one all-reduce"),
])
def test_comm_bench_bad_arguments_name_the_fix(tmp_path, capsys, args, message):
    assert main(["comm-bench", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "comm_bench.json").exists()

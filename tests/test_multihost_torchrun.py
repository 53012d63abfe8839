"""torchrun across two hosts, without Slurm (tests/slurm_multinode.py's VirtualHosts: each host has
its own network namespace and address, host name and /etc/hosts, on one machine): one
`torchrun --nnodes 2 --node-rank R --master-addr host1` per host runs `repro train` at TP=2 inside
each host x DP=2 across them, to the losses of the same config on 4 local processes, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from slurm_multinode import VirtualHosts, require_namespaces
from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)
from train_fixtures import corpus, local_reference, run_losses, tiny_overrides  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")


def test_torchrun_on_two_hosts_trains_like_four_local_processes(corpus, tmp_path):  # noqa: F811
    require_namespaces(slurm=False)
    run_dir, sets = tmp_path / "run", []
    for item in tiny_overrides(corpus, run_dir, **{"parallel.tp": 2, "train.train_iters": 6, "tracking.enabled": "true"}):
        sets += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    hosts, procs, outs = VirtualHosts(tmp_path / "hosts", ["host1", "host2"]).start(), [], []
    try:
        procs += [subprocess.Popen(hosts.on(name, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(rank), "--master-addr", "host1", "--master-port", "29411",
            "-m", "repro.cli", "train", TINY, *sets]), cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for rank, name in enumerate(hosts.names)]
        outs += [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        hosts.stop()
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(out[-3000:] for out in outs)
    assert not hosts.left()
    assert "placement: 2 host(s); host1: ranks 0,1; host2: ranks 2,3; every TP group (tp=2) inside one host" in outs[0]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["hosts"] == ["host1", "host1", "host2", "host2"] and placement["local_ranks"] == [0, 1, 0, 1]
    reference = local_reference(run_dir / "config.yaml", 4, tmp_path / "local")
    assert run_losses(run_dir) == reference and len(reference) == 6

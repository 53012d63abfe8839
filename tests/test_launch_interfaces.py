"""NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME against a node's interfaces (repro/launch/interfaces.py),
by NCCL's documented rules; on two real Slurm nodes in tests/test_slurm_multinode.py."""

from __future__ import annotations

import pytest

from repro.launch.interfaces import gloo_missing, interface_problem, nccl_matches

NODE = ["docker0", "eno1", "ib0", "ibp65s0", "lo"]


@pytest.mark.parametrize("spec, expected", [
    ("ib", ["ib0", "ibp65s0"]),             # a prefix
    ("ib0", ["ib0"]),                       # ib0 is a prefix too, of ib0 only here
    ("=ib", []),                            # = asks for exact names
    ("=ib0,eno1", ["eno1", "ib0"]),
    ("^docker,lo", ["eno1", "ib0", "ibp65s0"]),
    ("^=docker0", ["eno1", "ib0", "ibp65s0", "lo"]),
    ("eth", []),
])
def test_nccl_socket_ifname_follows_nccls_prefix_exclude_and_exact_rules(spec, expected):
    assert sorted(nccl_matches(spec, NODE)) == expected


def test_gloo_socket_ifname_needs_every_name_it_lists():
    assert gloo_missing("ib0,eno1", NODE) == [] and gloo_missing("ib0,eth0", NODE) == ["eth0"]
    assert gloo_missing("ib", NODE) == ["ib"]  # gloo takes exact names, no prefixes


def test_only_the_backend_in_use_is_checked_and_the_message_lists_the_interfaces():
    env = {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0"}
    nccl = interface_problem(env, NODE, "nccl", "gpu17")
    assert nccl.startswith("NCCL_SOCKET_IFNAME=eth matches no network interface of gpu17 (it has: docker0, eno1, ib0")
    gloo = interface_problem(env, NODE, "gloo", "gpu17")
    assert gloo.startswith("GLOO_SOCKET_IFNAME=eth0 names eth0, which gpu17 lacks") and "slurm/cluster.env" in gloo
    assert interface_problem({"NCCL_SOCKET_IFNAME": "ib"}, NODE, "nccl", "gpu17") is None
    assert interface_problem({"NCCL_SOCKET_IFNAME": "eth"}, NODE, "gloo", "gpu17") is None  # a CPU smoke run
    assert interface_problem({}, NODE, "nccl", "gpu17") is None


def test_check_network_runs_the_same_check_for_steps_that_train_nothing(capfd, monkeypatch):
    """`repro slurm check-network` (launch.sh runs it before selftest, comm-bench, evaluation and RACE
    steps): this machine's real interfaces; a name none matches fails naming them, exit 2."""
    import psutil

    from repro.cli import main

    some = sorted(psutil.net_if_addrs())[0]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", some)
    assert main(["slurm", "check-network", "--backend", "gloo"]) == 0
    assert "socket interfaces ok for gloo" in capfd.readouterr().out
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "no-such-if")
    assert main(["slurm", "check-network", "--backend", "nccl"]) == 2
    err = capfd.readouterr().err
    assert "NCCL_SOCKET_IFNAME=no-such-if matches no network interface" in err and some in err, err

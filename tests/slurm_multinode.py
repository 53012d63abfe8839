"""A real multi-node Slurm cluster on one machine, for tests: each node's slurmd runs in its own
network, UTS and mount namespace, so a job's tasks on node2 see another host name, another IP
address and another port space than those on node1, and reach them over a (virtual) network.

    with NamespacedSlurmCluster(tmp_path, nodes=2) as cluster:
        job = cluster.sbatch(["-N2", "--ntasks-per-node=2", "--wrap", "srun hostname"])

The network: a Linux bridge in the root namespace holds the controller's address (.1 of a free
10.x.y.0/24); node i gets a veth pair, one end on the bridge, the other in its namespace as eth0 with
.(10+i). Inside its mount namespace each node binds the cluster's `hosts` file over /etc/hosts, so
every node resolves every other by name (MASTER_ADDR=node1 as on a real cluster), and its own
`nodes/NODE` over `node/`, where its slurmd keeps pid file, log and spool (slurm.conf is one file
for all nodes). The rest of the filesystem is shared, as a cluster's is. Needs root, iproute2 (`ip`)
and util-linux (`nsenter`, `unshare`, `mount`).
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
from pathlib import Path

from conftest import require
from slurm_cluster import SlurmCluster, _node_name, _sbin, require_slurm

def require_namespaces() -> None:
    """Skip locally / fail in CI without Slurm, root, `ip` and network namespaces."""
    require_slurm()
    require(all(shutil.which(b) for b in ("ip", "nsenter", "unshare")), "`ip` (apt: iproute2), `nsenter` and `unshare`")
    probe = f"repro-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    require(made.returncode == 0, f"network namespaces (`ip netns add` said: {made.stderr.strip()})")


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface of this machine is on."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(100, 250)}.{rng.randrange(256)}.0/24")
        if f" 10.{net.network_address.packed[1]}.{net.network_address.packed[2]}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test cluster's network")


class NamespacedSlurmCluster(SlurmCluster):
    """SlurmCluster with `nodes` nodes, each in its own namespaces (see the module docstring)."""

    def __init__(self, root: Path, nodes: int = 2, login_names: tuple[str, ...] = ("login",)) -> None:
        """`login_names`: more names the nodes resolve to the controller's address (the machine that
        runs slurmctld and the tests, as a login node would), e.g. for an MLflow server there."""
        super().__init__(root)
        self.login_names = login_names
        self.tag = f"{os.getpid() % 100000:05d}{random.randrange(100):02d}"
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.controller_addr = str(hosts[0])
        self.addrs = {node: str(hosts[10 + i]) for i, node in enumerate(self.nodes)}
        self.bridge = f"rsb{self.tag}"
        self.netns = {node: f"repro-{self.tag}-{node}" for node in self.nodes}

    def node_dir(self, node: str) -> Path:
        """Where `node`'s slurmd keeps its pid file, log and spool (seen as root/node inside it)."""
        return self.root / "nodes" / node

    def _slurmd_paths(self) -> list[str]:
        shared = self.root / "node"
        return [f"SlurmdSpoolDir={shared}/spool", f"SlurmdPidFile={shared}/slurmd.pid",
                f"SlurmdLogFile={shared}/slurmd.log"]

    def _node_lines(self, mem: int) -> list[str]:
        return [f"NodeName={node} NodeAddr={self.addrs[node]} CPUs={os.cpu_count()} RealMemory={mem}"
                for node in self.nodes]

    def _slurmd_pid_files(self) -> list[Path]:
        return [self.node_dir(node) / "slurmd.pid" for node in self.nodes]

    def start(self, timeout: float = 30) -> "NamespacedSlurmCluster":
        try:
            self._make_network()
        except subprocess.CalledProcessError as err:
            self._remove_network()
            raise RuntimeError(f"the test cluster's network: `{' '.join(err.cmd)}` failed: {err.stderr}") from err
        super().start(timeout)
        return self

    def _make_network(self) -> None:
        ip = lambda *args: subprocess.run(["ip", *args], check=True, capture_output=True, text=True)  # noqa: E731
        prefix = self.subnet.prefixlen
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.controller_addr}/{prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        names = "\n".join(f"{addr} {node}" for node, addr in self.addrs.items())
        (self.root / "nodes").mkdir(parents=True, exist_ok=True)
        login = " ".join([_node_name(), *self.login_names])
        (self.root / "nodes" / "hosts").write_text(f"127.0.0.1 localhost\n{self.controller_addr} {login}\n{names}\n")
        for i, node in enumerate(self.nodes):
            ns, veth = self.netns[node], f"rsv{self.tag}{i}"
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addrs[node]}/{prefix}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def _start_slurmds(self, env: dict[str, str]) -> None:
        (self.root / "node").mkdir(exist_ok=True)
        for node in self.nodes:
            self.node_dir(node).mkdir(parents=True, exist_ok=True)
            (self.node_dir(node) / "spool").mkdir(exist_ok=True)
            # its own host name (UTS), /etc/hosts and node dir (mount), addresses and ports (network)
            script = ('hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" '
                      '&& exec "$5" -f "$6" -N "$1"')
            self._run(["nsenter", f"--net=/run/netns/{self.netns[node]}", "--", "unshare", "--uts", "--mount", "--",
                       "sh", "-c", script, "sh", node, str(self.root / "nodes" / "hosts"), str(self.node_dir(node)),
                       str(self.root / "node"), _sbin("slurmd"), str(self.conf)], env)

    def stop(self, timeout: float = 30) -> None:
        super().stop(timeout)
        self._remove_network()

    def _remove_network(self) -> None:
        for ns in self.netns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veth end goes with it
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def network_left(self) -> list[str]:
        """This cluster's namespaces and bridge that still exist."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [ns for ns in self.netns.values() if ns in names] + ([self.bridge] if self.bridge in links else [])

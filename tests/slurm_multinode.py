"""A real multi-node Slurm cluster on one machine, for tests: each node's slurmd runs in its own
network, UTS and mount namespace, so a job's tasks on node2 see another host name, another IP
address and another port space than those on node1, and reach them over a (virtual) network.

    with NamespacedSlurmCluster(tmp_path, nodes=2) as cluster:
        job = cluster.sbatch(["-N2", "--ntasks-per-node=2", "--wrap", "srun hostname"])

    hosts = VirtualHosts(tmp_path / "hosts", ["host1", "host2"]).start()   # the hosts alone, no Slurm
    subprocess.Popen(hosts.on("host2", ["torchrun", "--node-rank", "1", ...]))

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

def require_namespaces(slurm: bool = True) -> None:
    """Skip locally / fail in CI without root, `ip`, network namespaces (and Slurm, unless not asked)."""
    if slurm:
        require_slurm()
    require(os.geteuid() == 0, "root (network namespaces)")
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


class VirtualHosts:
    """Hosts `names` on one machine, each with its own network namespace (an IP on a shared bridge),
    and, for each command run `on` it, its own host name and an /etc/hosts naming every host. The
    bridge's address is the machine's own (`login_addr`), named by `login_names` inside the hosts."""

    def __init__(self, root: Path, names: list[str], login_names: tuple[str, ...] = ()) -> None:
        self.root, self.names, self.login_names = Path(root), names, login_names
        self.tag = f"{os.getpid() % 100000:05d}{random.randrange(100):02d}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.login_addr = str(addresses[0])
        self.addrs = {name: str(addresses[10 + i]) for i, name in enumerate(names)}
        self.bridge = f"rsb{self.tag}"
        self.netns = {name: f"repro-{self.tag}-{name}" for name in names}
        self.hosts_file = self.root / "hosts"

    def start(self) -> "VirtualHosts":
        try:
            self._make()
        except subprocess.CalledProcessError as err:
            self.stop()
            raise RuntimeError(f"the test hosts' network: `{' '.join(err.cmd)}` failed: {err.stderr}") from err
        return self

    def _make(self) -> None:
        ip = lambda *args: subprocess.run(["ip", *args], check=True, capture_output=True, text=True)  # noqa: E731
        prefix = self.subnet.prefixlen
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.login_addr}/{prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        names = "\n".join(f"{addr} {name}" for name, addr in self.addrs.items())
        login = " ".join([_node_name(), *self.login_names])
        self.root.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(f"127.0.0.1 localhost\n{self.login_addr} {login}\n{names}\n")
        for i, name in enumerate(self.names):
            ns, veth = self.netns[name], f"rsv{self.tag}{i}"
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addrs[name]}/{prefix}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def on(self, name: str, argv: list[str], bind: tuple[Path, Path] | None = None) -> list[str]:
        """The command line that runs `argv` on host `name`: in its network namespace, with its host
        name and /etc/hosts (and `bind` = (source, target) bound over target) in new UTS and mount
        namespaces, which everything it starts inherits."""
        mounts = 'mount --bind "$2" /etc/hosts' + (' && mount --bind "$3" "$4"' if bind else "")
        script = f'hostname "$1" && {mounts} && shift {4 if bind else 2} && exec "$@"'
        extra = [str(bind[0]), str(bind[1])] if bind else []
        return ["nsenter", f"--net=/run/netns/{self.netns[name]}", "--", "unshare", "--uts", "--mount", "--",
                "sh", "-c", script, "sh", name, str(self.hosts_file), *extra, *argv]

    def stop(self) -> None:
        for ns in self.netns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veth end goes with it
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def left(self) -> list[str]:
        """These hosts' namespaces and bridge that still exist."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [ns for ns in self.netns.values() if ns in names] + ([self.bridge] if self.bridge in links else [])


class NamespacedSlurmCluster(SlurmCluster):
    """SlurmCluster with `nodes` nodes, each a VirtualHosts host running its slurmd (see the module
    docstring); slurmctld and munged run on the machine itself, the nodes' `login`."""

    def __init__(self, root: Path, nodes: int = 2, login_names: tuple[str, ...] = ("login",)) -> None:
        """`login_names`: more names the nodes resolve to the controller's address (the machine that
        runs slurmctld and the tests, as a login node would), e.g. for an MLflow server there."""
        super().__init__(root)
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.hosts = VirtualHosts(self.root / "nodes", self.nodes, login_names)
        self.controller_addr = self.hosts.login_addr

    def node_dir(self, node: str) -> Path:
        """Where `node`'s slurmd keeps its pid file, log and spool (seen as root/node inside it)."""
        return self.root / "nodes" / node

    def _slurmd_paths(self) -> list[str]:
        shared = self.root / "node"
        return [f"SlurmdSpoolDir={shared}/spool", f"SlurmdPidFile={shared}/slurmd.pid",
                f"SlurmdLogFile={shared}/slurmd.log"]

    def _node_lines(self, mem: int) -> list[str]:
        return [f"NodeName={node} NodeAddr={self.hosts.addrs[node]} CPUs={os.cpu_count()} RealMemory={mem}"
                for node in self.nodes]

    def _slurmd_pid_files(self) -> list[Path]:
        return [self.node_dir(node) / "slurmd.pid" for node in self.nodes]

    def start(self, timeout: float = 30) -> "NamespacedSlurmCluster":
        self.hosts.start()
        super().start(timeout)
        return self

    def _start_slurmds(self, env: dict[str, str]) -> None:
        (self.root / "node").mkdir(exist_ok=True)
        for node in self.nodes:
            (self.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            self._run(self.hosts.on(node, [_sbin("slurmd"), "-f", str(self.conf), "-N", node],
                                    bind=(self.node_dir(node), self.root / "node")), env)

    def stop(self, timeout: float = 30) -> None:
        super().stop(timeout)
        self.hosts.stop()

    def network_left(self) -> list[str]:
        return self.hosts.left()

"""Where the ranks run: each rank's host and local rank, gathered once at start, and whether every
TP group stays inside one host.

The paper keeps tensor parallelism inside a server (8 or 16 GPUs on NVSwitch) and lets only the data
parallel gradient all-reduce cross the network: a TP group split over two hosts sends its per-layer
activation all-reduces over InfiniBand instead. Ranks are laid out TP-innermost
(`repro.parallel.groups`), so a TP group stays inside one host when each host runs a multiple of
`tp` consecutive ranks, which `srun --ntasks-per-node=K` with K a multiple of tp gives.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from repro.parallel.groups import ParallelDims


@dataclass(frozen=True)
class Placement:
    """hosts[r] and local_ranks[r] of every global rank r."""

    hosts: list[str]
    local_ranks: list[int]

    def ranks_by_host(self) -> dict[str, list[int]]:
        """Host -> its global ranks, hosts in the order of their first rank."""
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            by_host.setdefault(host, []).append(rank)
        return by_host

    def split_tp_groups(self, dims: ParallelDims) -> list[list[int]]:
        """The TP groups whose ranks run on more than one host."""
        return [ranks for ranks in dims.tp_groups() if len({self.hosts[r] for r in ranks}) > 1]

    def hosts_line(self) -> str:
        """'2 host(s); node1: ranks 0,1; node2: ranks 2,3'."""
        by_host = self.ranks_by_host()
        return f"{len(by_host)} host(s); " + "; ".join(f"{host}: ranks {_span(r)}" for host, r in by_host.items())

    def summary(self, dims: ParallelDims) -> str:
        """One line: hosts and their ranks, and whether the TP groups stay inside hosts."""
        split = self.split_tp_groups(dims)
        verdict = (f"every TP group (tp={dims.tp}) inside one host" if not split
                   else f"{len(split)} of {dims.dp} TP groups span hosts")
        return f"placement: {self.hosts_line()}; {verdict}"

    def warning(self, dims: ParallelDims) -> str | None:
        """What to change when a TP group spans hosts; None when none does."""
        split = self.split_tp_groups(dims)
        if not split:
            return None
        group = split[0]
        hosts = sorted({self.hosts[r] for r in group})
        per_host = sorted({len(ranks) for ranks in self.ranks_by_host().values()})
        others = f" (and {len(split) - 1} more of the {dims.dp} TP groups)" if len(split) > 1 else ""
        return (f"TP group {group} runs on {len(hosts)} hosts ({', '.join(hosts)}){others}: its activation "
                "all-reduces (several per layer and step) cross the network, which the paper keeps inside a "
                f"server. Hosts run {'/'.join(map(str, per_host))} ranks here; run a multiple of tp={dims.tp} "
                f"tasks on every host (srun --ntasks-per-node=K, K a multiple of {dims.tp}, and srun's default "
                "block distribution), or lower parallel.tp")

    def as_dict(self) -> dict:
        return {"hosts": self.hosts, "local_ranks": self.local_ranks, "ranks_by_host": self.ranks_by_host()}


def _span(ranks: list[int]) -> str:
    """'0-3' for consecutive ranks, else the list."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def gather_placement(group: dist.ProcessGroup | None) -> Placement:
    """Every rank's host name and local rank (LOCAL_RANK, else Slurm's SLURM_LOCALID: a plain srun task),
    on every rank (one all_gather_object over `group`, the world; a single process answers for itself)."""
    mine = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))))
    if group is None:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    return Placement(hosts=[host for host, _ in gathered], local_ranks=[local for _, local in gathered])

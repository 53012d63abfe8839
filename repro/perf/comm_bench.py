"""`repro comm-bench`: all-reduce bandwidth and latency inside a node and across nodes, measured the
way nccl-tests reports them, to describe a cluster for `repro plan --cluster FILE`.

    sbatch slurm/comm_bench.sh                 # 2 nodes x 8 GPUs, NCCL
    repro comm-bench --nproc 2 --out DIR       # local ranks (gloo on CPU): inside one host only

Two kinds of group, each measured with all of its kind at once, as training loads the network:
- inside a node: the ranks of each host (what a TP group's activation all-reduces use);
- across nodes: the ranks with the same local rank, one per host (what a DP group's gradient
  all-reduce uses when TP fills the node), all gpus-per-node of them at once.
For a message of B bytes all-reduced in t seconds by n ranks: algorithm bandwidth B / t, bus
bandwidth B / t x 2 (n - 1) / n (what each link carries in a ring; nccl-tests' busbw). The cluster
file's fields from them, as repro.perf.scaling_model's ring model reads them:
- intra_gbps: the bus bandwidth inside a node at the largest message;
- node_net_gbps: the bus bandwidth across nodes at the largest message x the groups crossing a
  node's NICs at once (its local ranks);
- alpha_intra_s / alpha_inter_s: the time of the smallest message / (2 (n - 1)), the ring's steps.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from repro.parallel.placement import Placement, gather_placement

DEFAULT_SIZES = (8, 1 << 20, 16 << 20, 64 << 20)


@dataclass(frozen=True)
class CommResult:
    scope: str  # "intra-node" | "inter-node"
    ranks: int  # ranks per group
    groups: int  # groups measured at once
    bytes: int
    seconds: float  # median over the timed all-reduces, of the slowest rank
    algbw_gbps: float
    busbw_gbps: float


def comm_groups(placement: Placement) -> dict[str, list[list[int]]]:
    """The rank lists of both kinds (inter-node: only local ranks present on every host)."""
    by_host = list(placement.ranks_by_host().values())
    inter = [[ranks[i] for ranks in by_host] for i in range(min(len(r) for r in by_host))] if len(by_host) > 1 else []
    return {"intra-node": [r for r in by_host if len(r) > 1], "inter-node": inter}


def _time_allreduce(tensor: torch.Tensor, group, iters: int, warmup: int) -> float:
    """Median seconds of one all-reduce of `tensor` over `group`, timed between barriers of the world."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        began = time.perf_counter()
        if group is not None:
            dist.all_reduce(tensor, group=group)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(placement: Placement, device: torch.device, sizes=DEFAULT_SIZES, iters: int = 10,
            warmup: int = 3, dtype: torch.dtype = torch.bfloat16) -> list[CommResult]:
    """Every rank calls it; every rank gets the results (each time the slowest rank's)."""
    rank, results = dist.get_rank(), []
    element = torch.tensor([], dtype=dtype).element_size()
    for scope, lists in comm_groups(placement).items():
        mine = None
        for ranks in lists:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        if not lists:
            continue
        n = len(lists[0])
        for nbytes in sizes:
            tensor = torch.ones(max(nbytes // element, 1), dtype=dtype, device=device)
            # on the ranks' device: NCCL, the GPUs' backend, has no CPU tensors
            seconds = torch.tensor(_time_allreduce(tensor, mine, iters, warmup), dtype=torch.float64, device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            t, b = float(seconds), tensor.numel() * element
            results.append(CommResult(scope, n, len(lists), b, t, b / t / 1e9, b / t / 1e9 * 2 * (n - 1) / n))
    return results


def cluster_fields(results: list[CommResult]) -> dict[str, float]:
    """The cluster file's network fields these measurements give (see the module docstring)."""
    fields = {}
    for scope, bw_key, alpha_key in (("intra-node", "intra_gbps", "alpha_intra_s"),
                                     ("inter-node", "node_net_gbps", "alpha_inter_s")):
        rows = [r for r in results if r.scope == scope]
        if not rows:
            continue
        largest, smallest = max(rows, key=lambda r: r.bytes), min(rows, key=lambda r: r.bytes)
        fields[bw_key] = largest.busbw_gbps * (largest.groups if scope == "inter-node" else 1)
        fields[alpha_key] = smallest.seconds / (2 * (smallest.ranks - 1))
    return fields


def rank_main(sizes: list[int], iters: int, warmup: int) -> dict:
    """One rank's body (the world is initialised): placement, measurements, cluster fields."""
    from repro.parallel.groups import discover_launch_env

    device = discover_launch_env().device()  # this rank's GPU, or the CPU without CUDA
    placement = gather_placement(dist.group.WORLD)
    results = measure(placement, device, sizes, iters, warmup)
    return {"placement": placement.as_dict(), "hosts_line": placement.hosts_line(),
            "backend": dist.get_backend(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "results": [asdict(r) for r in results], "cluster_fields": cluster_fields(results)}


def markdown(report: dict) -> str:
    lines = [f"# All-reduce bandwidth ({report['backend']}, {report['device']}; {report['hosts_line']})\n",
             "| scope | ranks/group | groups at once | bytes | time (us) | algbw GB/s | busbw GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['scope']} | {r['ranks']} | {r['groups']} | {r['bytes']:,} | {r['seconds'] * 1e6:,.1f} | "
                     f"{r['algbw_gbps']:.2f} | {r['busbw_gbps']:.2f} |")
    fields = report["cluster_fields"]
    lines += ["", "For a cluster file (`repro plan --cluster FILE`; the other fields from spec sheets and gpu_bench):",
              "```yaml", *[f"{k}: {v:.4g}" for k, v in fields.items()], "```"]
    if "node_net_gbps" not in fields:
        lines.append("(one host: nothing measured across nodes; run it on two nodes for node_net_gbps)")
    lines.append(f"\n{report['provenance']}")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> str:
    """comm_bench.json and comm_bench.md under `out`, atomically; returns the Markdown."""
    import datetime
    import platform

    from repro.provenance import git_sha, write_atomic

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {**report, "provenance": f"Measured by `repro comm-bench` on {platform.node()}, {stamp}, git {git_sha()}, "
                                      f"torch {torch.__version__}."}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "comm_bench.json", json.dumps(report, indent=1).encode())
    md = markdown(report)
    write_atomic(out / "comm_bench.md", md.encode())
    return md

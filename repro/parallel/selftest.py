"""`repro selftest`: run the TP/DP correctness checks on this hardware and print a table.

    repro selftest --nproc 4                    # spawns 4 local ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 8 -m repro.parallel.selftest   # under torchrun / srun

Exits non-zero if any check fails: a user's way to trust the implementation on their cluster.
"""

from __future__ import annotations

import math
import sys

import torch

DEFAULT_NPROC = 2
"""Local ranks `repro selftest` spawns without --nproc, outside a launch of several ranks."""


def layouts_for(world_size: int, max_tp: int = 8) -> list[tuple[int, int]]:
    """Every (tp, dp) with tp * dp == world_size and tp <= max_tp, serial first."""
    return [(tp, world_size // tp) for tp in range(1, min(world_size, max_tp) + 1) if world_size % tp == 0]


def _device_for_rank() -> str:
    from repro.parallel.groups import discover_launch_env

    return str(discover_launch_env().device())


def rank_main(world_size: int) -> list[dict]:
    """Body of one rank (the world is already initialised)."""
    from repro.parallel.checks import run_all

    return run_all(layouts_for(world_size), device=_device_for_rank())


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Combine every rank's rows: worst error per check."""
    merged: dict[str, dict] = {}
    for rows in per_rank:
        for row in rows:
            best = merged.setdefault(row["name"], dict(row))
            if math.isnan(row["max_error"]) or row["max_error"] > best["max_error"]:  # max() drops a later NaN
                best["max_error"] = row["max_error"]
            best["passed"] = best["max_error"] <= best["tolerance"]
    return list(merged.values())


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("check", "max error", "tolerance", "result"):
        table.add_column(col)
    for r in rows:
        verdict = "[green]pass[/]" if r["passed"] else "[red]FAIL[/]"
        table.add_row(r["name"], f"{r['max_error']:.2e}", f"{r['tolerance']:.0e}", verdict)
    Console(width=120).print(table)


def _refuse_forced_tf32(backend: str) -> None:
    """NGC containers export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which makes every fp32 matmul TF32
    (10-bit mantissa): the fp32 checks' 1e-5 would fail a correct implementation."""
    import os

    from repro.cli import UserError

    if backend == "nccl" and os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0") not in ("", "0"):
        raise UserError("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE is set (NGC containers set it): every fp32 matmul runs "
                        "in TF32, and the fp32 checks (tolerance 1e-5) would fail correct code. Fix: "
                        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 repro selftest ...")


def _run(args) -> int:
    import torch.distributed as dist

    from repro.parallel.spawn import check_gpu_count, run_ranks

    from repro.parallel.groups import default_backend, discover_launch_env, spawns_ranks

    backend = default_backend()
    _refuse_forced_tf32(backend)
    launch = discover_launch_env()
    if launch.launched and not spawns_ranks(launch, args.nproc):  # the ranks of torchrun / srun
        from repro.parallel.groups import init_distributed

        torch.set_num_threads(1)
        pg = init_distributed(tp=1)
        if pg.rank == 0:
            print(f"placement: {pg.placement.hosts_line()}", flush=True)
        rows = rank_main(pg.dims.world_size)
        gathered = [None] * pg.dims.world_size
        dist.all_gather_object(gathered, rows)
        if pg.rank != 0:
            return 0
        rows, world = merge(gathered), pg.dims.world_size
    else:
        from repro.cli import UserError

        world = DEFAULT_NPROC if args.nproc is None else args.nproc
        if world < 1:
            raise UserError(f"--nproc {world}: spawn at least one rank. Fix: e.g. --nproc 2")
        try:
            check_gpu_count(world, backend)
        except ValueError as err:
            raise UserError(str(err)) from None
        rows = merge(run_ranks(rank_main, world, world, timeout=args.timeout, backend=backend))
    print_table(rows, f"repro selftest: {world} ranks, {backend}, torch {torch.__version__}")
    failed = [r["name"] for r in rows if not r["passed"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed")
    return 1 if failed else 0


def register(sub) -> None:
    p = sub.add_parser("selftest", help="check that every TP/DP layout reproduces the serial model")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"local ranks to spawn (default {DEFAULT_NPROC}; not under torchrun/srun with several ranks)")
    from repro.cli import positive_seconds

    p.add_argument("--timeout", type=positive_seconds, default=600, help="seconds before a hung check is killed")
    p.set_defaults(func=_run)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    sys.exit(_run(parser.parse_args(["selftest", *sys.argv[1:]])))

"""`repro bench`, `repro scaling-model` and `repro plan`: benchmarks, the analytic scaling model, and
memory and time of a run config before launch."""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the perf subcommands to the `repro` command."""
    p = sub.add_parser("bench", help="CPU benchmarks: vs Hugging Face GPT-2, TP=2 communication, memory")
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    p.add_argument("--rounds", type=int, default=8, help="interleaved timed rounds per model")
    p.add_argument("--tiny", action="store_true", help="a tiny model (tests)")
    p.add_argument("--no-zero", action="store_true", help="skip the DeepSpeed ZeRO-1/2 measurement")
    p.set_defaults(func=_bench)
    s = sub.add_parser("scaling-model", help="predict Table 1's weak-scaling efficiency on a described cluster")
    s.add_argument("--out", type=Path, default=None,
                   help="default: results/scaling_model (the committed tables of dgx2h and h200); with "
                        "--cluster, results/scaling_model_<clusters>, so the committed tables stay whole")
    s.add_argument("--cluster", action="append", default=None, metavar="NAME|FILE",
                   help="dgx2h, h200, or a cluster YAML (slurm/clusters/*.yaml); repeatable (default: dgx2h and h200)")
    s.set_defaults(func=_scaling)
    c = sub.add_parser("comm-bench", help="all-reduce bandwidth and latency inside and across nodes (for --cluster FILE)")
    c.add_argument("--out", type=Path, default=Path("results/bench/comm"))
    c.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default 2; not under torchrun/srun with several ranks)")
    c.add_argument("--sizes", default="8,1M,16M,64M", help="message sizes in bytes, comma-separated (K, M suffixes)")
    c.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (their median is kept)")
    c.set_defaults(func=_comm_bench)
    pl = sub.add_parser("plan", help="memory per GPU and time to train of a config on a cluster, before launch")
    pl.add_argument("config", type=Path, nargs="?", help="a training config (or --paper)")
    pl.add_argument("--gpus", type=int, default=None,
                    help="GPUs of the run (default: what the slurm/ script running this config asks for)")
    pl.add_argument("--cluster", default=None, metavar="NAME|FILE",
                    help="dgx2h: the paper's V100 32 GB servers; h200: 8x H200 nodes (default); or your own, "
                         "described in a YAML file like slurm/clusters/h200.yaml (with --paper: only that one)")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--paper", action="store_true",
                    help="every slurm/ training script's config at its GPU count on both clusters, as a table")
    pl.add_argument("--out", type=Path, default=None, help="with --paper: also write paper_configs.{md,csv} here")
    pl.set_defaults(func=_plan)


def _bench(args) -> int:
    import sys

    from repro.cli import UserError
    from repro.perf.bench import BenchSettings, run_bench
    from repro.provenance import make_out_dir

    if args.rounds < 1:
        raise UserError(f"--rounds={args.rounds} must be at least 1")
    make_out_dir(args.out, "results/bench")
    st = BenchSettings(rounds=args.rounds, zero=not args.no_zero)
    if args.tiny:
        st = BenchSettings(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                           vocab_size=1024, batch=2, rounds=args.rounds, warmup=1, zero=not args.no_zero)
    report = run_bench(args.out, st, sys.argv[1:])
    print((args.out / "bench_cpu.md").read_text())
    return 0 if report["tp_comm"]["equal_on_every_rank"] else 1


def parse_sizes(text: str) -> list[int]:
    """'8,1M,16M' -> [8, 1048576, 16777216]; anything else is a UserError naming the form."""
    from repro.cli import UserError

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        number, unit = (item[:-1], units[item[-1]]) if item[-1:] in units else (item, 1)
        if not number.isdigit() or int(number) * unit < 1:
            raise UserError(f"--sizes {text}: {item!r} is not a size in bytes. Fix: e.g. --sizes 8,1M,64M")
        sizes.append(int(number) * unit)
    return sizes


def _comm_bench(args) -> int:
    from repro.cli import UserError
    from repro.parallel.groups import default_backend, discover_launch_env, init_distributed, spawns_ranks
    from repro.parallel.spawn import check_gpu_count, run_ranks
    from repro.perf.comm_bench import rank_main, write_report
    from repro.provenance import make_out_dir

    sizes = parse_sizes(args.sizes)
    if args.iters < 1:
        raise UserError(f"--iters {args.iters}: time at least one all-reduce. Fix: e.g. --iters 10")
    make_out_dir(args.out, "results/bench/comm")
    launch = discover_launch_env()
    if launch.launched and not spawns_ranks(launch, args.nproc):  # the ranks of torchrun / srun
        pg = init_distributed(tp=1)
        report = rank_main(sizes, args.iters, warmup=3)
        if pg.rank != 0:
            return 0
    else:
        nproc = 2 if args.nproc is None else args.nproc
        if nproc < 2:
            raise UserError(f"--nproc {nproc}: an all-reduce needs at least 2 ranks. Fix: --nproc 2")
        try:
            check_gpu_count(nproc, default_backend())
        except ValueError as err:
            raise UserError(str(err)) from None
        report = run_ranks(rank_main, nproc, sizes, args.iters, 3, backend=default_backend())[0]
    print(write_report(report, args.out))
    return 0


def _scaling(args) -> int:
    from repro.perf.scaling_model import write_tables
    from repro.provenance import make_out_dir

    clusters = [_cluster(spec) for spec in args.cluster] if args.cluster else None
    out = args.out or scaling_out_dir(args.cluster)
    make_out_dir(out, "results/scaling_model")
    print(write_tables(out, clusters))
    return 0


def scaling_out_dir(cluster_specs: list[str] | None) -> Path:
    """Where `repro scaling-model` writes without --out: the committed tables for the built-in
    clusters, a folder of their own for any --cluster choice (its stems joined: mine.yaml, dgx2h ->
    results/scaling_model_mine-dgx2h)."""
    if not cluster_specs:
        return Path("results/scaling_model")
    stems = (re.sub(r"[^A-Za-z0-9_.]+", "_", Path(spec).stem) for spec in cluster_specs)
    return Path("results/scaling_model_" + "-".join(stems))


def _cluster(spec: str):
    """The Cluster a --cluster value names; a bad one is a UserError naming the fix."""
    from repro.cli import UserError
    from repro.perf.clusters import ClusterSpecError, load_cluster

    try:
        return load_cluster(spec)
    except ClusterSpecError as err:
        raise UserError(str(err)) from None


def _script_gpus(config: Path) -> int | None:
    """The task count of the slurm/ script that trains `config`, if the training scripts agree on one."""
    from repro.launch.scripts import job_scripts

    try:
        wanted = config.resolve()
        counts = {s.ntasks for s in job_scripts() if s.config and "launch_train" in s.path.read_text()
                  and (s.path.parents[1] / s.config).resolve() == wanted}
    except (OSError, ValueError):
        return None
    return counts.pop() if len(counts) == 1 else None


def _plan(args) -> int:
    import json

    from repro.cli import UserError
    from repro.parallel.groups import LayoutError
    from repro.perf.plan import format_plan, plan, plan_dict
    from repro.train.config import RunConfigError, load_config

    _check_plan_flags(args)
    if args.paper:
        return _plan_paper(args)
    cluster = _cluster(args.cluster or "h200")
    if args.config is None:
        raise UserError("repro plan: give a training config (e.g. experiments/gpt2/gpt2_8.3b.yaml), or --paper")
    if Path(args.config).is_dir():
        example = min(Path(args.config).glob("*.yaml"), default="experiments/scaling/scale_8b.yaml")
        raise UserError(f"{args.config} is a directory, not a config file. Fix: give one of its .yaml files, "
                        f"e.g. {example}")
    if not Path(args.config).is_file():
        raise UserError(f"config file {args.config} does not exist: check the path (the paper's configs are "
                        "under experiments/, e.g. experiments/scaling/scale_8b.yaml)")
    gpus = args.gpus if args.gpus is not None else _script_gpus(args.config)
    if gpus is None:
        raise UserError(f"{args.config}: no slurm/ script runs this config, so the GPU count is unknown. "
                        "Fix: pass --gpus N")
    try:
        cfg = load_config(args.config, args.set)
        result = plan(cfg, gpus, cluster)
    except (RunConfigError, LayoutError, ValueError) as err:
        raise UserError(f"{args.config} at {gpus} GPUs: {err}") from None
    print(json.dumps(plan_dict(result), indent=2) if args.json else format_plan(result, cfg))
    return 0


def _check_plan_flags(args) -> None:
    """A UserError for flags the chosen mode would ignore: --out is --paper's; a config, --gpus, --set and
    --json are one config's."""
    from repro.cli import UserError

    if not args.paper and args.out is not None:
        raise UserError("repro plan: --out writes the --paper table; one config's plan is printed. Fix: add "
                        "--paper, or drop --out (--json prints the plan as JSON)")
    ignored = [flag for flag, given in (("a config", args.config is not None), ("--gpus", args.gpus is not None),
                                        ("--set", bool(args.set)), ("--json", args.json)) if given]
    if args.paper and ignored:
        raise UserError(f"repro plan --paper plans every slurm/ script's config at its own GPU count, so "
                        f"{', '.join(ignored)} would be ignored. Fix: drop them, or plan that one config "
                        "without --paper")


def _plan_paper(args) -> int:
    from repro.perf.plan import paper_config_markdown, paper_config_rows
    from repro.perf.scaling_model import _csv
    from repro.provenance import make_out_dir, write_atomic

    if args.out is not None:
        make_out_dir(args.out, "results/plan")
    rows = paper_config_rows({args.cluster: _cluster(args.cluster)} if args.cluster else None)
    md = paper_config_markdown(rows)
    if args.out is not None:
        write_atomic(args.out / "paper_configs.csv", _csv(rows))
        write_atomic(args.out / "paper_configs.md", md.encode())
    print(md)
    return 0

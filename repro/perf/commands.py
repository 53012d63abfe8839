"""`repro bench` and `repro scaling-model`: performance benchmarks and the analytic scaling model."""

from __future__ import annotations

import argparse
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
    s.add_argument("--out", type=Path, default=Path("results/scaling_model"))
    s.set_defaults(func=_scaling)


def _bench(args) -> int:
    import sys

    from repro.cli import UserError
    from repro.perf.bench import BenchSettings, run_bench

    if args.rounds < 1:
        raise UserError(f"--rounds={args.rounds} must be at least 1")
    st = BenchSettings(rounds=args.rounds, zero=not args.no_zero)
    if args.tiny:
        st = BenchSettings(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                           vocab_size=1024, batch=2, rounds=args.rounds, warmup=1, zero=not args.no_zero)
    report = run_bench(args.out, st, sys.argv[1:])
    print((args.out / "bench_cpu.md").read_text())
    return 0 if report["tp_comm"]["equal_on_every_rank"] else 1


def _scaling(args) -> int:
    from repro.cli import UserError
    from repro.perf.scaling_model import write_tables

    blocking = next((p for p in (args.out, *args.out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"--out {args.out}: {blocking} is a file, not a directory (the tables are written "
                        "into a directory). Fix: give a directory path, e.g. --out results/scaling_model")
    print(write_tables(args.out))
    return 0

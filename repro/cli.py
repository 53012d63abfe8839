"""The `repro` command. Each area registers its own subcommands; heavy imports happen inside them.

    repro sizes                         the paper's named model sizes with parameter counts
    repro selftest --nproc 2            TP/DP correctness checks on this hardware
    repro data fetch | prepare          evaluation data, vocabularies, indexed datasets
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules exposing `register(subparsers)`; a module that does not exist yet is skipped.
COMMAND_MODULES = (
    "repro.models.commands",
    "repro.parallel.selftest",
    "repro.data.commands",
    "repro.train.commands",
    "repro.eval.commands",
    "repro.eval.race",
    "repro.tracking.commands",
    "repro.analysis.commands",
    "repro.perf.commands",
    "repro.demo",
    "repro.launch.commands",
)


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="repro", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and name.startswith(err.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from repro.cli import main as package_main  # under `python -m`, handlers raise repro.cli.UserError

    sys.exit(package_main())

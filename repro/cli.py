"""The `repro` command: reproduce Megatron-LM (Shoeybi et al., 2019) from data to the paper's tables.

Each area's module registers its subcommands (`repro --help` lists them); heavy imports happen
inside the commands, so `repro --help` stays fast.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from repro.versions import installed_torch, torch_version_problem

# Modules exposing `register(subparsers)`, in the order `repro --help` lists their commands.
COMMAND_MODULES = (
    "repro.models.commands",
    "repro.parallel.selftest",
    "repro.data.commands",
    "repro.train.commands",
    "repro.eval.commands",
    "repro.eval.generate",
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
        importlib.import_module(name).register(sub)
    return parser


def in_srun_task(environ=None) -> bool:
    """This process is a task of an srun step (Slurm sets SLURM_STEP_ID there). A batch script's own
    shell also carries SLURM_PROCID=0 and the job's SLURM_NTASKS, but is no rank of a launch: a command
    it runs directly is one process, which `--nproc` may spawn ranks from."""
    import os

    env = os.environ if environ is None else environ
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def srun_world_size(env) -> int:
    """The task count of this srun step: SLURM_STEP_NUM_TASKS (SLURM_NTASKS is the allocation's in a
    shell started with `srun --preserve-env`, as salloc's interactive step may be)."""
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)


def _launched_train(argv: list[str] | None) -> bool:
    """This process is a rank of `repro train` under srun or torchrun (not a one-rank launch whose
    `--nproc` spawns the ranks: repro.train.commands)."""
    import os

    words = sys.argv[1:] if argv is None else argv
    if words[:1] != ["train"]:
        return False
    try:
        world = (int(os.environ["WORLD_SIZE"]) if {"RANK", "WORLD_SIZE"} <= os.environ.keys() else
                 srun_world_size(os.environ) if in_srun_task() else 0)
    except ValueError:
        return True  # (init_distributed names the bad value)
    spawns = world == 1 and any(w == "--nproc" or w.startswith("--nproc=") for w in words)
    return world > 0 and not spawns


def _exit_now(code: int) -> None:
    """End a finished rank without interpreter finalization: its run is closed, its files written and
    its group destroyed, but threads of the communication libraries (gloo, DeepSpeed's) can still be
    torn down in the wrong order at shutdown and abort the rank ("terminate called without an active
    exception", seen on one rank of a 4-rank DeepSpeed ZeRO-1 run across two Slurm nodes), which
    fails the whole step after a good run."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_stop_signals_early(argv: list[str] | None) -> None:
    """A rank of `repro train` under srun or torchrun records SIGTERM and SIGUSR1 from here on, before
    building the parser imports torch (about 2 s here; minutes from shared storage on hundreds of
    ranks): their default action would kill it, failing the job with no checkpoint and no requeue.
    The trainer adopts the recorded signal (repro.train.signals) and stops after its first step."""
    if _launched_train(argv):
        import signal

        from repro.train.signals import STOP_SIGNALS, PendingStop

        pending = PendingStop()
        for sig in STOP_SIGNALS:
            signal.signal(sig, pending)


def main(argv: list[str] | None = None) -> int:
    _record_stop_signals_early(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a command may say where such arguments belong (`unknown_hint`)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{getattr(args, 'unknown_hint', '')}")
    problem = torch_version_problem(installed_torch())  # metadata only: `repro plan` imports no torch
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    started_with_a_group = _has_process_group()
    try:
        code = _run_command(args)
    finally:
        if not started_with_a_group:
            _release_command_group()
    if _launched_train(argv) and not started_with_a_group:
        _exit_now(code)
    return code


def _run_command(args: argparse.Namespace) -> int:
    from repro.provenance import OutDirError  # an --out that is a file: the user's to fix, like a UserError

    try:
        return int(args.func(args) or 0)
    except (UserError, OutDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the command's own cleanup ran on the way here; no traceback
        return _interrupted()
    except Exception as err:
        from repro.provenance import error_chain, full_disk_behind

        if (full := full_disk_behind(err)) is not None:  # (also under torch's RuntimeError)
            print(f"error: {disk_full(full)}", file=sys.stderr)
            return 2
        if any(isinstance(e, KeyboardInterrupt) for e in error_chain(err)):  # a cleanup that failed on the
            return _interrupted()                                              # way out (nbclient's)
        raise


def _interrupted() -> int:
    print("\ninterrupted (Ctrl-C)", file=sys.stderr)
    return 130


def positive_seconds(text: str) -> float:
    """argparse type of a time limit: a finite number of seconds > 0 (`--timeout 0`, `nan` or `inf` ended
    a launch in a TimeoutError, ValueError or OSError traceback)."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds (e.g. 600)")
    return value


class DiskFullError(UserError):
    """A full disk or quota (its message: `disk_full`), raised in a rank: the launcher reports it in one line."""


def disk_full(err: OSError) -> str:
    """A full disk or quota (any command, any file): what, where, and the fix, without a traceback."""
    where = f" writing {err.filename}" if err.filename else ""
    return (f"{err.strerror}{where}. Fix: free space on that filesystem (or raise the quota), or point the "
            "command's output elsewhere, and run it again")


def _release_command_group() -> None:
    """End the group a command created (torchrun, srun; NCCL warns at exit or hangs without) and free
    its backend objects now, while the interpreter is alive.

    `destroy_process_group` only forgets a group: gloo's worker threads are joined when the Python
    objects are freed, and a failed command leaves them in its traceback's reference cycle, which only
    interpreter shutdown would collect. A worker that then frees a tensor takes the GIL during
    finalization and the process aborts ("terminate called without an active exception", about 1
    run in 100 of a command that fails with a UserError).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:  # no torch: no group (`repro plan`)
        return
    if _has_process_group():
        dist.destroy_process_group()
    gc.collect()


def _has_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no group, and no torch import for `repro plan`
    return dist is not None and dist.is_available() and dist.is_initialized()


if __name__ == "__main__":
    from repro.cli import main as package_main  # under `python -m`, handlers raise repro.cli.UserError

    sys.exit(package_main())

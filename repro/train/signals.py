"""Stop signals that arrive before the trainer's own handler exists.

Slurm's warning (SIGUSR1) or a TERM can reach a rank while it is still importing torch or joining
its process group; their default action would kill it, failing the job instead of checkpointing.
`repro train` as a launched rank records them from the first line of `repro.cli.main`, before torch is
imported, and `recording_stop_signals` keeps them through its setup; `loop.StopSignal`
adopts what was recorded.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PendingStop:
    """A signal handler that records the last stop signal received."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, _frame) -> None:
        self.received = signum


@contextmanager
def recording_stop_signals() -> Iterator[PendingStop]:
    """SIGTERM and SIGUSR1 recorded by one PendingStop (the installed one, if there is one already)
    inside the block; the previous handlers are back afterwards."""
    current = signal.getsignal(signal.SIGUSR1)
    pending = current if isinstance(current, PendingStop) else PendingStop()
    previous = {sig: signal.signal(sig, pending) for sig in STOP_SIGNALS}
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_for_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def exiting_on_stop_signals() -> Iterator[None]:
    """Inside the block, SIGTERM or SIGUSR1 (Slurm's warning before a time limit, scancel) is SystemExit,
    so a command's cleanup of its temporary files runs (`repro data prepare`'s tens of GB at the paper's
    scale, a `repro checkpoint` command's half-written output). The caller's handlers are back
    afterwards: a Python TERM handler left in a process that goes on hung a later multiprocessing pool's
    terminate() in that process (most likely a worker that got the pool's TERM while being forked lost it)."""
    previous = {sig: signal.signal(sig, _exit_for_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

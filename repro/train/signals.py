"""Stop signals (SIGTERM, SIGUSR1): recorded before the trainer's own handler exists, turned into
SystemExit inside a command, or held back until a block of renames is done.

Slurm's warning (SIGUSR1) or a TERM can reach a rank while it is still importing torch or joining
its process group; their default action would kill it, failing the job instead of checkpointing.
`repro train` as a launched rank records them from the first line of `repro.cli.main`, before torch is
imported, and `recording_stop_signals` keeps them through its setup; `loop.StopSignal`
adopts what was recorded. `exiting_on_stop_signals` lets a command's cleanup run;
`stop_signals_deferred` keeps a stop from landing between the renames that publish a dataset or
a report.
"""

from __future__ import annotations

import signal
import threading
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


@contextmanager
def exiting_on_stop_signals(noted: list[int] | None = None) -> Iterator[None]:
    """Inside the block, SIGTERM or SIGUSR1 (Slurm's warning before a time limit, scancel) is SystemExit
    (appended to `noted` first, for a caller whose SystemExit some library turns into another error),
    so a command's cleanup of its temporary files runs (`repro data prepare`'s tens of GB at the paper's
    scale, a `repro checkpoint` command's half-written output). The caller's handlers are back
    afterwards: a Python TERM handler left in a process that goes on hung a later multiprocessing pool's
    terminate() in that process (most likely a worker that got the pool's TERM while being forked lost it)."""
    def exit_for_signal(signum: int, _frame) -> None:
        if noted is not None:
            noted.append(signum)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, exit_for_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """TERM, USR1 and INT that arrive inside the block take effect as it ends. Blocking them
    (`repro.data.preprocess.stop_signals_blocked`) is not enough here: with them masked in this thread the kernel hands a process-wide signal to another
    thread (tqdm's monitor, the tokenizer's pool), and Python runs its handler in the main thread all
    the same. So their Python handlers are swapped for one that notes the signal; at the end the old
    ones are put back and the first noted signal is raised again. Off the main thread nothing is
    needed: Python handlers only ever interrupt the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    swapped = [sig for sig in (*STOP_SIGNALS, signal.SIGINT)  # (Ctrl-C's KeyboardInterrupt too)
               if signal.getsignal(sig) not in (None, signal.SIG_IGN)]  # None: not set from Python
    previous = {sig: signal.signal(sig, lambda signum, _frame: noted.append(signum)) for sig in swapped}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])

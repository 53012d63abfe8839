"""Stop signals that arrive before the trainer's own handler exists.

Slurm's warning (SIGUSR1) or a TERM can reach a rank while it is still importing torch or joining
its process group; their default action would kill it, failing the job instead of checkpointing.
`repro train` installs `PendingStop` first thing; `loop.StopSignal` adopts what it recorded.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PendingStop:
    """A signal handler that records the last stop signal received."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, _frame) -> None:
        self.received = signum


def record_stop_signals() -> PendingStop:
    """Install one PendingStop for SIGTERM and SIGUSR1 (the installed one, if there is one already)."""
    current = signal.getsignal(signal.SIGUSR1)
    pending = current if isinstance(current, PendingStop) else PendingStop()
    for sig in STOP_SIGNALS:
        signal.signal(sig, pending)
    return pending

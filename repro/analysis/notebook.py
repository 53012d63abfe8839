"""Execute the analysis notebooks headless with nbclient, papermill-style parameter injection.

The first cell of each notebook is tagged `parameters`; the runner inserts a cell after it that
assigns the caller's values (tagged `injected-parameters`), then executes every cell in
the notebook's own folder. A failing cell raises NotebookError naming the notebook and the cell;
SIGTERM or SIGUSR1 while a kernel runs interrupts it and raises NotebookStopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

from repro.tracking.store import project_root
from repro.train.signals import STOP_SIGNALS

NOTEBOOKS = ("scaling", "zero_shot", "bert")
TABLES = {"scaling": ("scaling_table.md", "scaling_appendix_d.md", "scaling_baseline.md"), "zero_shot": ("zero_shot_table.md", "gpt2_table2.md"),
          "bert": ("bert_table.md",)}
FIGURES = {"scaling": ("fig_scaling.png",), "zero_shot": ("fig6_valid_ppl.png",), "bert": ("fig7_layernorm_order.png",)}


class NotebookError(RuntimeError):
    """A notebook cell failed; the message names the notebook, the cell and the error."""


class NotebookStopped(Exception):
    """SIGTERM or SIGUSR1 arrived while a notebook ran: its kernel was interrupted and shut down."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _StopOnSignal:
    """nbclient hooks: while a kernel runs, SIGTERM and SIGUSR1 (scancel, Slurm's time limit, `kill`)
    are noted and interrupt the kernel, so its cell ends and nbclient shuts it down as after any
    failed cell. nbclient's own TERM handler shut the kernel down under the running cell, and its
    cleanup then failed (AssertionError); a Python handler's SystemExit, raised inside the event
    loop, left the kernel writing to a closed socket (a zmq traceback)."""

    def __init__(self) -> None:
        self.client = None
        self.received: int | None = None

    async def take_signals(self, **_) -> None:
        """on_notebook_start: inside the event loop, after nbclient installed its handlers."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):  # (off the main thread: signals are not ours to take)
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self._stop, sig)

    async def give_back_signals(self, **_) -> None:
        """on_notebook_complete (nbclient removes TERM's handler itself)."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)

    def _stop(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
            asyncio.ensure_future(self._interrupt())

    async def _interrupt(self) -> None:
        from nbclient.util import ensure_async

        with contextlib.suppress(Exception):  # a kernel the signal reached too (scancel) is gone already
            await ensure_async(self.client.km.interrupt_kernel())


def notebook_path(name: str) -> Path:
    """analysis/<name>.ipynb of the repository."""
    return project_root() / "analysis" / f"{name}.ipynb"


def inject_parameters(nb, params: dict) -> None:
    """Insert a cell assigning `params` right after the cell tagged `parameters` (else at the top)."""
    import nbformat

    source = "# Injected by repro report\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    nb.cells.insert(tagged[0] + 1 if tagged else 0, cell)


def execute(path: Path, params: dict, timeout: int = 900, failed_copy: Path | None = None):
    """Run every cell of the notebook at `path` with `params` injected; returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    if not path.exists():
        raise NotebookError(f"notebook {path} does not exist")
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, params)
    stop = _StopOnSignal()
    client = stop.client = NotebookClient(nb, timeout=timeout, kernel_name="python3", config=_kernel_config(),
                                          resources={"metadata": {"path": str(path.parent)}},
                                          on_notebook_start=stop.take_signals,
                                          on_notebook_complete=stop.give_back_signals)
    with _handlers_kept():
        try:
            client.execute()
        except Exception as err:
            if stop.received is None and isinstance(err, CellExecutionError):
                where = _keep_failed(nb, failed_copy) if failed_copy else ""
                raise NotebookError(f"{path.name} failed{where}:\n{str(err).strip()[-2000:]}") from None
            if stop.received is None:
                raise
    if stop.received is not None:
        raise NotebookStopped(stop.received)
    return nb


def _kernel_config():
    """Encrypt the kernel's loopback sockets with CurveZMQ keys its manager provisions (jupyter_client's
    `transport_encryption`: jupyter_client >= 8.9, ipykernel >= 7.3 and a libzmq with libsodium). Otherwise
    every cell and output crosses TCP in plain text, and ipykernel warns so in each report."""
    import zmq
    from traitlets.config import Config

    config = Config()
    if zmq.has("curve"):
        config.KernelManager.transport_encryption = "auto"
    return config


@contextlib.contextmanager
def _handlers_kept():
    """The caller's Python handlers of the stop signals are back afterwards: nbclient leaves TERM at
    its default action (killing the report without removing its staging folder)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _keep_failed(nb, failed_copy: Path) -> str:
    """Write the failed notebook's executed copy; the error's note on where it is, or why it is not
    (the cell's error stays the news)."""
    import nbformat

    try:
        failed_copy.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, failed_copy)
    except OSError as err:
        return f" (its executed copy could not be written to {failed_copy}: {err})"
    return f" (executed copy: {failed_copy})"

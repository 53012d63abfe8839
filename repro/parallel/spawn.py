"""Run a function on N local ranks (gloo on CPU, NCCL on GPU) with a hang timeout.

Used by the tests, `repro train --nproc N` and `repro selftest --nproc N`. The function must be
importable (defined at module level); its return value must be picklable (plain numbers, lists, dicts).

gloo ranks fork from a fork server (multiprocessing's forkserver) that imported torch at the first
launch; each launch hands them the caller's environment variables, stdout and stderr, whether it
ignores SIGINT, and fresh NumPy entropy. What they still take from the first launch: other ignored
signals, the signal mask, resource limits and umask (none of which repro changes). NCCL ranks are
spawned afresh.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_lib
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


# what a rank reports on the launch's queue, with its rank and a value
_JOINED, _DONE, _FAILED = "joined", "done", "failed"


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_gpu_count(world_size: int, backend: str, visible: int | None = None) -> None:
    """Raise ValueError when NCCL ranks would outnumber the visible GPUs (rank r uses GPU r)."""
    if backend != "nccl":
        return
    visible = torch.cuda.device_count() if visible is None else visible
    if world_size > visible:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs (one per rank), but {visible} "
                         f"{'is' if visible == 1 else 'are'} visible: spawn at most {visible} ranks "
                         "(--nproc), or use more GPUs (check CUDA_VISIBLE_DEVICES)")


class _CallerContext:
    """What a forked rank takes from its caller at each launch: the environment variables, where
    stdout and stderr go (a pytest capture, a redirect) and whether SIGINT is ignored (a job started
    in the background of a script ignores it). Ranks forked from the fork server would otherwise keep
    the server's, from the first launch. (Spawned ranks inherit them already.)"""

    def __init__(self, environ: dict[str, str], fds: dict[int, Any], sigint_ignored: bool = False) -> None:
        self.environ, self.fds, self.sigint_ignored = environ, fds, sigint_ignored

    @classmethod
    def here(cls) -> "_CallerContext":
        """The caller's context; call it before opening the rank's queue, so that a closed stdout or
        stderr is seen closed, not as the number the queue's pipe took."""
        return cls(dict(os.environ), {fd: fd for fd in (1, 2) if _is_open(fd)},
                   signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

    def __reduce__(self):  # pickled while the rank starts: the caller's descriptors are sent with it
        return _CallerContext._received, (self.environ, {fd: reduction.DupFd(fd) for fd in self.fds},
                                          self.sigint_ignored)

    @staticmethod
    def _received(environ: dict[str, str], dups: dict, sigint_ignored: bool) -> "_CallerContext":
        return _CallerContext(environ, {fd: dup.detach() for fd, dup in dups.items()}, sigint_ignored)

    def adopt(self, own_sigint: bool = False) -> None:
        """In the rank: take the caller's environment, output descriptors and SIGINT handling (unless
        the rank handles SIGINT itself: `own_sigint`)."""
        if not own_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN if self.sigint_ignored else signal.default_int_handler)
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, received in self.fds.items():
            if received != fd:
                os.dup2(received, fd)
                os.close(received)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def join_process_group(backend: str, store: str, rank: int, world_size: int) -> None:
    """Join the launch's process group through a file rendezvous: a free port picked by the launcher
    could be taken by another process before rank 0 binds it (EADDRINUSE, seen on a busy CI machine);
    MASTER_PORT stays set for code that reads it."""
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))


def leave_process_group(backend: str) -> None:
    """Leave the process group once every rank has come here: a rank that closed its gloo pairs while
    a peer was still connecting a subgroup (`dist.new_group`) made that peer fail with
    `connectFullMesh ... Connection closed by peer` (16 of 200 launches of a function that only
    creates one, on 2 busy cores; none of 200 with this barrier)."""
    if not dist.is_initialized():
        return
    if backend == "gloo":
        dist.barrier()
    dist.destroy_process_group()


def _entry(rank, world_size, port, store, backend, fn, args, results, caller: _CallerContext | None,
           start, join: Callable, timeout: float, launcher: int, forwarded: bool) -> None:
    if forwarded:
        _leave_stops_to_the_launcher()
    _die_with(launcher)
    if caller is not None:
        caller.adopt(own_sigint=forwarded)
        _reseed_numpy()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one intra-op thread per rank: oversubscribed cores are ~10x slower
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        join(backend, store, rank, world_size)
        # fn starts on no rank before every rank's join has returned. Before, a rank whose fn needs no
        # collective could return and close its gloo pairs while a descheduled peer was still inside
        # its join, which then read the closed socket: `connectFullMesh failed ... Connection closed
        # by peer`, once in CI; 6 of 300 no-op launches on 2 busy cores, none of 300 since.
        results.put((rank, _JOINED, None))
        if not start.wait(timeout):
            raise TimeoutError(f"the launcher did not start the ranks within {timeout:.0f} s of this one joining")
        # pickled here, by value: an error is the caller's to see (not lost in the queue's feeder
        # thread), and a tensor is not handed over as a shared-memory fd that dies with this process
        value = pickle.dumps(fn(*args))
        leave_process_group(backend)
        results.put((rank, _DONE, value))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, _FAILED, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_stops_to_the_launcher() -> None:
    """In a rank whose launcher forwards stop signals (`repro train --nproc N`): SIGINT is ignored, since a
    terminal's Ctrl-C reaches every process of the group and the launcher passes it on as SIGTERM (it was
    a KeyboardInterrupt in each rank wherever it stood: inside torch.save, a barrier; no checkpoint); and
    SIGTERM and SIGUSR1 are recorded from the rank's first line, for the trainer to adopt
    (repro.train.signals), not its default action that killed a rank still starting."""
    from repro.train.signals import STOP_SIGNALS, PendingStop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pending = PendingStop()
    for sig in STOP_SIGNALS:
        signal.signal(sig, pending)


def _die_with(launcher: int) -> None:
    """SIGKILL this rank when the launcher process ends without stopping it (itself SIGKILLed, or the
    OOM killer): no orphan trains on. A pidfd watch, not prctl(PR_SET_PDEATHSIG): a forked rank's
    parent is the fork server, which outlives a killed launcher (every rank holds its liveness pipe)
    and dies of a TERM sent to the whole process group while the ranks must live on to checkpoint.
    Nothing is watched where Linux's pidfd_open is missing."""
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:  # gone before this rank started
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return
    threading.Thread(target=_kill_self_when_ready, args=(fd,), name="repro-launcher-watch", daemon=True).start()


def _kill_self_when_ready(fd: int) -> None:
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _reseed_numpy() -> None:
    """NumPy's global generator from fresh entropy, as in a new process (forked ranks would share the
    fork server's state)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


# What a CPU rank imports anyway, loaded once by the fork server (the first launch), not by every rank
# of every launch: about 2.5 s less per launch of the tiny test model on 2 cores
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "repro.train.loop"]


def _start_context(backend: str):
    """forkserver for gloo ranks (they fork from a server that has imported torch); spawn for NCCL,
    whose ranks must not inherit a process that may have touched the CUDA driver."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


class _Ranks:
    """The started rank processes, watched and killed through pidfds where Linux has them. These keep
    working after the fork server that forked the ranks has died (a TERM or USR1 sent to every process
    of `repro train --nproc N` ends it too), when Process.is_alive() would call live ranks ended."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.pidfds = [_pidfd(p.pid) for p in procs]

    def exited(self, rank: int, wait_s: float = 0.0) -> bool:
        fd = self.pidfds[rank]
        if fd is None:
            self.procs[rank].join(wait_s)
            return not self.procs[rank].is_alive()
        return bool(select.select([fd], [], [], wait_s)[0])

    def send(self, signum: int) -> None:
        """Send a signal to every rank still running."""
        for rank in range(len(self.procs)):
            if not self.exited(rank):
                self._signal(rank, signum)

    def stop(self, grace_s: float) -> None:
        """Give every rank until `grace_s` from now to end, then kill the rest."""
        deadline = time.monotonic() + grace_s
        for rank, (proc, fd) in enumerate(zip(self.procs, self.pidfds)):
            if not self.exited(rank, max(deadline - time.monotonic(), 0.0)):
                self._kill(rank)
                self.exited(rank, 10.0)
            proc.join(1.0)  # reaps a spawned rank; a forked one's status comes from the fork server
            if fd is not None:
                os.close(fd)

    def _kill(self, rank: int) -> None:
        self._signal(rank, signal.SIGKILL)

    def _signal(self, rank: int, signum: int) -> None:
        try:
            if self.pidfds[rank] is None:
                os.kill(self.procs[rank].pid, signum)
            else:
                signal.pidfd_send_signal(self.pidfds[rank], signum)
        except ProcessLookupError:  # ended meanwhile
            pass


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the rank is already gone
        return None


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 180.0,
              backend: str = "gloo", forward_signals: bool = False) -> list[Any]:
    """Spawn `world_size` ranks running fn(*args); return their results in rank order.

    Every rank joins the process group before any runs fn, and leaves it after all have run it.
    Raises ValueError before spawning when NCCL ranks outnumber the visible GPUs, RuntimeError with
    the failing rank's traceback (or naming a rank that died without one: killed, out of memory), or
    TimeoutError after `timeout` seconds (the ranks are then killed, so a hung collective never hangs the caller).
    With forward_signals (a command's main thread: `repro train --nproc N`), SIGTERM, SIGUSR1 and
    SIGINT sent to this process are passed on to the ranks (`forwarding_stop_signals`), which ignore a
    SIGINT of their own (a terminal's Ctrl-C reaches them all); after a SIGINT the ranks' results are
    awaited, then KeyboardInterrupt is raised.
    """
    check_gpu_count(world_size, backend)
    return launch_ranks(fn, world_size, args, timeout, backend, join_process_group, forward_signals)


def launch_ranks(fn: Callable, world_size: int, args: tuple, timeout: float, backend: str,
                 join: Callable[[str, str, int, int], None], forward_signals: bool = False) -> list[Any]:
    """run_ranks with the function each rank joins the process group with, join(backend, store,
    rank, world_size) (importable, like fn)."""
    with forwarding_stop_signals() if forward_signals else nullcontext() as forwarder:
        results = _launch(fn, world_size, args, timeout, backend, join, forwarder)
    if forwarder is not None and forwarder.interrupted:  # Ctrl-C: the ranks stopped (checkpointed) for it,
        raise KeyboardInterrupt                             # and the command ends as interrupted (exit 130)
    return results


def _launch(fn: Callable, world_size: int, args: tuple, timeout: float, backend: str, join: Callable,
            forwarder: "_Forwarder | None") -> list[Any]:
    ctx = _start_context(backend)
    caller = _CallerContext.here() if ctx.get_start_method() == "forkserver" else None
    results, start = ctx.Queue(), ctx.Event()
    port, store_dir = free_port(), tempfile.mkdtemp(prefix="repro-ranks-")
    try:  # the rendezvous folder goes whatever ends the launch (a Ctrl-C while the ranks start, too)
        store = os.path.join(store_dir, "rendezvous")
        # not daemonic: a rank may start processes of its own (data-loader workers); the `finally` below
        # kills any rank still alive (one started before a failed start dies with this launcher: _die_with)
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, store, backend, fn, args, results, caller,
                                                  start, join, timeout, os.getpid(), forwarder is not None))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ranks, collected = _Ranks(procs), None
        if forwarder is not None:
            forwarder.watch(ranks)
        try:
            collected = _collect(results, ranks, fn.__name__, timeout, start)
        finally:  # ranks that delivered get 10 s to exit; after a failure or timeout the rest wait in vain
            ranks.stop(grace_s=10.0 if collected is not None else 1.0)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    return [collected[r] for r in range(world_size)]


class _Forwarder:
    """The launcher's handler of SIGTERM, SIGUSR1 and SIGINT: each is passed on to every running rank
    (SIGINT as SIGTERM, the stop the trainer checkpoints for), whose results are still awaited; a
    second SIGINT is KeyboardInterrupt, which kills the ranks."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.ranks: _Ranks | None = None
        self.pending: list[int] = []
        self.interrupted = False

    def __call__(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted, signum = True, signal.SIGTERM
        self.pending.append(signum)
        self._flush()  # then the line: whoever reads it may take the signal as delivered
        os.write(2, f"{signal.Signals(signum).name} passed on to the ranks: waiting for them to checkpoint "
                    "and exit\n".encode())

    def watch(self, ranks: _Ranks) -> None:
        """Forward to these ranks from now on, and what came before they existed."""
        self.ranks = ranks
        self._flush()

    def _flush(self) -> None:
        while self.ranks is not None and self.pending:
            self.ranks.send(self.pending.pop(0))


@contextmanager
def forwarding_stop_signals():
    """A _Forwarder handles SIGTERM, SIGUSR1 and SIGINT inside the block (on the main thread; elsewhere,
    nothing changes and None is yielded); the previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    forwarder = _Forwarder()
    previous = {sig: signal.signal(sig, forwarder) for sig in _Forwarder.SIGNALS}
    try:
        yield forwarder
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _failure(ranks: _Ranks, rank: int, name: str, report: str) -> RuntimeError:
    """The error for rank `rank`'s failure report; a peer killed by a signal (seen within ~1 s) is
    named first, since the reporting rank most likely only lost its connection to it."""
    killed = _killed_peer(ranks, rank, wait_s=1.0)
    if killed is None:
        return RuntimeError(f"rank {rank} failed in {name}:\n{report}")
    lines = report.strip().splitlines()
    return RuntimeError(f"{_ended_message(ranks, killed, name)}\n(rank {rank} then failed: "
                        f"{lines[-1] if lines else 'no message'})")


def _killed_peer(ranks: _Ranks, rank: int, wait_s: float) -> int | None:
    """The first rank other than `rank` ended by a signal within `wait_s`, or None."""
    deadline = time.monotonic() + wait_s
    while True:
        for peer in range(len(ranks.procs)):
            if peer != rank and ranks.exited(peer):
                ranks.procs[peer].join(1.0)  # its exit code
                if (ranks.procs[peer].exitcode or 0) < 0:
                    return peer
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _ended_message(ranks: _Ranks, rank: int, name: str) -> str:
    ranks.procs[rank].join(1.0)  # its exit code
    return (f"rank {rank} of {name} ended without a result (exit code {ranks.procs[rank].exitcode}): "
            "killed, out of memory, or os._exit; its output is above")


def _collect(results, ranks: _Ranks, name: str, timeout: float, start) -> dict[int, Any]:
    """Every rank's result, after starting fn once every rank has joined; a rank seen ended without a
    result on two polls a second apart (its result, put before it ended, would have arrived) fails at
    once instead of at the timeout."""
    world_size, joined, collected, suspects = len(ranks.procs), set(), {}, set()
    deadline = time.monotonic() + timeout
    while len(collected) < world_size:
        remaining = deadline - time.monotonic()
        try:
            rank, kind, value = results.get(timeout=min(max(remaining, 0.01), 1.0))
        except queue_lib.Empty:
            if remaining <= 0:
                raise TimeoutError(f"{name} on {world_size} ranks did not finish in {timeout:.0f} s") from None
            ended = {r for r in range(world_size) if r not in collected and ranks.exited(r)}
            if ended & suspects:
                raise RuntimeError(_ended_message(ranks, min(ended & suspects), name)) from None
            suspects = ended
            continue
        if kind == _JOINED:
            joined.add(rank)
            if len(joined) == world_size:
                start.set()
        elif kind == _FAILED:
            raise _failure(ranks, rank, name, value)
        else:
            collected[rank] = pickle.loads(value)
    return collected

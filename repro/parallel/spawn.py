"""Run a function on N local ranks (gloo on CPU, NCCL on GPU) with a hang timeout.

Used by the tests, `repro train --nproc N` and `repro selftest --nproc N`. The function must be
importable (defined at module level); its return value must be picklable (plain numbers, lists, dicts).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_lib
import shutil
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


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
    """What a rank takes from its caller at each launch: the environment variables and where stdout
    and stderr go (a pytest capture, a redirect). Ranks forked from the fork server would otherwise
    keep the server's, from the first launch."""

    def __init__(self, environ: dict[str, str], fds: dict[int, int]) -> None:
        self.environ, self.fds = environ, fds

    @classmethod
    def here(cls) -> "_CallerContext":
        return cls(dict(os.environ), {})

    def __reduce__(self):  # pickled while the rank starts: the caller's descriptors are sent with it
        return _CallerContext._received, (self.environ, {fd: reduction.DupFd(fd) for fd in (1, 2) if _is_open(fd)})

    @staticmethod
    def _received(environ: dict[str, str], dups: dict) -> "_CallerContext":
        return _CallerContext(environ, {fd: dup.detach() for fd, dup in dups.items()})

    def adopt(self) -> None:
        """In the rank: take the caller's environment and output descriptors."""
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, received in self.fds.items():
            os.dup2(received, fd)
            os.close(received)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _entry(rank, world_size, port, store, backend, fn, args, results, caller: _CallerContext) -> None:
    caller.adopt()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one intra-op thread per rank: oversubscribed cores are ~10x slower
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # a file rendezvous: a free port picked here could be taken by another process before rank 0
        # binds it (EADDRINUSE, seen on a busy CI machine); MASTER_PORT stays for code that reads it
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))
        # pickled here, by value: an error is the caller's to see (not lost in the queue's feeder
        # thread), and a tensor is not handed over as a shared-memory fd that dies with this process
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 180.0,
              backend: str = "gloo") -> list[Any]:
    """Spawn `world_size` ranks running fn(*args); return their results in rank order.

    Raises ValueError before spawning when NCCL ranks outnumber the visible GPUs, RuntimeError with
    the failing rank's traceback, or TimeoutError after `timeout` seconds (the ranks are then
    killed, so a hung collective never hangs the caller).
    """
    check_gpu_count(world_size, backend)
    ctx = _start_context(backend)
    results = ctx.Queue()
    port, store_dir = free_port(), tempfile.mkdtemp(prefix="repro-ranks-")
    store = os.path.join(store_dir, "rendezvous")
    # not daemonic: a rank may start processes of its own (data-loader workers); the `finally` below
    # kills any rank still alive
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, store, backend, fn, args, results,
                                                     _CallerContext.here()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(collected) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = results.get(timeout=max(remaining, 0.01))
            except queue_lib.Empty:
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s")
            if not ok:
                raise RuntimeError(f"rank {rank} failed in {fn.__name__}:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(store_dir, ignore_errors=True)
    return [collected[r] for r in range(world_size)]

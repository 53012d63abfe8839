"""Per-epoch shuffled sample order (cached as .npy) and a resumable data-parallel micro-batch loader.

Samples are addressed by a *global position* p = 0, 1, 2, ... over the whole run: epoch p // n,
sample order(epoch)[p % n], where order(epoch) is a seeded permutation of the n samples. Every step
consumes a global micro batch of micro_batch_size * dp_size positions; DP rank r takes the r-th
slice of it. Tensor-parallel ranks of one group pass the same dp_rank, so they read the same
samples; nothing here reads a global or a process group.

Example: 4 GPUs, TP=2 x DP=2, micro_batch_size=2. Ranks 0,1 (dp_rank 0) read positions 0,1 then
4,5 ...; ranks 2,3 (dp_rank 1) read 2,3 then 6,7 .... After 3 steps consumed_samples = 12, and a
loader started with consumed_samples=12 continues with 12,13 / 14,15.

With `workers` > 0 the samples are built in that many forked worker processes (torch's DataLoader,
in order) while the model trains, and stacked here: the same batches, in the same order, with the
costly part (BERT's masking) off the critical path. Workers send numpy samples through their pipe,
which costs less than tensors in shared memory (results/bench/data_loader.md). A batch is a pure
function of its positions, so workers change nothing else. Workers ignore SIGUSR1, and SIGTERM
from any process but their parent: Slurm (srun's USR1 warning; a batch step's TERM) and a process-group
kill signal every process, and the trainer, not its workers, decides when to stop. Their parent's
TERM, which torch and multiprocessing use to end a worker, still ends it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from repro.cli import UserError
from repro.provenance import chmod_as_created

Sample = TypeVar("Sample")
Batch = TypeVar("Batch")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save through a temporary file and os.replace, so readers never see a partial file. The
    temporary name is unique (mkstemp), not only per process: ranks on different nodes of a job may
    share a pid and all write the same cache on a shared filesystem. Synced before the rename, as
    repro.provenance.write_atomic, so a crash leaves the old file or the new one, not an empty one;
    streamed, not through write_atomic's bytes, which would hold a second copy of a large map."""
    path.parent.mkdir(parents=True, exist_ok=True)  # data.cache_dir, made by the one rank that writes
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, array)
            handle.flush()
            os.fsync(handle.fileno())
        chmod_as_created(tmp)  # mkstemp's 0600 would hide the cache from the group's jobs
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_array(path: Path | None, build: Callable[[], np.ndarray],
                 valid: Callable[[np.ndarray], bool], write: bool = True) -> np.ndarray:
    """Load path if it holds a valid array, else build it and (if `write`) try to cache it there.
    Of a job's ranks only one writes (the trainer's rank 0): the others build the same array in
    memory, instead of hundreds of ranks writing one file to a shared filesystem at once."""
    if path is not None and path.is_file():
        try:
            array = np.load(path, mmap_mode="r")
            if valid(array):
                return array
        except (OSError, ValueError, EOFError):
            pass  # unreadable, partial or empty (EOFError) cache: rebuild it below
    array = build()
    if path is not None and write:
        try:
            save_npy_atomic(path, array)
        except OSError as err:
            warnings.warn(f"{path}: could not cache the sample index ({err}); using it in memory. Fix: set "
                          "data.cache_dir to a writable directory (default: beside the data)", stacklevel=2)
    return array


class EpochShuffle:
    """A seeded permutation of num_samples per epoch, cached as PREFIX_shuffle_n{n}_seed{s}_e{e}.npy."""

    def __init__(self, num_samples: int, seed: int, cache_prefix: str | None, write_cache: bool = True) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.cache_prefix = cache_prefix
        self.write_cache = write_cache
        self._epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def _path(self, epoch: int) -> Path | None:
        if self.cache_prefix is None:
            return None
        return Path(f"{self.cache_prefix}_shuffle_n{self.num_samples}_seed{self.seed}_e{epoch}.npy")

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of one epoch (a permutation of range(num_samples))."""
        if epoch != self._epoch:
            n = self.num_samples
            index = np.uint32 if n < 2**32 else np.int64  # half the memory at the paper's ~35M samples
            build = lambda: np.random.default_rng([self.seed, epoch]).permutation(n).astype(index)  # noqa: E731
            valid = lambda a: a.shape == (n,) and a.dtype.kind in "iu"  # noqa: E731
            self._order, self._epoch = cached_array(self._path(epoch), build, valid, self.write_cache), epoch
        return self._order

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, sample index) of a global position."""
        epoch, offset = divmod(position, self.num_samples)
        return epoch, int(self.order(epoch)[offset])


def rank_positions(step_start: int, micro_batch_size: int, dp_rank: int) -> range:
    """Global positions of one DP rank's micro batch, given the first position of the step."""
    first = step_start + dp_rank * micro_batch_size
    return range(first, first + micro_batch_size)


class _MicroBatchSamples:
    """Map-style view for torch's DataLoader: key (first, stop) -> the samples of that micro batch."""

    def __init__(self, fetch: Callable[[int], Sample]) -> None:
        self.fetch = fetch

    def __getitem__(self, span: tuple[int, int]) -> list[Sample] | _FailedFetch:
        try:
            return [self.fetch(p) for p in range(*span)]
        except UserError as err:  # raised as itself in the trainer, not wrapped in the worker's traceback
            return _FailedFetch(err)


class _FailedFetch(NamedTuple):
    """A DataLoader worker's user error (a corpus in another vocabulary), handed to the trainer."""

    error: UserError


def _ignore_stop_signals(_worker_id: int) -> None:
    """Worker init: SIGUSR1 ignored; SIGTERM blocked and waited for by a thread that exits the worker
    only when the parent sent it (until here the trainer's inherited handlers only set a flag)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # (not Linux: TERM keeps its default)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by every later thread
    threading.Thread(target=_exit_on_parents_term, args=(os.getppid(),), daemon=True).start()


def _exit_on_parents_term(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


def _start_workers(loader):
    """iter(loader), which forks its workers, with SIGTERM and SIGUSR1 blocked in this thread: each
    worker is born with them blocked, so one that arrives before its init function has set up its
    handling (torch's own worker TERM handler would end it) waits for it instead of ending the worker.
    The caller's signals that arrive meanwhile are delivered when the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        return iter(loader)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _as_is(batch):
    return batch


class ResumableLoader(Generic[Sample, Batch]):
    """Micro batches for one DP rank; `consumed_samples` (all ranks together) is the resume point."""

    def __init__(self, fetch: Callable[[int], Sample], collate: Callable[[list[Sample]], Batch],
                 micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0,
                 total_samples: int | None = None, workers: int = 0) -> None:
        global_batch = micro_batch_size * dp_size
        if workers < 0:
            raise ValueError(f"workers={workers}: use 0 (batches built in this process) or more")
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got "
                             f"micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        if consumed_samples < 0 or consumed_samples % global_batch:
            raise ValueError(f"consumed_samples={consumed_samples} is not a multiple of "
                             f"micro_batch_size * dp_size = {micro_batch_size} * {dp_size}; "
                             "resume from the count saved with a checkpoint")
        self.fetch, self.collate = fetch, collate
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.total_samples = total_samples
        self.workers = workers

    def _spans(self) -> Iterator[tuple[int, int]]:
        """(first, stop) positions of this rank's micro batches, from consumed_samples on."""
        global_batch = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while self.total_samples is None or start + global_batch <= self.total_samples:
            positions = rank_positions(start, self.micro_batch_size, self.dp_rank)
            yield positions.start, positions.stop
            start += global_batch

    def __iter__(self) -> Iterator[Batch]:
        global_batch = self.micro_batch_size * self.dp_size
        if self.workers == 0:
            samples: Iterator[list[Sample]] = ([self.fetch(p) for p in range(*span)] for span in self._spans())
        else:
            samples = _start_workers(self._background())
        for micro_batch in samples:
            if isinstance(micro_batch, _FailedFetch):
                raise micro_batch.error
            self.consumed_samples += global_batch
            yield self.collate(micro_batch)

    def _background(self):
        import torch.utils.data

        # fork: workers inherit the memory-mapped data and sample maps instead of pickling them
        context = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        return torch.utils.data.DataLoader(
            _MicroBatchSamples(self.fetch), batch_size=None, sampler=self._spans(),
            collate_fn=_as_is, num_workers=self.workers,
            worker_init_fn=_ignore_stop_signals, multiprocessing_context=context,
            # its own generator: the workers' base seed is drawn from it, not from torch's global
            # RNG, whose stream (dropout) must not depend on when a loader starts
            generator=torch.Generator().manual_seed(0))

"""Must-show 4: GPT samples cover each token once per epoch, reshuffle per epoch, split across DP
ranks, repeat across TP ranks, and resume exactly from a consumed-samples count."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from repro.data.errors import DataError
from repro.data.gpt_dataset import GPTDataset, gpt_loader
from repro.data.indexed_dataset import IndexedDatasetWriter

NUM_TOKENS, SEQ = 5003, 16  # token i has id i, so a sample says which tokens it holds


@pytest.fixture()
def prefix(tmp_path):
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, NUM_TOKENS), 40, replace=False))
    with IndexedDatasetWriter(tmp_path / "toy", np.uint16) as writer:
        for doc in np.split(np.arange(NUM_TOKENS), cuts):
            writer.add_document([doc])
    return tmp_path / "toy"


def _epoch_inputs(prefix, dp_size: int, mbs: int, epochs: int = 1):
    """All input rows each DP rank gets in `epochs` epochs (the global batch divides an epoch)."""
    per_epoch = len(GPTDataset(prefix, SEQ))
    steps = epochs * per_epoch // (mbs * dp_size)
    rows = {}
    for rank in range(dp_size):
        loader = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=7), mbs, rank, dp_size))
        rows[rank] = [next(loader) for _ in range(steps)]
    return rows


def _stream(ds: GPTDataset, epoch: int) -> np.ndarray:
    """An epoch's token stream: its documents, whole, in that epoch's order."""
    return np.concatenate([ds.data[int(d)] for d in ds.document_order(epoch)[0]])


def test_samples_are_windows_of_the_epochs_document_stream_shifted(prefix):
    ds = GPTDataset(prefix, SEQ)
    assert len(ds) == (NUM_TOKENS - 1) // SEQ == 312
    for epoch in (0, 1):
        stream = _stream(ds, epoch)
        assert sorted(stream.tolist()) == list(range(NUM_TOKENS))  # every document once
        for i in range(len(ds)):
            assert np.array_equal(ds.sample(i, epoch), stream[i * SEQ:i * SEQ + SEQ + 1])
    batch = next(iter(gpt_loader(ds, micro_batch_size=4)))
    assert batch.tokens.shape == batch.labels.shape == (4, SEQ)
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
    assert not torch.equal(batch.labels, batch.tokens + 1)  # ids are file positions: documents moved


def test_each_token_once_per_epoch_and_dp_ranks_disjoint(prefix):
    rows = _epoch_inputs(prefix, dp_size=2, mbs=4)  # 312 samples = 39 steps of 8
    per_rank = [torch.cat([b.tokens for b in rows[r]]) for r in (0, 1)]
    seen = torch.cat(per_rank).flatten()
    assert len(seen.unique()) == len(seen) == 312 * SEQ  # every token at most once: all but the tail
    assert not set(per_rank[0][:, 0].tolist()) & set(per_rank[1][:, 0].tolist())


def test_documents_and_sample_order_are_reshuffled_each_epoch(prefix):
    """Megatron-LM's rule: each epoch shuffles the documents, then the windows cut from them, so a
    document sits in other windows beside other neighbours; before, every epoch repeated the same
    windows in another order."""
    rows = _epoch_inputs(prefix, dp_size=1, mbs=8, epochs=2)[0]
    windows = torch.cat([b.tokens for b in rows])
    first, second = windows[:312], windows[312:]
    assert len(first.flatten().unique()) == len(second.flatten().unique()) == 312 * SEQ
    shared = {tuple(w) for w in first.tolist()} & {tuple(w) for w in second.tolist()}
    assert len(shared) < 31, len(shared)  # at most a few windows recur (a long document's inside)
    starts = first[:, 0]
    assert not torch.equal(starts, starts.sort().values)  # shuffled, not file order


def test_tp_ranks_of_a_group_get_the_same_batches(prefix):
    # Two TP ranks of one DP group: separate datasets (the second loads the first's cache).
    a = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=3), 4, dp_rank=1, dp_size=2))
    b = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=3), 4, dp_rank=1, dp_size=2))
    for _ in range(100):  # crosses the epoch boundary at 39 steps
        x, y = next(a), next(b)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)


def test_resume_mid_epoch_continues_the_sequence(prefix):
    ds = GPTDataset(prefix, SEQ, seed=5)
    full = gpt_loader(ds, 3, dp_rank=1, dp_size=2)
    it = iter(full)
    batches = [next(it) for _ in range(70)]
    assert full.consumed_samples == 70 * 6
    resumed = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=5), 3, 1, 2, consumed_samples=25 * 6))
    for expected in batches[25:]:
        assert torch.equal(next(resumed).tokens, expected.tokens)


def test_worker_processes_give_the_same_batches_in_the_same_order(prefix):
    # Two workers build batches ahead of the consumer: across the epoch boundary (39 steps), from a
    # resume point, and up to total_samples, the batches equal those built in this process.
    def batches(workers: int, consumed: int = 0, total: int | None = None) -> list:
        loader = gpt_loader(GPTDataset(prefix, SEQ, seed=5), 3, 1, 2, consumed, total, workers=workers)
        return list(itertools.islice(loader, 45)), loader.consumed_samples

    for consumed, total in ((0, None), (25 * 6, None), (6, 6 * 20)):
        (serial, n_serial), (background, n_background) = batches(0, consumed, total), batches(2, consumed, total)
        assert len(serial) == len(background) == (45 if total is None else 19)
        assert n_serial == n_background == consumed + 6 * len(serial)
        for a, b in zip(serial, background):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)


def test_loader_workers_outlive_stop_signals_to_every_process_and_stop_with_the_loader(prefix):
    # srun delivers Slurm's USR1 warning to every process of a step, a batch step or a process-group
    # kill a TERM: the workers must outlive them so the trainer can reach its checkpoint; they stop
    # with the loader, and on their parent's TERM (torch's and multiprocessing's way to end one).
    # The parent holds handlers, as the trainer does (StopSignal), so a worker that is still
    # starting inherits them instead of the default action.
    import multiprocessing as mp
    import os
    import signal
    import subprocess
    import time

    expected = list(itertools.islice(gpt_loader(GPTDataset(prefix, SEQ, seed=5), 3), 30))
    before = {p.pid for p in mp.active_children()}
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        it = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=5), 3, workers=2))
        got = [next(it)]
        workers = [p.pid for p in mp.active_children() if p.pid not in before]
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGUSR1)
            subprocess.run(["kill", "-TERM", str(pid)], check=True)  # another process's TERM
        time.sleep(0.5)
        got += list(itertools.islice(it, 29))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(got) == 30 and all(torch.equal(a.tokens, b.tokens) for a, b in zip(got, expected))
    it.close()  # the generator's DataLoader iterator goes, and with it its workers
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.pid in workers for p in mp.active_children()):
        time.sleep(0.05)
    assert not [p.pid for p in mp.active_children() if p.pid in workers]
    it = iter(gpt_loader(GPTDataset(prefix, SEQ, seed=5), 3, workers=2))
    next(it)
    started = [p for p in mp.active_children() if p.pid not in before]
    for p in started:
        os.kill(p.pid, signal.SIGTERM)  # from the parent: the worker ends
        p.join(timeout=10)
    assert started and all(p.exitcode == 0 for p in started), [p.exitcode for p in started]
    del it


def _late_init(worker_id: int) -> None:
    import time

    from repro.data.sampler import _ignore_stop_signals

    time.sleep(1.0)  # a loaded machine: the stop signals arrive before the worker's own handling exists
    _ignore_stop_signals(worker_id)


def test_a_worker_signalled_before_its_init_function_ran_survives():
    """Workers are forked with TERM/USR1 blocked: a signal in the window between the fork (where torch
    installs its worker TERM handler, which ends the worker) and the init function waits, and is then
    ignored (CI saw `DataLoader worker ... is killed by signal: Terminated` once)."""
    import multiprocessing as mp
    import os
    import signal
    import subprocess

    from repro.data.sampler import _start_workers

    loader = torch.utils.data.DataLoader(list(range(40)), batch_size=4, num_workers=2, worker_init_fn=_late_init,
                                         multiprocessing_context=mp.get_context("fork"))
    before = {p.pid for p in mp.active_children()}
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        it = _start_workers(loader)
        workers = [p.pid for p in mp.active_children() if p.pid not in before]
        assert len(workers) == 2
        for pid in workers:  # at once: their init function sleeps for another second
            os.kill(pid, signal.SIGUSR1)
            subprocess.run(["kill", "-TERM", str(pid)], check=True)
        got = [b.tolist() for b in it]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert sum(got, []) == list(range(40))


def test_shuffle_index_is_cached_and_rebuilt_when_corrupt(prefix, tmp_path):
    ds = GPTDataset(prefix, SEQ, seed=11)
    order = np.array(ds.shuffle.order(0))
    cache = list(tmp_path.glob("toy_gpt_s16_shuffle_n312_seed11_e0.npy"))
    assert len(cache) == 1 and not list(tmp_path.glob(".*tmp*"))
    cache[0].write_bytes(b"garbage")
    assert np.array_equal(GPTDataset(prefix, SEQ, seed=11).shuffle.order(0), order)
    assert np.array_equal(np.load(cache[0]), order)
    other = tmp_path / "cache"
    GPTDataset(prefix, SEQ, seed=11, cache_dir=other).shuffle.order(1)
    assert (other / "toy_gpt_s16_shuffle_n312_seed11_e1.npy").is_file()


def test_only_the_writing_rank_writes_the_shuffle_cache(prefix, tmp_path):
    """Ranks told not to write (all but the trainer's rank 0) build the same order in memory, and
    read the cache once it is there."""
    cache_dir = tmp_path / "cache"
    reader = GPTDataset(prefix, SEQ, seed=11, cache_dir=cache_dir, write_cache=False)
    order = reader.shuffle.order(0).copy()
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []
    writer = GPTDataset(prefix, SEQ, seed=11, cache_dir=cache_dir)
    assert np.array_equal(writer.shuffle.order(0), order)
    cache = cache_dir / "toy_gpt_s16_shuffle_n312_seed11_e0.npy"
    assert np.array_equal(np.load(cache), order) and oct(cache.stat().st_mode)[-3:] == "644"
    late = GPTDataset(prefix, SEQ, seed=11, cache_dir=cache_dir, write_cache=False)
    assert isinstance(late.shuffle.order(0), np.memmap)  # loaded, not rebuilt


def test_bad_loader_arguments(prefix):
    ds = GPTDataset(prefix, SEQ)
    with pytest.raises(ValueError, match="dp_rank < dp_size"):
        gpt_loader(ds, 4, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="consumed_samples=5 is not a multiple"):
        gpt_loader(ds, 4, dp_rank=0, dp_size=2, consumed_samples=5)
    with pytest.raises(DataError, match="cannot fill one sample"):
        GPTDataset(prefix, NUM_TOKENS)


def test_sentence_split_data_is_refused_naming_the_gpt2_tokenizer(tmp_path):
    """A BERT dataset (documents of several sentences, no end-of-document token) as GPT data: a
    DataError naming the fix; before, GPT trained on its sentences shuffled apart one by one."""
    with IndexedDatasetWriter(tmp_path / "bert_like", np.uint16) as writer:
        for doc in range(20):
            writer.add_document([np.arange(10) + 100 * doc, np.arange(12) + 100 * doc + 50])
    with pytest.raises(DataError, match=r"bert_like: 40 sequences in 20 documents.*--tokenizer gpt2"):
        GPTDataset(tmp_path / "bert_like", SEQ)

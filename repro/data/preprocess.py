"""`repro data prepare`: documents -> filtered, tokenized Megatron indexed datasets, split by document.

    repro data prepare --input corpus.jsonl --output-prefix data/corpus --tokenizer gpt2
    repro data prepare --input wiki.jsonl realnews.jsonl.gz owt_pages/ --layout file --split-order random ...
    # -> data/corpus_train.{bin,idx}, data/corpus_valid.{bin,idx}, data/corpus_test.{bin,idx}

GPT: one sequence per document, the end-of-document token appended. BERT: one sequence per sentence
(`split_sentences`), documents marked in the document index. Filters run in this order: length
(< min_tokens), eval overlap, near-duplicates (first of a cluster kept). The kept documents are split
by the weights of --split: into contiguous train/valid/test ranges in file order (Megatron's rule,
the default), or, with --split-order random, into seeded random sets of the same sizes, each kept in
file order; the per-epoch shuffling happens later, in the datasets. Documents: see repro.data.documents.

Several inputs (files, or directories standing for their files; `.gz` read as the text it holds)
are read in the order given as one stream: the near-duplicate filter runs across all of them, as
the paper's did across its sources, and the report counts each file's documents and kept ones.
At the paper's scale (174 GB, ~40M documents from several sources): with the default file order,
valid and test are the last documents read, so the last source alone (a warning says so);
`--split-order random` draws them (seeded) from every input instead. Tokenizing runs
on every CPU of the allocation by default; the near-duplicate index holds ~2 KB per kept document
in this process (~80 GB at 40M). What is checked before any work: repro.data.prepare_checks.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from repro.data.documents import read_documents, split_sentences
from repro.data.errors import DataError
from repro.data.filters import (FilterOptions, MinHasher, NearDuplicateFilter, count_overlap,
                                eval_ngram_set, ngram_hashes, words)
from repro.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, best_dtype,
                                        copy_document_runs, document_runs, move_leading_documents)
from repro.data.prepare_checks import (SPLIT_NAMES, check_inputs, check_output_dir, check_outputs, check_split,
                                       describe_inputs, input_files, make_output_dir, output_files,
                                       output_prefix_locked, temporary_tag, warn_stale_temporaries)
from repro.data.tokenizers import TextTokenizer, build_tokenizer
from repro.data.verify import digests
from repro.train.signals import STOP_SIGNALS, stop_signals_deferred


def available_cpus() -> int:
    """The CPUs this process may run on (a Slurm or cgroup allocation), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class PrepareOptions:
    """Everything `prepare` needs; field names match the command-line flags."""

    input: Path | tuple[Path, ...]  # files or directories (each file in it), read in this order
    output_prefix: str
    tokenizer: str = "gpt2"  # gpt2 | bert
    data_dir: Path = Path("data")  # holds vocab/ and the eval sets (see `repro data fetch`)
    workers: int = field(default_factory=available_cpus)  # tokenizing processes; 1: in this one
    input_format: str = "auto"  # auto | jsonl | text
    json_key: str = "text"
    layout: str = "auto"  # plain text: auto | wikitext | paragraph | file | endoftext
    split: str = "949,50,1"  # train,valid,test weights over documents
    split_order: str = "file"  # file: contiguous ranges in file order (Megatron's); random: seeded draw
    split_seed: int = 1234  # the draw of split_order random
    filters: FilterOptions = field(default_factory=FilterOptions)
    progress: bool = True
    chunk_docs: int = 16  # documents per task sent to a worker
    overwrite: bool = False  # replace an existing dataset at output_prefix
    skip_bad_records: bool = False  # skip JSON lines without text (counted) instead of stopping


@dataclass
class PrepareReport:
    """Counts and speed of one `prepare` run."""

    documents: int = 0
    too_short: int = 0
    eval_overlap: int = 0
    near_duplicates: int = 0
    kept: int = 0
    tokens_read: int = 0  # tokens of every document read (end-of-document tokens excluded)
    tokens_written: int = 0  # tokens in the outputs (end-of-document tokens included)
    seconds: float = 0.0
    outputs: dict[str, int] = field(default_factory=dict)  # output prefix -> documents
    skipped_records: int = 0  # JSON lines without text, with skip_bad_records
    skipped_examples: list[str] = field(default_factory=list)  # the first few, "file:line: why"
    inputs: dict[str, dict[str, int]] = field(default_factory=dict)  # input file -> documents, kept
    sha256: dict[str, str] = field(default_factory=dict)  # "_train.bin" etc. -> what `repro data verify` checks

    @property
    def tokens_per_s(self) -> float:
        """Tokens read per second of wall time (tokenizing, filtering and writing)."""
        return self.tokens_read / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DocResult:
    """One processed document: its status (ok, short, overlap), sequences and MinHash signature."""

    status: str
    num_tokens: int
    sequences: list[np.ndarray]
    signature: np.ndarray | None = None


class DocumentProcessor:
    """Tokenizes one document and applies the per-document filters; picklable for workers."""

    def __init__(self, tokenizer: TextTokenizer, filters: FilterOptions,
                 eval_set: np.ndarray | None) -> None:
        self.tokenizer = tokenizer
        self.filters = filters
        self.eval_set = eval_set
        self.minhasher = MinHasher(filters.num_perm, filters.shingle_words) if filters.dedup else None

    def tokenize(self, text: str) -> list[np.ndarray]:
        """GPT: [ids + eod]; BERT: one id array per non-empty sentence."""
        if self.tokenizer.kind == "bert":
            ids = self.tokenizer.encode_batch(split_sentences(text))
            return [np.asarray(x, dtype=np.int32) for x in ids if x]
        return [np.asarray(self.tokenizer.encode(text) + [self.tokenizer.eod], dtype=np.int32)]

    def __call__(self, text: str) -> DocResult:
        sequences = self.tokenize(text)
        count = sum(len(s) for s in sequences) - (self.tokenizer.kind == "gpt2")
        if count < self.filters.min_tokens:
            return DocResult("short", count, [])
        tokens = words(text)
        if self.eval_set is not None:
            overlap = count_overlap(ngram_hashes(tokens, self.filters.ngram), self.eval_set)
            if overlap >= self.filters.min_matches:
                return DocResult("overlap", count, [])
        signature = self.minhasher.signature(tokens) if self.minhasher else None
        return DocResult("ok", count, sequences, signature)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """TERM and USR1 blocked in this thread while the pool forks its workers, so each is born with
    them blocked and takes them only after `worker_signal_defaults`. Without this, a TERM (scancel,
    Slurm's time limit: every process of the step gets it) that reaches a worker between fork and
    Python's after-fork reset of pending signals is lost when the parent has a Python handler
    (`repro data prepare` installs one), and the worker lives on. A blocked signal stays pending in
    the kernel instead."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_signal_defaults() -> None:
    """In a worker born under `stop_signals_blocked`: TERM kills (scancel and Slurm's time limit reach
    every process), USR1 is ignored (srun delivers Slurm's warning to every process; the parent stops
    and winds the pool down), then both are unblocked, so a TERM already pending ends the worker now."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _init_worker(processor: DocumentProcessor) -> None:
    # The only module-level state: set once in each pool worker process, never in the parent.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    worker_signal_defaults()
    _process_chunk.processor = processor


def _process_chunk(texts: list[str]) -> list[DocResult]:
    return [_process_chunk.processor(text) for text in texts]


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def process_documents(docs: Iterable[str], processor: DocumentProcessor, workers: int,
                      chunk_docs: int = 16) -> Iterator[DocResult]:
    """Processed documents in input order; workers > 1 uses a process pool.

    Up to 8 chunks per worker are in flight; a new one is sent as soon as the oldest is back, so
    the workers never wait for the slowest chunk of a batch, and memory stays bounded. However it
    ends (done, an error, a stop signal, an abandoned generator) the chunks not started are dropped,
    the ones being processed finish, and the workers leave on their own: none is killed. A worker
    killed while writing its result leaves half a message in the pipe, and the reader then waits
    forever for the rest (`multiprocessing.Pool.terminate()` hung so in about 1 stop in 10)."""
    if workers <= 1:
        yield from map(processor, docs)
        return
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(processor,))
    try:
        pending: collections.deque = collections.deque()
        for chunk in _chunks(docs, chunk_docs):
            with stop_signals_blocked():  # a submit may fork the workers
                pending.append(pool.submit(_process_chunk, chunk))
            if len(pending) >= workers * 8:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool as err:
        raise DataError(f"a --workers process died ({err}): most likely the kernel's out-of-memory killer. "
                        f"Fix: rerun with fewer --workers, or on a node with more memory") from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def split_runs(weights: tuple[float, ...], num_docs: int, order: str = "file",
               seed: int = 1234) -> list[list[tuple[int, int]]]:
    """Each split's documents as [first, last) runs. `file`: one contiguous range each, in file
    order. `random`: a seeded random set of documents of the same size each (every part of the
    file, so every concatenated source, reaches valid and test), kept in file order."""
    bounds = split_bounds(weights, num_docs)
    if order == "file":
        return [[(lo, hi)] if hi > lo else [] for lo, hi in zip(bounds, bounds[1:])]
    if order != "random":
        raise DataError(f"--split-order {order!r}: choose file or random")
    owner = np.empty(num_docs, dtype=np.int8)
    permutation = np.random.default_rng(seed).permutation(num_docs)
    for split, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        owner[permutation[lo:hi]] = split
    return [document_runs(np.flatnonzero(owner == split)) for split in range(len(weights))]


def split_bounds(weights: tuple[float, ...], num_docs: int) -> list[int]:
    """Document boundaries [0, end of train, end of valid, num_docs] from cumulative rounding."""
    total = sum(weights)
    cumulative = itertools.accumulate(weights)
    return [0] + [round(c / total * num_docs) for c in cumulative]


def _account(result: DocResult, report: PrepareReport, dedup: NearDuplicateFilter | None,
             writer: IndexedDatasetWriter) -> bool:
    """Count one processed document; write it and return True when it is kept."""
    report.documents += 1
    report.tokens_read += result.num_tokens
    if result.status == "short":
        report.too_short += 1
    elif result.status == "overlap":
        report.eval_overlap += 1
    elif dedup is not None and dedup.is_duplicate(report.documents, result.signature):
        report.near_duplicates += 1
    else:
        report.kept += 1
        writer.add_document(result.sequences)
        report.tokens_written = writer.num_tokens
        return True
    return False


def _documents(files: list[Path], formats: list[str], opts: PrepareOptions, bad: list[str] | None, on_bytes,
               sources: collections.deque) -> Iterator[str]:
    """The documents of every file in order (in its format from `check_inputs`); the index of each
    one's file is appended to `sources`."""
    for index, (path, fmt) in enumerate(zip(files, formats)):
        for doc in read_documents(path, fmt, opts.json_key, opts.layout, bad, on_bytes):
            sources.append(index)
            yield doc


def _tokenize_all(opts: PrepareOptions, files: list[Path], formats: list[str], tokenizer: TextTokenizer,
                  tmp_prefix: str) -> PrepareReport:
    filters = opts.filters
    eval_set = (eval_ngram_set(opts.data_dir, filters.eval_files, filters.ngram)
                if filters.eval_overlap else None)
    processor = DocumentProcessor(tokenizer, filters, eval_set)
    dedup = NearDuplicateFilter(filters.dedup_threshold, filters.num_perm) if filters.dedup else None
    bad: list[str] | None = [] if opts.skip_bad_records else None
    sources: collections.deque = collections.deque()
    counts = np.zeros((len(files), 2), dtype=np.int64)  # documents, kept
    report, start = PrepareReport(), time.perf_counter()
    with IndexedDatasetWriter(tmp_prefix, best_dtype(tokenizer.vocab_size)) as writer, \
            tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                 disable=not opts.progress, desc="prepare") as bar:  # input bytes read: an ETA for a multi-hour run
        docs = _documents(files, formats, opts, bad, bar.update, sources)
        for result in process_documents(docs, processor, opts.workers, opts.chunk_docs):
            source = sources.popleft()
            counts[source] += (1, _account(result, report, dedup, writer))
            if report.documents % 256 == 0:
                rate = report.tokens_read / (time.perf_counter() - start)
                bar.set_postfix_str(f"{report.documents:,} docs, {rate:,.0f} tok/s", refresh=False)
    report.seconds = time.perf_counter() - start
    if bad:
        report.skipped_records, report.skipped_examples = len(bad), bad[:10]
    report.inputs = {str(f): {"documents": int(n), "kept": int(k)} for f, (n, k) in zip(files, counts)}
    return report


def _check_kept(opts: PrepareOptions, files: list[Path], report: PrepareReport) -> None:
    if report.documents == 0:
        raise DataError(f"{describe_inputs(files)} holds no documents (only blank text). Fix: give the corpus files")
    if report.kept == 0:
        raise DataError(f"{describe_inputs(files)}: none of its {report.documents} documents survived the "
                        f"filters ({report.too_short} under {opts.filters.min_tokens} tokens, "
                        f"{report.eval_overlap} overlapping eval sets, {report.near_duplicates} "
                        "near-duplicates). Fix: lower --min-tokens or disable a filter")


def prepare(opts: PrepareOptions) -> PrepareReport:
    """Tokenize, filter and split opts.input into PREFIX_{train,valid,test}.{bin,idx}.

    Everything is written under temporary names and renamed into place at the end, so a failure
    leaves an existing dataset at PREFIX untouched (replaced only with opts.overwrite). PREFIX.lock is
    held throughout: a second prepare of PREFIX meanwhile is refused."""
    weights = check_split(opts)  # --split, --split-order, --split-seed
    files = input_files(opts.input)
    formats = check_inputs(opts, files)  # input errors first
    check_outputs(opts)
    check_output_dir(opts.output_prefix)
    tokenizer = build_tokenizer(opts.tokenizer, opts.data_dir)
    make_output_dir(opts.output_prefix)
    with output_prefix_locked(opts.output_prefix):  # the whole prepare: one at a time per prefix
        check_outputs(opts)  # again: one that held the lock may have just finished
        warn_stale_temporaries(opts.output_prefix)
        return _prepare_locked(opts, weights, files, formats, tokenizer)


def _prepare_locked(opts: PrepareOptions, weights, files: list[Path], formats: list[str],
                    tokenizer: TextTokenizer) -> PrepareReport:
    """`prepare`'s work, holding PREFIX.lock: tokenize into temporary files, split, publish."""
    tag = temporary_tag()
    tmp_prefix = f"{opts.output_prefix}.unsplit-tmp{tag}"
    staged = f"{opts.output_prefix}.tmp{tag}"
    try:
        report = _tokenize_all(opts, files, formats, tokenizer, tmp_prefix)
        _check_kept(opts, files, report)
        unsplit = IndexedDataset(tmp_prefix)
        runs = split_runs(weights, unsplit.num_documents, opts.split_order, opts.split_seed)
        train_leads = len(runs[0]) == 1 and runs[0][0][0] == 0  # train = the first documents (file order)
        for name, split in zip(SPLIT_NAMES, runs):
            if not (train_leads and name == "train"):
                copy_document_runs(unsplit, split, f"{staged}_{name}")
            report.outputs[f"{opts.output_prefix}_{name}"] = sum(hi - lo for lo, hi in split)
        del unsplit
        if train_leads:  # the unsplit file, cut after train's documents, becomes train: no second copy
            move_leading_documents(tmp_prefix, runs[0][0][1], f"{staged}_train")
        report.sha256 = digests(staged, opts.progress)  # one more read of the outputs: a copy can be verified
        _write_report(opts, report, Path(f"{staged}_prepare.json"))
        check_outputs(opts)  # a dataset that came meanwhile (not through this lock) is replaced only with --overwrite
        with stop_signals_deferred():  # a stop waits for the whole dataset: never old and new files mixed
            for src, dst in zip(output_files(staged), output_files(opts.output_prefix)):
                os.replace(src, dst)
    finally:
        for path in [Path(tmp_prefix + ".bin"), Path(tmp_prefix + ".idx"), *output_files(staged)]:
            path.unlink(missing_ok=True)
    return report


def _write_report(opts: PrepareOptions, report: PrepareReport, path: Path) -> None:
    from repro.provenance import write_atomic

    given = [opts.input] if isinstance(opts.input, (str, Path)) else opts.input
    record = {"options": {**{k: str(v) for k, v in asdict(opts).items() if k != "filters"},
                          "input": [str(p) for p in given]},
              "filters": asdict(opts.filters), "report": asdict(report),
              "tokens_per_s": report.tokens_per_s}
    write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())

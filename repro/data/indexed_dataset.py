"""Megatron-LM's indexed dataset (MMIDIDX): PREFIX.bin token ids + PREFIX.idx index, read by memmap.

Layout of PREFIX.idx (all little-endian), identical to Megatron-LM and megatron-core:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16
    u64       sequence count S
    u64       document-index length D (= number of documents + 1)
    int32[S]  sequence lengths (tokens)
    int64[S]  byte offset of each sequence in .bin
    int64[D]  document index: sequence index at each document boundary, [0, end of doc 1, ...]

Example: two documents, the first one sequence [5], the second two sequences [6, 7] and [8]:
lengths [1, 2, 1], pointers [0, 2, 6] (uint16), document index [0, 1, 3]. PREFIX.bin holds the
sequences back to back, so for GPT (one sequence per document) the whole .bin is the token stream.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from repro.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: tuple[tuple[int, type], ...] = (
    (1, np.uint8), (2, np.int8), (3, np.int16), (4, np.int32),
    (5, np.int64), (6, np.float64), (7, np.float32), (8, np.uint16),
)
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, doc-index length
_REBUILD = "rebuild it with `repro data prepare` (or Megatron-LM's preprocess_data.py)"


def best_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab under 65,500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype: type) -> int:
    """The .idx code of a numpy dtype."""
    for code, candidate in DTYPE_CODES:
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code")


def _dtype_of_code(code: int, idx_path: Path) -> type:
    for known, dtype in DTYPE_CODES:
        if known == code:
            return dtype
    raise DataError(f"{idx_path}: dtype code {code} is not one of 1-8: not an MMIDIDX index "
                    f"or a damaged one. Fix: {_REBUILD}")


def write_index(handle, lengths: np.ndarray, doc_index: np.ndarray, dtype: type) -> None:
    """Write the complete .idx file for these sequence lengths and document index, part by part
    (no second copy of the index in memory)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_index = np.asarray(doc_index, dtype=np.int64)
    handle.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(lengths), len(doc_index)))
    for part in (lengths, pointers, doc_index):
        handle.write(memoryview(np.ascontiguousarray(part)))


COPY_SLICE = 2**27  # tokens per write when copying a split (256 MiB of uint16)


@contextlib.contextmanager
def removed_on_error(*paths: str | Path) -> Iterator[None]:
    """Remove these (temporary) files when the block fails: an error such as ENOSPC, or SIGTERM's
    SystemExit (`repro data prepare`), leaves no partial copy filling the disk."""
    try:
        yield
    except BaseException as err:
        for path in paths:
            Path(path).unlink(missing_ok=True)
        full = disk_full_error(err, paths[0])
        if full is None:
            raise
        raise full from None


def disk_full_error(err: BaseException, path: str | Path) -> DataError | None:
    """A full disk (ENOSPC, EDQUOT) while writing `path` as a DataError naming the directory, its
    free space and the fix; None for any other error."""
    if not isinstance(err, OSError) or err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    directory = Path(path).resolve().parent
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:,.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return DataError(f"{directory}: {err.strerror} writing {Path(path).name} ({free}); the partial file "
                     "was removed. Fix: free space there, or give an --output-prefix on a larger disk, then "
                     "rerun `repro data prepare`")


class IndexedDatasetWriter:
    """Writes PREFIX.bin/.idx; both appear (atomically renamed) only when finalize() succeeds."""

    def __init__(self, prefix: str | Path, dtype: type = np.uint16) -> None:
        self.prefix = str(prefix)
        self.dtype = dtype
        self._tmp_bin = f"{self.prefix}.bin.tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = array.array("i")  # 4 bytes a sequence (BERT: ~1.5B sentences at the paper's scale)
        self._doc_index = array.array("q", [0])
        self.num_tokens = 0

    def add_document(self, sequences: list[np.ndarray] | list[list[int]]) -> None:
        """Append one document made of one or more sequences (GPT: 1, BERT: one per sentence)."""
        info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        for seq in sequences:
            arr = np.asarray(seq)
            if info is not None and arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"{self.prefix}: token id out of range for {np.dtype(self.dtype)}")
            self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
            self._lengths.append(arr.size)
            self.num_tokens += arr.size
        self._doc_index.append(len(self._lengths))

    def finalize(self) -> None:
        """Write PREFIX.idx and move both files into place."""
        tmp_idx = f"{self.prefix}.idx.tmp{os.getpid()}"
        with removed_on_error(self._tmp_bin, tmp_idx):
            self._bin.close()
            with open(tmp_idx, "wb") as handle:
                write_index(handle, np.frombuffer(self._lengths, dtype=np.int32),
                            np.frombuffer(self._doc_index, dtype=np.int64), self.dtype)
            os.replace(self._tmp_bin, f"{self.prefix}.bin")
            os.replace(tmp_idx, f"{self.prefix}.idx")

    def abort(self) -> None:
        """Drop the partial output (its close may fail again on a full disk: the file goes anyway)."""
        try:
            self._bin.close()
        except OSError:
            pass
        finally:
            Path(self._tmp_bin).unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
            return
        self.abort()
        full = disk_full_error(exc, self._tmp_bin)
        if full is not None:
            raise full from None


def _fail(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}. Fix: {_REBUILD}")


def _parse_header(idx_path: Path, raw: np.ndarray) -> tuple[type, int, int]:
    if raw.size < _HEADER.size:
        raise _fail(idx_path, f"{raw.size} bytes is too short for an MMIDIDX index header")
    magic, version, code, seq_count, doc_count = _HEADER.unpack(raw[:_HEADER.size].tobytes())
    if magic != MAGIC:
        raise _fail(idx_path, f"magic {magic!r} is not {MAGIC!r}: not a Megatron indexed dataset")
    if version != VERSION:
        raise _fail(idx_path, f"version {version} is not supported (only {VERSION})")
    dtype = _dtype_of_code(code, idx_path)
    expected = _HEADER.size + seq_count * 12 + doc_count * 8
    if raw.size != expected:
        raise _fail(idx_path, f"{raw.size} bytes, but its header ({seq_count} sequences, "
                              f"{doc_count} document-index entries) needs {expected}: truncated, "
                              "or a multimodal index (not supported)")
    return dtype, seq_count, doc_count


CHECK_CHUNK = 2**24  # sequences per step of the pointer check


def _check_index(idx_path: Path, lengths: np.ndarray, pointers: np.ndarray,
                 doc_index: np.ndarray, itemsize: int) -> None:
    if len(doc_index) == 0 or doc_index[0] != 0 or doc_index[-1] != len(lengths):
        raise _fail(idx_path, "document index must start at 0 and end at the sequence count")
    if np.any(np.diff(doc_index) < 0):
        raise _fail(idx_path, "document index decreases or a sequence length is negative")
    start = 0  # in chunks: BERT at the paper's scale has ~1.5B sequences, 12 GB per int64 copy
    for lo in range(0, len(lengths), CHECK_CHUNK):
        if np.any(lengths[lo:lo + CHECK_CHUNK] < 0):
            raise _fail(idx_path, "document index decreases or a sequence length is negative")
        chunk = lengths[lo:lo + CHECK_CHUNK].astype(np.int64) * itemsize
        expected = start + np.concatenate(([0], np.cumsum(chunk[:-1])))
        if not np.array_equal(pointers[lo:lo + CHECK_CHUNK], expected):
            raise _fail(idx_path, "sequence pointers are not back to back")
        start += int(chunk.sum())


class IndexedDataset:
    """Reads PREFIX.bin/.idx (written here or by Megatron-LM) with numpy memmap, checking the layout.

    ds[i] is sequence i (a read-only numpy view); ds.document(d) the sequences of document d;
    ds.tokens the whole .bin as one array (the GPT token stream).
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataError(f"{path}: missing. Fix: check the prefix {self.prefix!r}, or "
                                f"{_REBUILD}")
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_path.stat().st_size else \
            np.zeros(0, dtype=np.uint8)
        self.dtype, seq_count, doc_count = _parse_header(idx_path, raw)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(raw, np.int32, seq_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(raw, np.int64, seq_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(raw, np.int64, doc_count, offset)
        itemsize = np.dtype(self.dtype).itemsize
        _check_index(idx_path, self.sequence_lengths, self.sequence_pointers,
                     self.document_indices, itemsize)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if bin_path.stat().st_size != self.num_tokens * itemsize:
            raise DataError(f"{bin_path}: {bin_path.stat().st_size} bytes, but {idx_path} "
                            f"describes {self.num_tokens} tokens of {itemsize} bytes: the .bin and "
                            f".idx do not belong together or one is truncated. Fix: {_REBUILD}")
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.zeros(0, dtype=self.dtype))
        self._itemsize = itemsize

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def start(self, i: int) -> int:
        """Token offset of sequence i in .bin (read from the memory-mapped .idx: no per-sequence
        array in RAM, which for BERT at the paper's scale would be ~12 GB on every rank)."""
        return int(self.sequence_pointers[i]) // self._itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.start(i)
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    @property
    def num_documents(self) -> int:
        """Number of documents (document-index length - 1)."""
        return len(self.document_indices) - 1

    def document(self, d: int) -> list[np.ndarray]:
        """The sequences of document d."""
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return [self[i] for i in range(lo, hi)]

    def document_tokens(self, d: int) -> np.ndarray:
        """All tokens of document d as one array (its sequences are contiguous in .bin)."""
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if lo == hi:
            return self.tokens[0:0]
        start = self.start(lo)
        return self.tokens[start:start + int(self.sequence_lengths[lo:hi].sum())]


def document_runs(doc_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted document ids as [first, last) runs of consecutive ids: [0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    ids = np.asarray(doc_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    firsts, lasts = ids[np.r_[0, cuts]], ids[np.r_[cuts - 1, ids.size - 1]] + 1
    return list(zip(firsts.tolist(), lasts.tolist()))


def move_leading_documents(src_prefix: str | Path, num_documents: int, prefix: str | Path) -> None:
    """Make the first `num_documents` documents of dataset SRC the new dataset PREFIX without copying
    a token: SRC's .bin is cut to their bytes and renamed (a train split of the paper's corpus is
    ~85 GB that would otherwise exist twice on disk). SRC's .idx stays; SRC is no longer a dataset."""
    src, tmp_idx = IndexedDataset(src_prefix), f"{prefix}.idx.tmp{os.getpid()}"
    sequences = int(src.document_indices[num_documents])
    lengths = src.sequence_lengths[:sequences]  # views of the .idx memmap, which is not touched
    nbytes = int(lengths.sum(dtype=np.int64)) * np.dtype(src.dtype).itemsize
    with removed_on_error(tmp_idx):
        with open(tmp_idx, "wb") as handle:
            write_index(handle, lengths, src.document_indices[:num_documents + 1], src.dtype)
        del src  # no mapping of the .bin may outlive its truncation
        os.truncate(f"{src_prefix}.bin", nbytes)
        os.replace(f"{src_prefix}.bin", f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")


def copy_document_runs(src: IndexedDataset, runs: list[tuple[int, int]], prefix: str | Path) -> None:
    """Write the documents of `runs` ([first, last) ranges, in order) of src as a new dataset PREFIX:
    one block copy per run, streamed from the memmap in slices (a split of the paper's corpus is
    ~85 GB)."""
    tmp_bin, tmp_idx = f"{prefix}.bin.tmp{os.getpid()}", f"{prefix}.idx.tmp{os.getpid()}"
    with removed_on_error(tmp_bin, tmp_idx):
        with open(tmp_bin, "wb") as handle:
            lengths, doc_index = _copy_runs(src, runs, handle)
        with open(tmp_idx, "wb") as handle:
            write_index(handle, lengths, doc_index, src.dtype)
        os.replace(tmp_bin, f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")


def _copy_runs(src: IndexedDataset, runs: list[tuple[int, int]], handle) -> tuple[np.ndarray, np.ndarray]:
    """Write the tokens of `runs` of src to handle; their sequence lengths and document index."""
    lengths, doc_index, sequences = [], [np.zeros(1, dtype=np.int64)], 0
    for first, last in runs:
        lo, hi = int(src.document_indices[first]), int(src.document_indices[last])
        run_lengths = np.asarray(src.sequence_lengths[lo:hi])
        start = src.start(lo) if hi > lo else 0
        tokens = src.tokens[start:start + int(run_lengths.sum(dtype=np.int64))]
        for i in range(0, len(tokens), COPY_SLICE):
            handle.write(memoryview(np.ascontiguousarray(tokens[i:i + COPY_SLICE])))
        lengths.append(run_lengths)
        doc_index.append(np.asarray(src.document_indices[first + 1:last + 1]) - lo + sequences)
        sequences += hi - lo
    all_lengths = lengths[0] if len(lengths) == 1 else (  # one run: the memmap view, no copy
        np.concatenate(lengths) if lengths else np.zeros(0, np.int32))
    return all_lengths, np.concatenate(doc_index)

"""Must-show 2 (layout) and 6 (bad files): the MMIDIDX .bin/.idx format, and megatron-core interop."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
from data_fixtures import require

from repro.data.errors import DataError
from repro.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, best_dtype,
                                        copy_document_runs)


def _write_example(prefix) -> None:
    # Two documents: [[5]] and [[6, 7], [8]] -> document index [0, 1, 3].
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document([[5]])
        writer.add_document([[6, 7], [8]])


def test_idx_bytes_match_the_layout_by_hand(tmp_path):
    prefix = tmp_path / "ex"
    _write_example(prefix)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 3) + struct.pack("<Q", 3)
                + struct.pack("<3i", 1, 2, 1)  # sequence lengths
                + struct.pack("<3q", 0, 2, 6)  # byte pointers (uint16: 2 bytes a token)
                + struct.pack("<3q", 0, 1, 3))  # document index
    assert (tmp_path / "ex.idx").read_bytes() == expected
    assert (tmp_path / "ex.bin").read_bytes() == struct.pack("<4H", 5, 6, 7, 8)


def test_read_back(tmp_path):
    _write_example(tmp_path / "ex")
    ds = IndexedDataset(tmp_path / "ex")
    assert len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 4
    assert [list(s) for s in ds.document(1)] == [[6, 7], [8]]
    assert list(ds.document_tokens(1)) == [6, 7, 8]
    assert list(ds.tokens) == [5, 6, 7, 8]


def test_dtype_rule():
    assert best_dtype(50257) == np.uint16 and best_dtype(30522) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128000) == np.int32


@pytest.mark.parametrize("slice_tokens", [2**27, 5])  # 5: the copy goes through many slices
def test_int32_dataset_and_a_one_run_copy(tmp_path, monkeypatch, slice_tokens):
    from repro.data import indexed_dataset

    monkeypatch.setattr(indexed_dataset, "COPY_SLICE", slice_tokens)
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 100_000, rng.integers(1, 9)) for _ in range(rng.integers(1, 4))]
            for _ in range(20)]
    with IndexedDatasetWriter(tmp_path / "big", np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    copy_document_runs(IndexedDataset(tmp_path / "big"), [(5, 12)], tmp_path / "part")
    part = IndexedDataset(tmp_path / "part")
    assert part.dtype == np.int32 and part.num_documents == 7
    for d in range(7):
        assert [list(s) for s in part.document(d)] == [list(s) for s in docs[5 + d]]


def test_token_out_of_range_for_uint16(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
            writer.add_document([[70000]])
    assert not (tmp_path / "x.bin").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("offset, value, message", [
    (0, b"NOTMMIDX\x00", "magic"),
    (9, struct.pack("<Q", 2), "version 2 is not supported"),
    (17, struct.pack("<B", 9), "dtype code 9"),
])
def test_bad_header(tmp_path, offset, value, message):
    _write_example(tmp_path / "ex")
    raw = bytearray((tmp_path / "ex.idx").read_bytes())
    raw[offset:offset + len(value)] = value
    (tmp_path / "ex.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=message) as err:
        IndexedDataset(tmp_path / "ex")
    assert "ex.idx" in str(err.value) and "Fix: rebuild" in str(err.value)


def test_truncated_idx(tmp_path):
    _write_example(tmp_path / "ex")
    (tmp_path / "ex.idx").write_bytes((tmp_path / "ex.idx").read_bytes()[:-8])
    with pytest.raises(DataError, match="ex.idx: .*truncated"):
        IndexedDataset(tmp_path / "ex")


def test_bin_size_disagrees_with_idx(tmp_path):
    _write_example(tmp_path / "ex")
    (tmp_path / "ex.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(DataError, match=r"ex\.bin: 6 bytes, but .*ex\.idx describes 4 tokens"):
        IndexedDataset(tmp_path / "ex")


@pytest.mark.parametrize("missing", ["idx", "bin"])
def test_missing_file(tmp_path, missing):
    _write_example(tmp_path / "ex")
    (tmp_path / f"ex.{missing}").unlink()
    with pytest.raises(DataError, match=rf"ex\.{missing}: missing\. Fix"):
        IndexedDataset(tmp_path / "ex")


def test_empty_idx_file(tmp_path):
    _write_example(tmp_path / "ex")
    (tmp_path / "ex.idx").write_bytes(b"")
    with pytest.raises(DataError, match="0 bytes is too short"):
        IndexedDataset(tmp_path / "ex")


@pytest.fixture(scope="module")
def megatron_indexed():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as err:
        require(False, f"megatron-core ({err})")
    return indexed_dataset


def _random_docs(seed: int, high: int):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, rng.integers(1, 30)) for _ in range(rng.integers(1, 5))]
            for _ in range(50)]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 50257), (np.int32, 200_000)])
def test_megatron_reads_ours(tmp_path, megatron_indexed, dtype, high):
    docs = _random_docs(1, high)
    with IndexedDatasetWriter(tmp_path / "ours", dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    flat = [seq for doc in docs for seq in doc]
    assert len(theirs) == len(flat)
    assert list(theirs.document_indices) == [0] + list(np.cumsum([len(d) for d in docs]))
    for i, seq in enumerate(flat):
        assert theirs[i].dtype == dtype and list(theirs[i]) == list(seq)


@pytest.mark.parametrize("dtype, high", [(np.uint16, 30522), (np.int32, 200_000)])
def test_we_read_megatron(tmp_path, megatron_indexed, dtype, high):
    import torch

    docs = _random_docs(2, high)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(np.asarray(seq, dtype=np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    assert ours.dtype == dtype and ours.num_documents == len(docs)
    for d, doc in enumerate(docs):
        assert [list(s) for s in ours.document(d)] == [list(s) for s in doc]


@pytest.mark.parametrize("chunk", [2**24, 7])  # 7: the pointer check runs over many chunks
def test_a_shifted_pointer_is_found_in_any_chunk(tmp_path, monkeypatch, chunk):
    from repro.data import indexed_dataset

    monkeypatch.setattr(indexed_dataset, "CHECK_CHUNK", chunk)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
        for _ in range(50):
            writer.add_document([rng.integers(0, 100, rng.integers(0, 7)) for _ in range(rng.integers(1, 4))])
    count = len(IndexedDataset(tmp_path / "x"))
    raw = bytearray((tmp_path / "x.idx").read_bytes())
    at = indexed_dataset._HEADER.size + 4 * count + 8 * 30  # sequence 30's pointer
    raw[at:at + 8] = (int.from_bytes(raw[at:at + 8], "little") + 2).to_bytes(8, "little")
    (tmp_path / "x.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="sequence pointers are not back to back"):
        IndexedDataset(tmp_path / "x")


def test_document_runs_and_a_copy_of_several_runs(tmp_path):
    from repro.data.indexed_dataset import document_runs

    assert document_runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (5, 7), (9, 10)]
    assert document_runs(np.array([], dtype=np.int64)) == []
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 1000, rng.integers(1, 6)) for _ in range(rng.integers(1, 4))] for _ in range(12)]
    with IndexedDatasetWriter(tmp_path / "all", np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    copy_document_runs(IndexedDataset(tmp_path / "all"), [(1, 3), (6, 7), (9, 12)], tmp_path / "some")
    some, picked = IndexedDataset(tmp_path / "some"), [1, 2, 6, 9, 10, 11]
    assert some.num_documents == len(picked)
    for d, original in enumerate(picked):
        assert [list(s) for s in some.document(d)] == [list(s) for s in docs[original]]
    copy_document_runs(IndexedDataset(tmp_path / "all"), [], tmp_path / "none")
    assert IndexedDataset(tmp_path / "none").num_documents == 0

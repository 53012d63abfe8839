"""Must-show 5: BERT samples over 10k draws: 15% masked, 80/10/10, SOP balanced; plus layout."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from data_fixtures import bert_tokenizer, data_dir, data_mirror  # noqa: F401

from repro.data import bert_dataset
from repro.data.bert_dataset import (IGNORE_INDEX, BertDataset, BertOptions, bert_loader,
                                     build_sample_map, sample_target)
from repro.data.filters import FilterOptions
from repro.data.preprocess import PrepareOptions, prepare

SEQ = 128


@pytest.fixture(scope="module")
def bert_prefix(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bert") / "wt"
    prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens",
                           output_prefix=str(out), tokenizer="bert", data_dir=data_dir, workers=1,
                           split="1,0,0", progress=False,
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    return Path(f"{out}_train")


@pytest.fixture(scope="module")
def dataset(bert_prefix, bert_tokenizer) -> BertDataset:
    return BertDataset(bert_prefix, bert_tokenizer, BertOptions(max_seq_length=SEQ, seed=9))


def test_masking_rates_and_sop_over_10k_draws(dataset, bert_tokenizer):
    predicted = candidates = swapped = 0
    kinds = np.zeros(3)  # [MASK], unchanged, random
    for position in range(10_000):
        s = dataset.at(position)
        picked = s["mlm_labels"] != IGNORE_INDEX
        candidates += int(s["padding_mask"].sum()) - 3  # minus [CLS] and two [SEP]
        predicted += int(picked.sum())
        shown, original = s["tokens"][picked], s["mlm_labels"][picked]
        kinds += [np.sum(shown == bert_tokenizer.mask), np.sum(shown == original),
                  np.sum((shown != bert_tokenizer.mask) & (shown != original))]
        swapped += int(s["sop_label"])
    assert abs(predicted / candidates - 0.15) <= 0.01
    shares = kinds / kinds.sum()
    assert np.all(np.abs(shares - [0.8, 0.1, 0.1]) <= 0.02), shares
    assert abs(swapped / 10_000 - 0.5) <= 0.02  # 4 standard deviations


def test_sample_layout(dataset, bert_tokenizer):
    tok = bert_tokenizer
    for position in range(200):
        s = dataset.at(position)
        n = int(s["padding_mask"].sum())
        assert s["padding_mask"][:n].all() and not s["padding_mask"][n:].any()
        labels = np.where(s["mlm_labels"] != IGNORE_INDEX, s["mlm_labels"], s["tokens"])
        seps = np.flatnonzero(labels[:n] == tok.sep)
        assert labels[0] == tok.cls and len(seps) == 2 and seps[1] == n - 1
        types = s["token_types"]
        assert not types[:seps[0] + 1].any() and types[seps[0] + 1:n].all() and not types[n:].any()
        assert (s["tokens"][n:] == tok.pad).all() and (s["mlm_labels"][n:] == IGNORE_INDEX).all()
        assert s["mlm_labels"][[0, seps[0], seps[1]]].tolist() == [IGNORE_INDEX] * 3


def test_whole_words_are_masked_together(dataset, bert_tokenizer):
    continuation = bert_tokenizer.continuation_mask()
    checked = 0
    for position in range(300):
        s = dataset.at(position)
        picked = s["mlm_labels"] != IGNORE_INDEX
        original = np.where(picked, s["mlm_labels"], s["tokens"])
        for i in range(2, int(s["padding_mask"].sum()) - 1):
            if continuation[original[i]] and original[i - 1] != bert_tokenizer.sep:
                assert picked[i] == picked[i - 1]  # a '##' piece goes with its word
                checked += int(picked[i])
    assert checked > 50


def _find(haystack: list[int], needle: list[int]) -> int:
    text, key = "," + ",".join(map(str, haystack)) + ",", "," + ",".join(map(str, needle)) + ","
    return text.find(key)


def test_sop_label_says_whether_segments_are_swapped(dataset, bert_prefix, bert_tokenizer):
    from repro.data.indexed_dataset import IndexedDataset

    data = IndexedDataset(bert_prefix)
    for index in range(100):
        s = dataset.sample(index)
        first, end, _ = (int(x) for x in dataset.samples[index])
        original = np.where(s["mlm_labels"] != IGNORE_INDEX, s["mlm_labels"], s["tokens"])
        seps = np.flatnonzero(original == bert_tokenizer.sep)
        seg_a, seg_b = original[1:seps[0]].tolist(), original[seps[0] + 1:seps[1]].tolist()
        run = np.concatenate([data[j] for j in range(first, end)]).tolist()
        pos_a, pos_b = _find(run, seg_a), _find(run, seg_b)
        assert pos_a >= 0 and pos_b >= 0  # each segment is a contiguous piece of the run
        assert (pos_a > pos_b) == bool(s["sop_label"])


def test_deterministic_and_new_masks_each_epoch(dataset):
    a, b = dataset.sample(5, epoch=0), dataset.sample(5, epoch=0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = dataset.sample(5, epoch=1)
    assert not np.array_equal(a["mlm_labels"], c["mlm_labels"])


def test_empty_split_and_single_sentence_documents_say_what_is_wrong(bert_prefix, bert_tokenizer, tmp_path):
    """An empty split (the fixture's valid, of --split 1,0,0) is named as such, not blamed on the
    tokenizer; documents of one sentence each (as GPT-2 data) still ask for --tokenizer bert."""
    from repro.data.errors import DataError
    from repro.data.indexed_dataset import IndexedDatasetWriter

    empty = str(bert_prefix).removesuffix("_train") + "_valid"
    with pytest.raises(DataError, match="holds no documents .*--split"):
        BertDataset(empty, bert_tokenizer, BertOptions(max_seq_length=SEQ), cache_dir=tmp_path)
    with IndexedDatasetWriter(tmp_path / "one") as writer:
        for _ in range(3):
            writer.add_document([np.arange(1000, 1010)])
    with pytest.raises(DataError, match="no document has two sentences.*--tokenizer bert"):
        BertDataset(tmp_path / "one", bert_tokenizer, BertOptions(max_seq_length=SEQ), cache_dir=tmp_path)


def test_loader_batches(dataset):
    loader = bert_loader(dataset, micro_batch_size=4, dp_rank=1, dp_size=2, consumed_samples=8)
    batch = next(iter(loader))
    assert set(batch) == {"tokens", "token_types", "padding_mask", "mlm_labels", "sop_label"}
    assert batch["tokens"].shape == (4, SEQ) and batch["sop_label"].shape == (4,)
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert torch.equal(batch["tokens"][0], torch.from_numpy(dataset.at(12)["tokens"]))
    assert loader.consumed_samples == 16


def test_loader_workers_give_the_same_batches(dataset):
    # Masks come from a per-sample RNG seeded by (seed, epoch, index): the same in any process.
    def batches(workers: int) -> list:
        loader = bert_loader(dataset, 4, dp_rank=1, dp_size=2, consumed_samples=8, workers=workers)
        return [b for _, b in zip(range(12), loader)]

    for a, b in zip(batches(0), batches(2), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the sample map: vectorized builder against a plain loop over sentences ---


def _corpus(sentences_per_doc, lengths) -> SimpleNamespace:
    counts = np.asarray(sentences_per_doc, dtype=np.int64)
    return SimpleNamespace(sequence_lengths=np.asarray(lengths, dtype=np.int32),
                           document_indices=np.concatenate([[0], np.cumsum(counts)]),
                           num_documents=len(counts))


def _random_corpus(seed: int, docs: int, max_sentences: int = 60, max_length: int = 50):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_sentences + 1, docs)  # empty and one-sentence documents too
    return _corpus(counts, rng.integers(0, max_length + 1, int(counts.sum())))  # zero lengths too


def _reference_map(data, opts: BertOptions) -> np.ndarray:
    """Megatron-LM's sample ends as a plain loop over sentences."""
    max_tokens, lengths, bounds = opts.max_seq_length - 3, data.sequence_lengths, data.document_indices
    hashed = sample_target(opts.seed, np.arange(len(lengths) + 1), max_tokens, opts.short_seq_prob)
    rows = []
    for d in range(data.num_documents):  # Megatron-LM's build_mapping loop (helpers.cpp), hashed targets
        lo, hi = int(bounds[d]), int(bounds[d + 1])
        start, size, target = lo, 0, int(hashed[lo])
        for j in range(lo, hi):
            size += int(lengths[j])
            remaining = hi - j - 1
            if (size >= target and remaining > 1 and j > start) or (remaining == 0 and j > start):
                rows.append((start, j + 1, target))
                start, size, target = j + 1, 0, int(hashed[j + 1])
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def test_sample_map_by_hand():
    """max_tokens 5: greedy runs of >= 2 sentences; a sentence that would be left alone joins the
    sample before it (Megatron-LM's rule); a 1-sentence doc is dropped."""
    data = _corpus([3, 1, 0, 5, 2], [3, 3, 3,  9,  1, 1, 1, 2, 4,  0, 0])
    got = build_sample_map(data, BertOptions(max_seq_length=8, short_seq_prob=0.0))
    assert got.tolist() == [[0, 3, 5], [4, 9, 5], [9, 11, 5]]  # sentences 2 and 8 would be left alone
    assert got.dtype == np.int64


@pytest.mark.parametrize("case", ["random", "short_docs", "long_docs", "all_short_targets"])
def test_vectorized_map_matches_reference_loop(case, monkeypatch):
    data, opts = {
        "random": (_random_corpus(0, 400), BertOptions(max_seq_length=128, seed=3)),
        "short_docs": (_random_corpus(1, 300, max_sentences=2), BertOptions(max_seq_length=16)),
        "long_docs": (_random_corpus(2, 6, max_sentences=3000), BertOptions(max_seq_length=64)),
        "all_short_targets": (_random_corpus(3, 200), BertOptions(max_seq_length=512,
                                                                   short_seq_prob=1.0)),
    }[case]
    monkeypatch.setattr(bert_dataset, "CHUNK_SENTENCES", 500)  # long documents span chunks
    expected = _reference_map(data, opts)
    assert len(expected) > 20
    np.testing.assert_array_equal(build_sample_map(data, opts), expected)


@pytest.mark.parametrize("chunk", [1, 2, 37, 1000, 1 << 40])
def test_sample_map_does_not_depend_on_chunk_size(chunk, monkeypatch):
    data, opts = _random_corpus(4, 300), BertOptions(max_seq_length=96, short_seq_prob=0.5)
    expected = build_sample_map(data, opts)
    monkeypatch.setattr(bert_dataset, "CHUNK_SENTENCES", chunk)
    np.testing.assert_array_equal(build_sample_map(data, opts), expected)


def test_sample_map_is_a_function_of_the_seed():
    data = _random_corpus(5, 300)
    a, b = (build_sample_map(data, BertOptions(max_seq_length=128, seed=11)) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    c = build_sample_map(data, BertOptions(max_seq_length=128, seed=12))
    assert a.shape != c.shape or not np.array_equal(a[:, 2], c[:, 2])


def test_short_targets_share_and_range():
    max_tokens, p, n = 509, 0.1, 400_000
    targets = sample_target(1234, np.arange(n), max_tokens, p)
    short = targets != max_tokens  # a short draw equals max_tokens w.p. 1/508: negligible here
    assert abs(short.mean() - p) <= 4 * np.sqrt(p * (1 - p) / n)
    assert abs(targets[short].mean() - (2 + max_tokens) / 2) <= 5
    counts = np.bincount(sample_target(7, np.arange(n), max_tokens, 1.0))
    assert not counts[:2].any() and len(counts) == max_tokens + 1  # uniform in [2, max_tokens]:
    assert counts[2:].min() > 0.8 * n / (max_tokens - 1)  # each length about n / 508 times
    data = _random_corpus(6, 3000, max_length=200)
    rows = build_sample_map(data, BertOptions(max_seq_length=512, short_seq_prob=p))
    first = np.isin(rows[:, 0], data.document_indices)
    for group in (rows[first, 2] != max_tokens, rows[~first, 2] != max_tokens):  # first samples too (Megatron)
        assert len(group) > 2000 and abs(group.mean() - p) <= 4 * np.sqrt(p * (1 - p) / len(group))


@pytest.mark.parametrize("chunk", [1, 50, 400])
def test_document_chunks_cover_documents_within_the_bound(chunk, monkeypatch):
    monkeypatch.setattr(bert_dataset, "CHUNK_SENTENCES", chunk)
    bounds = _random_corpus(7, 200, max_sentences=120).document_indices
    chunks = bert_dataset._document_chunks(bounds)
    assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]]
    assert chunks[0][0] == 0 and chunks[-1][1] == len(bounds) - 1
    sizes = np.array([bounds[end] - bounds[first] for first, end in chunks])
    alone = np.array([end - first == 1 for first, end in chunks])
    assert (alone | (sizes <= chunk)).all()  # only a lone document may exceed the bound
    assert chunk == 1 or sizes.mean() > chunk / 2  # chunks are filled, not one document each


def test_truncation_lengths_and_sides_match_the_token_by_token_rule():
    """The closed form gives the lengths of trimming one token at a time from the longer segment (B on
    a tie, as Megatron-LM and Google BERT); the tokens removed from the front are Binomial(n, 1/2), as 1/2 per token is."""
    from repro.data.bert_dataset import _truncate, truncated_lengths

    def one_at_a_time(la: int, lb: int, limit: int) -> tuple[int, int]:
        while la + lb > limit:
            la, lb = (la - 1, lb) if la > lb else (la, lb - 1)  # Megatron's truncate_segments
        return la, lb

    for la in range(0, 30):
        for lb in range(0, 30):
            for limit in (0, 1, 5, 17, 29, 60):
                assert truncated_lengths(la, lb, limit) == one_at_a_time(la, lb, limit), (la, lb, limit)
    rng = np.random.default_rng(0)
    a, b = np.arange(100), np.arange(100, 130)
    fronts = []
    for _ in range(4000):
        ta, tb = _truncate(a, b, 50, rng)
        assert (len(ta), len(tb)) == truncated_lengths(100, 30, 50) == (25, 25)
        assert np.array_equal(ta, np.arange(ta[0], ta[0] + 25)) and np.array_equal(tb, np.arange(tb[0], tb[0] + 25))
        fronts.append(ta[0])
    assert abs(np.mean(fronts) - 37.5) < 0.3 and abs(np.var(fronts) - 75 / 4) < 1.5  # Binomial(75, 1/2)


def test_a_reprepared_corpus_with_the_same_counts_does_not_load_the_old_sample_map(data_dir, bert_tokenizer, tmp_path):
    """The sample map depends on document bounds and sentence lengths, not only on the totals: the
    same documents prepared again in another order (same tokens, same sentences) must get their own
    map, not the cached one whose samples would pair sentences of different documents."""
    import json
    import random

    rng = random.Random(0)
    docs = [" ".join(f"Sentence {d} {s} " + " ".join(rng.choice(["alpha", "beta", "gamma"])
                                                    for _ in range(rng.randint(3, 30))) + "."
                     for s in range(rng.randint(2, 12))) for d in range(40)]
    order = list(range(40))
    opts = BertOptions(max_seq_length=64)
    for attempt in range(2):
        (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": docs[i]}) + "\n" for i in order))
        prepare(PrepareOptions(input=tmp_path / "c.jsonl", output_prefix=str(tmp_path / "c"), tokenizer="bert",
                               data_dir=data_dir, workers=1, split="1,0,0", progress=False, overwrite=attempt > 0,
                               filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
        data = BertDataset(tmp_path / "c_train", bert_tokenizer, opts, cache_dir=tmp_path / "cache")
        random.Random(1).shuffle(order)
    bounds = np.asarray(data.data.document_indices)
    doc_of = lambda sentence: np.searchsorted(bounds, sentence, side="right") - 1  # noqa: E731
    assert np.array_equal(data.samples, build_sample_map(data.data, opts))
    assert np.array_equal(doc_of(data.samples[:, 0]), doc_of(data.samples[:, 1] - 1))
    assert len(list((tmp_path / "cache").glob("*_bert_map_*.npy"))) == 2

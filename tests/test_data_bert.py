"""Must-show 5: BERT samples over 10k draws: 15% masked, 80/10/10, SOP balanced; plus layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import bert_tokenizer, data_dir, data_mirror  # noqa: F401

from repro.data.bert_dataset import IGNORE_INDEX, BertDataset, BertOptions, bert_loader
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


def test_loader_batches(dataset):
    loader = bert_loader(dataset, micro_batch_size=4, dp_rank=1, dp_size=2, consumed_samples=8)
    batch = next(iter(loader))
    assert set(batch) == {"tokens", "token_types", "padding_mask", "mlm_labels", "sop_label"}
    assert batch["tokens"].shape == (4, SEQ) and batch["sop_label"].shape == (4,)
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert torch.equal(batch["tokens"][0], torch.from_numpy(dataset.at(12)["tokens"]))
    assert loader.consumed_samples == 16

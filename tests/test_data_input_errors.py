"""Input the data pipeline must name, not trip over: a dataset prepared at a prefix ending in a split
name, split options that only failed after tokenizing, a UTF-8 byte-order mark, a stop signal during
`prepare --overwrite`'s swap, and BERT token ids outside the vocabulary."""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import bert_tokenizer, data_dir, data_mirror  # noqa: F401

import repro.data.preprocess as pre
from repro.cli import main
from repro.data import summary
from repro.data.documents import detect_format, read_documents
from repro.data.errors import DataError
from repro.data.filters import FilterOptions
from repro.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from repro.data.prepare_checks import base_prefix, output_files
from repro.data.verify import verify

NO_FILTERS = FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)
CLI_FLAGS = ["--workers", "1", "--no-progress", "--no-dedup", "--no-eval-filter", "--min-tokens", "0"]


def _jsonl(path: Path, docs: int, word: str = "word") -> Path:
    path.write_text("".join(json.dumps({"text": f"Document {i} has a {word}. It ends here."}) + "\n"
                            for i in range(docs)))
    return path


def _prepare(data_dir: Path, corpus: Path, prefix: Path, **kw) -> None:
    pre.prepare(pre.PrepareOptions(input=corpus, output_prefix=str(prefix), data_dir=data_dir, workers=1,
                                   progress=False, filters=NO_FILTERS, **{"split": "8,1,1", **kw}))


def _files(prefix: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in output_files(str(prefix))}


# --- 1. a dataset prepared as PREFIX_test is verified and inspected as itself -----------------------

def test_a_prefix_ending_in_a_split_name_is_its_own_dataset_for_verify_and_inspect(data_dir, tmp_path, capsys):
    """A dataset prepared as .../wiki_test, beside another one at .../wiki: verify and inspect of
    wiki_test (or of its wiki_test_train) read wiki_test's files and report, never wiki's, and a
    damaged wiki_test_train.bin is named."""
    own, sibling = tmp_path / "wiki_test", tmp_path / "wiki"
    _prepare(data_dir, _jsonl(tmp_path / "own.jsonl", 10), own)
    _prepare(data_dir, _jsonl(tmp_path / "sibling.jsonl", 6), sibling)
    for given in (own, f"{own}_train"):
        checked = [Path(path).name for path, status in verify(given)]
        assert len(checked) == 6 and all(name.startswith("wiki_test_") for name in checked), checked
    assert base_prefix(f"{sibling}_valid") == str(sibling) and base_prefix(own) == str(own)
    assert summary.split_prefixes(own) == [f"{own}_{n}" for n in ("train", "valid", "test")]
    assert summary.prepare_report(own)["report"]["documents"] == 10
    assert main(["data", "inspect", str(own), "--show", "0"]) == 0
    assert "kept 10 of 10 documents" in capsys.readouterr().out
    with open(f"{own}_train.bin", "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    with pytest.raises(DataError, match="wiki_test_train.bin: sha256"):
        verify(own)


# --- 2. split options are checked before any document is tokenized ----------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--split-order", "random", "--split-seed", "-1"], "--split-seed -1 is not a non-negative integer"),
    (["--split", "1e308,1e308,1"], "positive, finite sum"),
])
def test_bad_split_options_are_refused_before_tokenizing_and_keep_the_old_dataset(
        data_dir, tmp_path, monkeypatch, capsys, flags, message):
    """A negative --split-seed (numpy's default_rng refused it) and weights whose sum overflows to inf
    used to fail after the whole corpus was tokenized, with a traceback and exit 1."""
    corpus, prefix = _jsonl(tmp_path / "c.jsonl", 10), tmp_path / "out"
    _prepare(data_dir, corpus, prefix)
    before = _files(prefix)
    tokenized, real = [], pre._tokenize_all
    monkeypatch.setattr(pre, "_tokenize_all", lambda *a: tokenized.append(a) or real(*a))
    args = ["data", "prepare", "--input", str(corpus), "--output-prefix", str(prefix), "--overwrite",
            "--data-dir", str(data_dir), *CLI_FLAGS, *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err and not tokenized
    assert _files(prefix) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "c.jsonl"])


def test_an_unknown_split_order_or_a_bad_seed_from_the_api_is_refused_before_tokenizing(data_dir, tmp_path,
                                                                                         monkeypatch):
    corpus, tokenized, real = _jsonl(tmp_path / "c.jsonl", 10), [], pre._tokenize_all
    monkeypatch.setattr(pre, "_tokenize_all", lambda *a: tokenized.append(a) or real(*a))
    for bad, match in (({"split_order": "shuffled"}, "--split-order 'shuffled' is unknown"),
                       ({"split_seed": 1.5}, "--split-seed 1.5")):
        with pytest.raises(DataError, match=match):
            _prepare(data_dir, corpus, tmp_path / "out", **bad)
    assert not tokenized and not list(tmp_path.glob("out*"))
    assert pre.check_split(pre.PrepareOptions(input=corpus, output_prefix="x", split_seed=0)) == (949, 50, 1)


# --- 3. a UTF-8 byte-order mark -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["shard_00", "corpus.jsonl", "corpus.jsonl.gz"])
def test_json_lines_with_a_byte_order_mark_are_json_lines(tmp_path, name):
    """Windows tools and pandas' to_json(encoding='utf-8-sig') start the file with a BOM: without a
    JSON name it was read as one plain-text document of raw JSON; a .jsonl was refused at line 1."""
    texts = [f"Document number {i}. It has some words." for i in range(5)]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8-sig")
    path = tmp_path / name
    path.write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    assert detect_format(path) == "jsonl"
    assert list(read_documents(path)) == texts


def test_plain_text_with_a_byte_order_mark_does_not_keep_it(tmp_path):
    path = tmp_path / "notes"
    path.write_bytes("First paragraph.\n\nSecond paragraph.\n".encode("utf-8-sig"))
    assert detect_format(path) == "text"
    assert list(read_documents(path)) == ["First paragraph.\n", "Second paragraph.\n"]


# --- 4. prepare --overwrite: a stop signal during the swap waits for its end --------------------------

def test_a_stop_signal_during_the_overwrite_swap_leaves_the_whole_new_dataset(data_dir, tmp_path, monkeypatch):
    """SIGTERM (the CLI's handler turns it into SystemExit) sent while the seven files are renamed
    into place, after the second: the CLI still exits 128 + 15, and every file is the new dataset's
    (it used to leave the new train beside the old valid, test and report)."""
    old, new = _jsonl(tmp_path / "old.jsonl", 10, "cat"), _jsonl(tmp_path / "new.jsonl", 20, "dog")
    prefix = tmp_path / "out"
    _prepare(data_dir, old, prefix)
    finals, real_replace, renames = {str(p) for p in output_files(str(prefix))}, os.replace, []

    def replace(src, dst):
        if str(dst) in finals:
            renames.append(dst)
            if len(renames) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    done = threading.Event()  # another thread, as tqdm's monitor or the tokenizer's pool: the kernel may
    other = threading.Thread(target=done.wait)  # give it a signal this thread has masked
    other.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            main(["data", "prepare", "--input", str(new), "--output-prefix", str(prefix), "--overwrite",
                  "--split", "8,1,1", "--data-dir", str(data_dir), *CLI_FLAGS])
    finally:
        done.set()
        other.join()
    monkeypatch.undo()
    assert stopped.value.code == 128 + signal.SIGTERM and len(renames) == 7
    assert len(verify(prefix)) == 6  # every split file is what the report of the new run recorded
    assert json.loads(Path(f"{prefix}_prepare.json").read_text())["report"]["documents"] == 20
    assert sum(IndexedDataset(f"{prefix}_{n}").num_documents for n in ("train", "valid", "test")) == 20
    assert not list(tmp_path.glob("out.*tmp*"))


# --- 5. BERT token ids outside the WordPiece vocabulary ----------------------------------------------

@pytest.mark.parametrize("low, high", [(1000, 119547), (-5, 0)])  # multilingual-BERT-sized ids; negative ones
def test_bert_ids_outside_the_vocabulary_are_a_data_error_naming_the_fix(bert_tokenizer, tmp_path, low, high):
    """A corpus prepared with another vocabulary: the first sample is a DataError naming the mismatch
    and the fix, not a bare IndexError (ids too large) or a silent sample (negative ids)."""
    from repro.data.bert_dataset import BertDataset, BertOptions

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "x", np.int32) as writer:
        for _ in range(5):
            writer.add_document([rng.integers(low, high, 12) for _ in range(4)])
    dataset = BertDataset(tmp_path / "x", bert_tokenizer, BertOptions(max_seq_length=64), cache_dir=tmp_path)
    with pytest.raises(DataError, match="outside the 30,522-id bert vocabulary.*Fix: prepare it again with "
                                        "`repro data prepare --tokenizer bert`"):
        dataset.at(0)

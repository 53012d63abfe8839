"""`repro data inspect`: the counts it prints are the dataset's, epochs follow GPTDataset's sample
rule, a config supplies the run's numbers, and a wrong prefix is a user error naming the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from data_fixtures import data_dir, data_mirror, gpt2_tokenizer  # noqa: F401

from repro.cli import main
from repro.data.filters import FilterOptions
from repro.data.gpt_dataset import GPTDataset
from repro.data.indexed_dataset import IndexedDataset
from repro.data.preprocess import PrepareOptions, prepare
from repro.data.summary import gpt_epoch, summarize


@pytest.fixture(scope="module")
def corpus(data_dir, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("inspect") / "wt"
    prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens", output_prefix=str(prefix),
                           data_dir=data_dir, workers=1, split="50,10,0", progress=False,
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    return prefix


def test_summary_counts_are_the_datasets(corpus):
    data, got = IndexedDataset(f"{corpus}_train"), summarize(f"{corpus}_train")
    per_doc = [len(data.document_tokens(d)) for d in range(data.num_documents)]
    assert (got.documents, got.sequences, got.tokens) == (50, 50, data.num_tokens) == (50, 50, sum(per_doc))
    assert got.doc_tokens_max == max(per_doc) and got.doc_tokens_median == np.median(per_doc)
    assert got.doc_tokens_mean == pytest.approx(np.mean(per_doc))
    assert summarize(f"{corpus}_test").documents == 0


def test_epochs_follow_the_gpt_dataset(corpus):
    for seq in (64, 128, 1000):
        samples, iters = gpt_epoch(summarize(f"{corpus}_train").tokens, seq, 8)
        assert samples == len(GPTDataset(f"{corpus}_train", seq, cache_dir=corpus.parent / "cache")) and iters == samples // 8


def test_cli_prints_splits_report_epochs_and_a_decoded_preview(corpus, data_dir, tmp_path, capsys):
    assert main(["data", "inspect", str(corpus), "--data-dir", str(data_dir), "--seq-length", "128",
                 "--global-batch", "8", "--show", "1", "--chars", "60"]) == 0
    out = capsys.readouterr().out
    samples, iters = gpt_epoch(summarize(f"{corpus}_train").tokens, 128, 8)
    assert f"{corpus}_train" in out and f"{corpus}_valid" in out and f"{corpus}_test" in out
    assert "kept 60 of 60 documents" in out and f"{samples:,} samples = {iters:,} iterations per epoch" in out
    assert "document 0]  = Homarus gammarus = " in out
    config = tmp_path / "run.yaml"
    config.write_text(f"include: [{Path(__file__).parents[1] / 'experiments/tiny/gpt_tiny.yaml'}]\n"
                      f"data:\n  train_prefix: {corpus}_train\ntrain:\n  train_iters: {2 * iters}\n")
    assert main(["data", "inspect", "--config", str(config), "--show", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{2 * iters:,} iterations = " in out and " epochs" in out
    assert main(["data", "inspect", str(tmp_path / "nothing")]) == 2
    assert "nothing_train.idx. Fix: give the --output-prefix" in capsys.readouterr().err


def test_bad_config_and_damaged_report_are_named_not_tracebacks(corpus, tmp_path, capsys):
    assert main(["data", "inspect", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    unprepared = tmp_path / "unprepared.yaml"
    unprepared.write_text(f"include: [{Path(__file__).parents[1] / 'experiments/tiny/gpt_tiny.yaml'}]\n"
                          f"data:\n  train_prefix: {tmp_path}/corpus_train\n")
    assert main(["data", "inspect", "--config", str(unprepared)]) == 2  # it used to suggest corpus_train_train
    err = capsys.readouterr().err
    assert f"data.train_prefix {tmp_path}/corpus_train has no {tmp_path}/corpus_train.idx" in err
    assert f"--output-prefix {tmp_path}/corpus`" in err and "_train_train" not in err
    import shutil

    for name in ("train", "valid"):
        for ext in (".bin", ".idx"):
            shutil.copy(f"{corpus}_{name}{ext}", tmp_path / f"c_{name}{ext}")
    (tmp_path / "c_prepare.json").write_text("{not json")
    with pytest.warns(UserWarning, match="c_prepare.json: not a readable prepare report"):
        assert main(["data", "inspect", str(tmp_path / "c"), "--show", "0"]) == 0
    assert "c_train" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, least", [("--seq-length", "0", 1), ("--global-batch", "-8", 1),
                                                  ("--show", "-1", 0), ("--chars", "0", 1)])
def test_counts_below_their_least_are_named_not_ignored(corpus, capsys, option, value, least):
    """Before, --seq-length 0 or --global-batch 0 left the epochs line out, --seq-length -5 printed
    "0 samples", and --show -1 previewed nothing: all exit 0 with no word of the bad count."""
    assert main(["data", "inspect", str(corpus), "--seq-length", "128", "--global-batch", "8", option, value]) == 2
    out, err = capsys.readouterr()
    assert f"{option} {value} must be at least {least}" in err and "Fix:" in err and not out, err


def test_verify_passes_a_faithful_copy_and_names_each_changed_or_missing_file(corpus, tmp_path, capfd):
    """`repro data verify`: prepare recorded every split file's sha256; a copy with one flipped byte
    in a .bin and a lost .idx fails (exit 2) naming both files and the fix."""
    import shutil

    assert main(["data", "verify", f"{corpus}_train"]) == 0  # a split prefix finds its dataset too
    assert capfd.readouterr().out.count("      ok  ") == 6
    copy = tmp_path / "wt"
    for path in corpus.parent.glob(f"{corpus.name}_*"):
        shutil.copy(path, tmp_path / path.name.replace(corpus.name, "wt", 1))
    assert main(["data", "verify", str(copy)]) == 0
    capfd.readouterr()
    train_bin = Path(f"{copy}_train.bin")
    data = bytearray(train_bin.read_bytes())
    data[len(data) // 2] ^= 1
    train_bin.write_bytes(bytes(data))
    Path(f"{copy}_valid.idx").unlink()
    assert main(["data", "verify", str(copy)]) == 2
    err = capfd.readouterr().err
    assert f"{copy}_train.bin: sha256" in err and f"{copy}_valid.idx: missing" in err and "Fix: copy them again" in err
    assert "2 of 6 files" in err


def test_verify_without_recorded_checksums_says_how_to_get_them(corpus, tmp_path, capfd):
    import json
    import shutil

    for path in corpus.parent.glob(f"{corpus.name}_*"):
        shutil.copy(path, tmp_path / path.name.replace(corpus.name, "old", 1))
    record = tmp_path / "old_prepare.json"
    old = json.loads(record.read_text())
    del old["report"]["sha256"]
    record.write_text(json.dumps(old))
    assert main(["data", "verify", str(tmp_path / "old")]) == 2
    assert "holds no checksums" in capfd.readouterr().err
    assert main(["data", "verify", str(tmp_path / "nothing")]) == 2
    assert "nothing_prepare.json not found" in capfd.readouterr().err

"""Must-show 2 (prepare = direct tokenization) and 3 (filters), plus input errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import bert_tokenizer, data_dir, data_mirror, gpt2_tokenizer  # noqa: F401

from repro.cli import main
from repro.data.documents import read_documents, split_sentences
from repro.data.errors import DataError
from repro.data.filters import FilterOptions
from repro.data.indexed_dataset import IndexedDataset
from repro.data.prepare_checks import parse_split
from repro.data.preprocess import PrepareOptions, prepare, split_bounds

NO_FILTERS = FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)


def _prepare(data_dir, input_path, prefix, **kw) -> tuple:
    """prepare() of one input file, or of a tuple of files and directories."""
    inputs = tuple(map(Path, input_path)) if isinstance(input_path, tuple) else Path(input_path)
    opts = PrepareOptions(input=inputs, output_prefix=str(prefix), data_dir=data_dir,
                          progress=False, **{"workers": 1, **kw})
    return opts, prepare(opts)


def test_wikitext_documents_partition_the_file(data_dir):
    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    docs = list(read_documents(path))
    text = path.read_text(encoding="utf-8")
    assert len(docs) == 60  # WikiText-2 validation has 60 articles
    assert all(d.startswith(" = ") and not d.startswith(" = = ") for d in docs)
    assert "".join(docs) == text[text.index(" = "):]  # all but the leading blank line


@pytest.mark.parametrize("chunk_docs", [16, 1])  # 1: 60 chunks through the 16 in flight, in order
def test_gpt_prepare_equals_direct_tokenization(data_dir, gpt2_tokenizer, tmp_path, chunk_docs):
    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    _, report = _prepare(data_dir, path, tmp_path / "wt", workers=2, split="1,0,0",
                         filters=NO_FILTERS, chunk_docs=chunk_docs)
    direct = [gpt2_tokenizer.encode(d) + [gpt2_tokenizer.eod] for d in read_documents(path)]
    ds = IndexedDataset(tmp_path / "wt_train")
    assert ds.dtype == np.uint16
    assert ds.num_tokens == sum(len(d) for d in direct) == report.tokens_written
    assert ds.num_documents == len(direct) == report.kept == 60
    for d, ids in enumerate(direct):
        assert ds.document_tokens(d).tolist() == ids
    assert IndexedDataset(tmp_path / "wt_valid").num_documents == 0
    assert report.tokens_per_s > 0
    assert json.loads((tmp_path / "wt_prepare.json").read_text())["report"]["kept"] == 60


def test_random_split_order_draws_valid_and_test_from_the_whole_file(data_dir, gpt2_tokenizer, tmp_path):
    """60 WikiText articles, split 50,25,25: file order gives the last 30 to valid/test; random order
    gives sets of the same sizes from the whole file, each article exactly once, the same per seed."""
    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    docs = [gpt2_tokenizer.encode(d) + [gpt2_tokenizer.eod] for d in read_documents(path)]

    def splits(order: str, seed: int = 1234) -> dict[str, list[int]]:
        prefix = tmp_path / f"{order}{seed}"
        _prepare(data_dir, path, prefix, split="50,25,25", filters=NO_FILTERS, split_order=order, split_seed=seed,
                 overwrite=True)
        out = {}
        for name in ("train", "valid", "test"):
            ds = IndexedDataset(f"{prefix}_{name}")
            out[name] = [docs.index(ds.document_tokens(d).tolist()) for d in range(ds.num_documents)]
        return out

    in_file_order = splits("file")
    assert in_file_order == {"train": list(range(30)), "valid": list(range(30, 45)), "test": list(range(45, 60))}
    drawn = splits("random")
    assert {k: len(v) for k, v in drawn.items()} == {"train": 30, "valid": 15, "test": 15}
    assert sorted(sum(drawn.values(), [])) == list(range(60)) and all(v == sorted(v) for v in drawn.values())
    assert min(drawn["valid"]) < 30 and min(drawn["test"]) < 30  # not only the file's second half
    assert splits("random") == drawn and splits("random", seed=7) != drawn


def test_bert_prepare_one_sequence_per_sentence(data_dir, bert_tokenizer, tmp_path):
    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    _prepare(data_dir, path, tmp_path / "b", tokenizer="bert", split="1,0,0", filters=NO_FILTERS)
    ds = IndexedDataset(tmp_path / "b_train")
    docs = list(read_documents(path))
    for d in (0, 17, 59):
        sentences = [s for s in split_sentences(docs[d]) if bert_tokenizer.encode(s)]
        assert [x.tolist() for x in ds.document(d)] == [bert_tokenizer.encode(s) for s in sentences]
    assert ds.num_documents == 60 and len(ds) > 5 * ds.num_documents


def test_split_sentences():
    text = "It is big . It was built in 1990 ! Was it ? yes, e.g. here.\nNew line. \"Quoted.\""
    assert split_sentences(text) == ["It is big .", "It was built in 1990 !", "Was it ? yes, e.g. here.",
                                     "New line.", "\"Quoted.\""]


def test_split_by_documents(data_dir, tmp_path):
    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    _, report = _prepare(data_dir, path, tmp_path / "s", split="80,15,5", filters=NO_FILTERS)
    counts = [IndexedDataset(tmp_path / f"s_{n}").num_documents for n in ("train", "valid", "test")]
    assert counts == [48, 9, 3] and list(report.outputs.values()) == counts
    assert split_bounds((949, 50, 1), 1000) == [0, 949, 999, 1000]
    assert parse_split("949,50,1") == (949, 50, 1)
    for bad in ("949,50", "a,b,c", "0,0,0", "1,-1,1", "nan,1,1", "inf,1,1"):
        with pytest.raises(DataError, match="Fix: e.g. --split 949,50,1"):
            parse_split(bad)


def _paragraphs(path: Path, min_words: int) -> list[str]:
    docs = read_documents(path, layout="paragraph")
    return [d.strip() for d in docs if len(d.split()) >= min_words and not d.startswith(" = ")]


def _perturb(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 100)):
        words[i] = f"changed{rng.randrange(10**6)}"
    return " ".join(words)


def test_filters_dedup_length_and_eval_overlap(data_dir, gpt2_tokenizer, tmp_path):
    rng = random.Random(0)
    distinct = _paragraphs(data_dir / "wikitext" / "wikitext-2.valid.tokens", 150)[:150]
    dups = [_perturb(rng.choice(distinct), rng) for _ in range(60)]
    short = ["A short note of a few words ." for _ in range(7)]
    lambada = [json.loads(x) for x in
               (data_dir / "lambada" / "lambada_openai.test.jsonl").read_text().splitlines()]
    eval_docs = [f"{r['context']} {r['continuation']}" * 3 for r in lambada[:5]]
    eval_docs += _paragraphs(data_dir / "wikitext" / "wiki.test.raw", 150)[:5]
    corpus = distinct + dups + short + eval_docs
    order = list(range(len(distinct), len(corpus)))
    rng.shuffle(order)
    corpus = distinct + [corpus[i] for i in order]  # originals first, the rest mixed
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
    filters = FilterOptions(min_tokens=64)
    _, report = _prepare(data_dir, tmp_path / "c.jsonl", tmp_path / "c", split="1,0,0",
                         filters=filters)
    assert report.documents == len(corpus)
    assert report.too_short == 7 and report.eval_overlap == 10
    assert report.near_duplicates >= 0.95 * 60 and report.kept >= len(distinct)
    assert report.kept + report.near_duplicates == len(distinct) + 60
    ds = IndexedDataset(tmp_path / "c_train")
    assert ds.num_documents == report.kept
    for i in range(len(distinct)):  # no distinct document removed: they lead the output
        assert ds.document_tokens(i).tolist() == gpt2_tokenizer.encode(distinct[i]) + [50256]


def test_length_filter_counts_tokens(data_dir, gpt2_tokenizer, tmp_path):
    texts = [" ".join(["word"] * n) for n in (5, 127, 128, 129, 400)]
    lengths = [len(gpt2_tokenizer.encode(t)) for t in texts]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _, report = _prepare(data_dir, tmp_path / "l.jsonl", tmp_path / "l", split="1,0,0",
                         filters=FilterOptions(min_tokens=128, dedup=False, eval_overlap=False))
    assert report.too_short == sum(n < 128 for n in lengths) and report.kept == 5 - report.too_short


@pytest.mark.parametrize("content, message", [
    (None, "input file is missing"),
    ("", "input file is empty"),
    ('{"text": "fine"}\n{"body": "no text key"}\n', r"x\.jsonl:2: not a JSON object with a 'text' key"),
    ('{"text": "fine"}\n{broken\n', r"x\.jsonl:2: not valid JSON"),
])
def test_bad_input(data_dir, tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        _prepare(data_dir, path, tmp_path / "out", filters=NO_FILTERS)


def test_web_text_damage_is_repaired_not_fatal(data_dir, gpt2_tokenizer, tmp_path):
    """A byte that is not UTF-8 and a lone-surrogate JSON escape (both common in crawls) read as
    U+FFFD, with 2 workers; the documents around them are unchanged."""
    path = tmp_path / "web.jsonl"
    path.write_bytes(b'{"text": "first document"}\n{"text": "bad \xff byte"}\n'
                     b'{"text": "lone \\ud800 surrogate"}\n{"text": "last document"}\n')
    _, report = _prepare(data_dir, path, tmp_path / "w", workers=2, split="1,0,0", filters=NO_FILTERS)
    ds = IndexedDataset(tmp_path / "w_train")
    texts = [gpt2_tokenizer.decode(ds.document_tokens(d)[:-1].tolist()) for d in range(ds.num_documents)]
    assert texts == ["first document", "bad \ufffd byte", "lone \ufffd surrogate", "last document"]
    assert report.skipped_records == 0


def test_line_ends_read_as_text_mode_does(tmp_path):
    """\\r\\n and a lone \\r end lines as with universal newlines (the reader counts bytes)."""
    (tmp_path / "crlf.txt").write_bytes(b"para one\r\nstill one\r\n\r\npara two\r\n")
    (tmp_path / "cr.txt").write_bytes(b"a\rb\r\rc\r")
    for name in ("crlf.txt", "cr.txt"):
        seen = []
        docs = list(read_documents(tmp_path / name, on_bytes=seen.append))
        assert sum(seen) == (tmp_path / name).stat().st_size
        assert "\r" not in "".join(docs)
    assert list(read_documents(tmp_path / "crlf.txt")) == ["para one\nstill one\n", "para two\n"]
    assert list(read_documents(tmp_path / "cr.txt")) == ["a\nb\n", "c\n"]


def test_records_without_text_stop_the_run_or_are_skipped_and_counted(data_dir, tmp_path, capsys):
    from repro.cli import main

    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "kept one"}\n{"text": null}\n{"body": "x"}\n{trunc\n{"text": "kept two"}\n')
    with pytest.raises(DataError, match=r"r\.jsonl:2: its 'text' is null, not a string.*--skip-bad-records"):
        _prepare(data_dir, path, tmp_path / "stop", filters=NO_FILTERS)
    assert not list(tmp_path.glob("stop*"))
    _, report = _prepare(data_dir, path, tmp_path / "skip", filters=NO_FILTERS, skip_bad_records=True,
                         split="1,0,0")
    assert report.kept == 2 and report.skipped_records == 3
    assert [e.split(":")[1] for e in report.skipped_examples] == ["2", "3", "4"]
    saved = json.loads((tmp_path / "skip_prepare.json").read_text())["report"]
    assert saved["skipped_records"] == 3 and "r.jsonl:4: not valid JSON" in saved["skipped_examples"][2]
    args = ["data", "prepare", "--input", str(path), "--output-prefix", str(tmp_path / "cli"), "--split", "1,0,0",
            "--data-dir", str(data_dir), "--min-tokens", "0", "--no-dedup", "--no-eval-filter", "--no-progress",
            "--skip-bad-records"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "skipped 3 JSON lines without text, e.g. " in out and f"{path}:2: its 'text' is null" in out


def test_leftovers_of_a_killed_prepare_are_reported(data_dir, tmp_path):
    (tmp_path / "c.unsplit-tmp4242.bin.tmp4242").write_bytes(b"x" * 1000)
    (tmp_path / "t.txt").write_text("a document of several words\n")
    with pytest.warns(UserWarning, match=r"1 temporary files of an earlier `prepare`.*rm .*c\.unsplit-tmp\*"):
        _prepare(data_dir, tmp_path / "t.txt", tmp_path / "c", filters=NO_FILTERS, split="1,0,0")
    assert (tmp_path / "c_train.bin").is_file()


def test_everything_filtered_is_an_error(data_dir, tmp_path):
    (tmp_path / "t.txt").write_text("tiny document\n\nanother one\n")
    with pytest.raises(DataError, match="none of its 2 documents survived.*Fix: lower --min-tokens"):
        _prepare(data_dir, tmp_path / "t.txt", tmp_path / "out",
                 filters=FilterOptions(eval_overlap=False))
    assert not list(tmp_path.glob("out*"))


def test_cli_prepare(data_dir, tmp_path, capsys):
    src = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    args = ["data", "prepare", "--input", str(src), "--output-prefix", str(tmp_path / "cli"),
            "--data-dir", str(data_dir), "--workers", "1", "--no-progress", "--tokenizer", "gpt2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "documents 60: kept 60" in out
    assert main(args[:3] + [str(tmp_path / "missing.txt")] + args[4:]) == 2
    assert "missing.txt: input file is missing" in capsys.readouterr().err


def test_near_duplicate_filter_decides_like_datasketchs_lsh():
    """2,000 signatures: 500 originals, then 1,500 copies with 5-60 of 128 min-hashes changed (estimated
    Jaccard 0.96-0.53, across the 0.7 threshold): the filter's keep/drop decisions equal MinHashLSH's."""
    from repro.data.bench import minhash_lsh_decisions, near_duplicate_signatures
    from repro.data.filters import NearDuplicateFilter

    signatures = near_duplicate_signatures(2000)
    filt = NearDuplicateFilter(0.7)
    ours = [filt.is_duplicate(key, sig) for key, sig in enumerate(signatures)]
    assert ours == minhash_lsh_decisions(signatures)
    assert not any(ours[:500]) and 300 < sum(ours) < 1400  # both kinds of decision occur


@pytest.mark.parametrize("jaccard", [0.75, 0.8])
def test_near_duplicate_filter_finds_pairs_just_above_the_threshold(jaccard):
    """400 pairs whose min-hashes agree with probability `jaccard` (a MinHash pair at that Jaccard):
    of the copies whose estimated Jaccard exceeds 0.7, the filter drops at least 97%. datasketch's
    default banding (14 x 9) found 71% at 0.75 and 87% at 0.8; the recall-weighted one (21 x 6) 99%."""
    import numpy as np

    from repro.data.filters import NearDuplicateFilter

    rng = np.random.default_rng(0)
    originals = rng.integers(0, 2**32, size=(400, 128), dtype=np.uint64).astype(np.uint32)
    copies = originals.copy()
    changed = rng.random(copies.shape) > jaccard
    copies[changed] = rng.integers(0, 2**32, changed.sum(), dtype=np.uint64)
    filt = NearDuplicateFilter(0.7)
    assert not any(filt.is_duplicate(key, sig) for key, sig in enumerate(originals))
    dropped = [filt.is_duplicate(400 + key, sig) for key, sig in enumerate(copies)]
    above = (originals == copies).mean(axis=1) > 0.7
    assert not any(np.array(dropped) & ~above)  # only what the Jaccard check allows
    assert above.sum() > 350 and sum(dropped) >= 0.97 * above.sum(), (sum(dropped), above.sum())


def test_data_bench_runs_and_writes_its_tables(data_dir, tmp_path):
    from repro.data.bench import main

    assert main(["--data-dir", str(data_dir), "--rounds", "1", "--repeat", "1", "--dedup-docs", "400",
                 "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "data_preprocess.json").read_text())
    assert record["dedup"]["same_decisions"] and record["dedup"]["ours"]["kept"] == record["dedup"]["datasketch"]["kept"]
    assert record["pipeline_filters"]["documents"] == record["pipeline_no_filters"]["documents"] > 0
    assert "| ours |" in (tmp_path / "data_preprocess.md").read_text()


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    import gzip

    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def test_several_inputs_are_one_corpus_deduplicated_across_files(data_dir, gpt2_tokenizer, tmp_path):
    """60 WikiText articles over a file, a gzip file and a directory, one article repeated in the last
    file: the output is the 60 articles in input order, the repeat removed as a near-duplicate across
    files, and each file's documents and kept ones counted; progress sums to the bytes on disk."""
    from repro.data.documents import _lines

    articles = list(read_documents(data_dir / "wikitext" / "wikitext-2.valid.tokens"))
    first = _write_jsonl(tmp_path / "a.jsonl", articles[:20])
    second = _write_jsonl(tmp_path / "b.jsonl.gz", articles[20:40])
    (tmp_path / "more" / "sub").mkdir(parents=True)
    third = _write_jsonl(tmp_path / "more" / "sub" / "c.jsonl", articles[40:50] + [articles[5]] + articles[50:])
    _write_jsonl(tmp_path / "more" / ".hidden.jsonl", articles[:3])  # not a corpus file
    (tmp_path / "more" / "README.md").write_text(articles[0])  # nor this
    read: list[int] = []
    assert [d for d in read_documents(second, on_bytes=read.append)] == articles[20:40]
    assert sum(read) == second.stat().st_size < sum(len(line) for line in _lines(second, None))
    filters = FilterOptions(min_tokens=0, eval_overlap=False)
    with pytest.warns(UserWarning, match="1 files are not read, e.g. README.md"):
        _, report = _prepare(data_dir, (first, second, tmp_path / "more"), tmp_path / "one", split="1,0,0",
                             filters=filters, workers=2)
    ds = IndexedDataset(tmp_path / "one_train")
    direct = [gpt2_tokenizer.encode(d) + [gpt2_tokenizer.eod] for d in articles]
    assert [ds.document_tokens(d).tolist() for d in range(ds.num_documents)] == direct
    assert (report.documents, report.kept, report.near_duplicates) == (61, 60, 1)
    assert report.inputs == {str(first): {"documents": 20, "kept": 20}, str(second): {"documents": 20, "kept": 20},
                             str(third): {"documents": 21, "kept": 20}}
    saved = json.loads((tmp_path / "one_prepare.json").read_text())
    assert saved["report"]["inputs"][str(third)] == {"documents": 21, "kept": 20}
    assert saved["options"]["input"] == [str(first), str(second), str(tmp_path / "more")]


def test_gzip_is_known_by_its_bytes_and_other_binaries_are_refused(data_dir, tmp_path):
    """A gzip file without .gz in its name (a symlink, a bare download) is still decompressed; an xz
    file is refused by name, UTF-16 text by its byte-order mark; --layout file makes each whole file one
    document."""
    import lzma

    docs = ["first document here", "second document here"]
    hidden = _write_jsonl(tmp_path / "x.jsonl.gz", docs).rename(tmp_path / "download")
    (tmp_path / "link").symlink_to(hidden)
    assert list(read_documents(tmp_path / "link")) == list(read_documents(hidden)) == docs
    (tmp_path / "c.jsonl.xz").write_bytes(lzma.compress(b'{"text": "x"}\n' * 100))
    with pytest.raises(DataError, match="c.jsonl.xz: not text .*decompress or extract it first"):
        _prepare(data_dir, tmp_path / "c.jsonl.xz", tmp_path / "out", filters=NO_FILTERS)
    (tmp_path / "notes.txt").write_text("Windows saved this.\n", encoding="utf-16")  # a byte-order mark first
    with pytest.raises(DataError, match="notes.txt: UTF-16 .*text.*Fix: convert it, e.g. `iconv -f UTF-16"):
        _prepare(data_dir, tmp_path / "notes.txt", tmp_path / "out", filters=NO_FILTERS)
    (tmp_path / "page.txt").write_text("A web page.\n\nIts second paragraph.\n")
    assert list(read_documents(tmp_path / "page.txt", layout="file")) == ["A web page.\n\nIts second paragraph.\n"]
    assert len(list(read_documents(tmp_path / "page.txt"))) == 2  # paragraphs, by default


def test_bad_inputs_among_several_are_named_and_leave_nothing(data_dir, tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", ["a document"])
    cut = tmp_path / "cut.jsonl.gz"
    _write_jsonl(tmp_path / "whole.jsonl.gz", ["another document"] * 200)
    cut.write_bytes((tmp_path / "whole.jsonl.gz").read_bytes()[:-12])
    (tmp_path / "empty_dir").mkdir()
    cases = [((good, good), "names .*good.jsonl twice"), ((good, tmp_path / "empty_dir"), "directory without corpus"),
             ((good, tmp_path / "nope.jsonl"), "nope.jsonl: input file is missing"),
             ((good, cut), "cut.jsonl.gz: the gzip stream is damaged or cut short")]
    for inputs, message in cases:
        with pytest.raises(DataError, match=message):
            _prepare(data_dir, inputs, tmp_path / "out", filters=NO_FILTERS, split="1,0,0")
        assert not list(tmp_path.glob("out*")), inputs
    # the cut-short gzip is found before tokenizing starts: no temporary dataset was begun
    import repro.data.preprocess as pre

    begun = []
    original = pre._tokenize_all
    pre._tokenize_all = lambda *a: begun.append(a) or original(*a)
    try:
        with pytest.raises(DataError, match="cut.jsonl.gz: the gzip stream is damaged"):
            _prepare(data_dir, (good, cut), tmp_path / "out", filters=NO_FILTERS, split="1,0,0")
    finally:
        pre._tokenize_all = original
    assert begun == []


def test_several_inputs_in_file_order_warn_that_valid_and_test_are_the_last_files(data_dir, tmp_path, capsys):
    docs = [f"document number {i} " * 5 for i in range(40)]
    a, b = _write_jsonl(tmp_path / "a.jsonl", docs[:20]), _write_jsonl(tmp_path / "b.jsonl", docs[20:])
    with pytest.warns(UserWarning, match="come from b.jsonl"):
        _prepare(data_dir, (a, b), tmp_path / "f", filters=NO_FILTERS, split="8,1,1")
    assert main(["data", "prepare", "--input", str(a), str(b), "--output-prefix", str(tmp_path / "cli"),
                 "--data-dir", str(data_dir), "--workers", "1", "--no-progress", "--split-order", "random",
                 "--no-dedup", "--no-eval-filter", "--min-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{a}: kept 20 of 20 documents" in out and f"{b}: kept 20 of 20 documents" in out


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_mid_run_removes_the_temporary_files_and_keeps_the_old_dataset(data_dir, tmp_path, signame):
    """Slurm's time limit (SIGTERM) or slurm/prepare_data.sh's warning (SIGUSR1): the CLI exits 128 +
    the signal with no temporary file left, and an earlier dataset at the prefix (from a first run)
    is untouched."""
    import os
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=300))}) + "\n" for _ in range(20000)))
    small = _write_jsonl(tmp_path / "small.jsonl", ["an earlier dataset"] * 3)
    _prepare(data_dir, small, tmp_path / "out", filters=NO_FILTERS, split="1,0,0")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out_*")}
    cmd = [sys.executable, "-m", "repro.cli", "data", "prepare", "--input", str(corpus), "--output-prefix",
           str(tmp_path / "out"), "--overwrite", "--data-dir", str(data_dir), "--workers", "2", "--no-progress",
           "--no-eval-filter", "--min-tokens", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not list(tmp_path.glob("out.unsplit-tmp*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # well into tokenizing
    assert proc.poll() is None, "prepare ended before the signal: make the corpus larger"
    sig = getattr(signal, signame)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig, proc.stdout.read()
    assert not list(tmp_path.glob("out.*tmp*")), list(tmp_path.glob("out.*tmp*"))
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out_*")} == before


def test_prepare_in_process_gives_the_callers_signal_handlers_back(data_dir, tmp_path):
    """`repro data prepare` called in a process that goes on (a notebook, a test session): its
    SystemExit-on-TERM handler is gone afterwards. It used to stay, and hung the test session: a
    later test's multiprocessing pool (lm-eval's bootstrap) waited forever in terminate() for a
    worker that still had the handler installed (most likely it got the pool's TERM while being forked,
    and a signal meant for a Python handler is dropped then; with the default action the kernel ends
    the worker). A stand-alone loop of 100 pool starts and terminate()s hung in 5 of 6 tries with a
    Python TERM handler installed, never without."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    small = _write_jsonl(tmp_path / "small.jsonl", ["a few words"] * 3)
    assert main(["data", "prepare", "--input", str(small), "--output-prefix", str(tmp_path / "out"),
                 "--data-dir", str(data_dir), "--workers", "1", "--no-progress", "--no-dedup",
                 "--no-eval-filter", "--min-tokens", "0", "--split", "1,0,0"]) == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_file_order_train_split_is_the_unsplit_file_cut_not_a_copy(data_dir, gpt2_tokenizer, tmp_path, monkeypatch):
    """In file order train is the first documents: the unsplit .bin is cut and renamed into train (its
    inode survives; no second copy on disk), with the same datasets a copy gives (random order)."""
    import os

    import repro.data.indexed_dataset as ix
    import repro.data.preprocess as pre

    path = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    inodes = {}
    original = ix.move_leading_documents

    def spy(src, n, prefix):
        inodes["unsplit"] = os.stat(f"{src}.bin").st_ino
        original(src, n, prefix)
        inodes["train"] = os.stat(f"{prefix}.bin").st_ino
    monkeypatch.setattr(pre, "move_leading_documents", spy)
    _prepare(data_dir, path, tmp_path / "cut", split="40,15,5", filters=NO_FILTERS)
    assert inodes["unsplit"] == inodes["train"]
    monkeypatch.setattr(pre, "move_leading_documents", original)
    docs = [gpt2_tokenizer.encode(d) + [gpt2_tokenizer.eod] for d in read_documents(path)]
    for name, (lo, hi) in zip(("train", "valid", "test"), ((0, 40), (40, 55), (55, 60))):
        ds = IndexedDataset(tmp_path / f"cut_{name}")
        assert [ds.document_tokens(d).tolist() for d in range(ds.num_documents)] == docs[lo:hi], name
        assert Path(f"{tmp_path}/cut_{name}.bin").stat().st_size == sum(map(len, docs[lo:hi])) * 2
    assert not list(tmp_path.glob("cut.*tmp*"))


# --- input formats: --layout file and text names are never JSON lines -----------------------------

PAGE = '{"@context": "https://schema.org", "@type": "NewsArticle"} page header\n\nThe story itself.\n'


def test_layout_file_and_text_names_are_never_read_as_json_lines(data_dir, gpt2_tokenizer, tmp_path, capsys):
    """An extracted web page whose text starts with "{" (JSON-LD) is one document under --layout file
    (with any name) and plain text under a .txt name: before, it was sniffed as JSON lines and the run
    died when it reached the page, or, with --skip-bad-records, dropped it ("kept 0 of 0")."""
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "page0.txt").write_text("An ordinary page.\n")
    (pages / "page1.txt").write_text(PAGE)
    (tmp_path / "page2").write_text(PAGE)  # no suffix at all
    assert list(read_documents(pages / "page1.txt", layout="file")) == [PAGE]
    assert list(read_documents(tmp_path / "page2", layout="file")) == [PAGE]
    assert len(list(read_documents(pages / "page1.txt"))) == 2  # paragraphs of plain text
    for extra in ([], ["--skip-bad-records"]):
        prefix = tmp_path / f"owt{len(extra)}"
        assert main(["data", "prepare", "--input", str(pages), str(tmp_path / "page2"), "--layout", "file",
                     "--output-prefix", str(prefix), "--data-dir", str(data_dir), "--workers", "1", "--split", "1,0,0",
                     "--no-progress", "--min-tokens", "0", "--no-dedup", "--no-eval-filter", *extra]) == 0
        assert f"{pages / 'page1.txt'}: kept 1 of 1 documents" in capsys.readouterr().out
        ds = IndexedDataset(f"{prefix}_train")
        assert ds.document_tokens(1).tolist() == gpt2_tokenizer.encode(PAGE) + [gpt2_tokenizer.eod]


def test_a_format_mismatch_is_found_before_tokenizing_starts(data_dir, tmp_path, monkeypatch):
    """A file whose first line starts with "{" without being a JSON object with the key (no telling
    name), or a text file given --format jsonl: a DataError naming it and the fix, before the first
    input is tokenized; a JSON-lines file without a suffix is still read as one."""
    import repro.data.preprocess as pre

    good = _write_jsonl(tmp_path / "good.jsonl", ["a document"])
    (tmp_path / "page").write_text(PAGE)
    (tmp_path / "other_key").write_text('{"content": "a record under another key"}\n')
    (tmp_path / "t.txt").write_text("plain text\n")
    begun = []
    monkeypatch.setattr(pre, "_tokenize_all", lambda *a: begun.append(a))
    cases = [((good, tmp_path / "page"), {}, r"page:1: starts with \"\{\" but is not a JSON object with a 'text' key"),
             ((good, tmp_path / "other_key"), {}, r"other_key:1: .*Fix: --format text .*--json-key KEY"),
             ((good, tmp_path / "t.txt"), {"input_format": "jsonl"}, r"t\.txt:1: not valid JSON")]
    for inputs, kw, message in cases:
        with pytest.raises(DataError, match=message):
            _prepare(data_dir, inputs, tmp_path / "out", filters=NO_FILTERS, split="1,0,0", **kw)
    assert begun == [] and not list(tmp_path.glob("out*"))
    _write_jsonl(tmp_path / "records.jsonl", ["first", "second"]).rename(tmp_path / "records")
    assert list(read_documents(tmp_path / "records")) == ["first", "second"]
    assert list(read_documents(tmp_path / "other_key", json_key="content")) == ["a record under another key"]


# --- a failure while the splits are written leaves no temporary file -------------------------------

ENOSPC = OSError(28, "No space left on device")


@pytest.mark.parametrize("order, target, error", [
    ("file", "_train.idx.tmp", ENOSPC), ("file", "_train.idx.tmp", SystemExit(143)),  # train: the unsplit file cut
    ("random", "_train.idx.tmp", ENOSPC), ("random", "_train.idx.tmp", SystemExit(143)),  # train: a copy
    ("file", "_valid.idx.tmp", ENOSPC), ("random", ".unsplit-tmp", ENOSPC),  # a valid copy; the unsplit index
], ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_a_failure_while_splits_are_written_removes_every_temporary_file(data_dir, tmp_path, monkeypatch,
                                                                         order, target, error):
    """ENOSPC, or SIGTERM (SystemExit, as the CLI's handler raises it), while train is moved or copied,
    valid copied, or the unsplit index written: nothing temporary is left (before: the partial split
    copies, ~85 GB at the paper's scale), and an earlier dataset at the prefix is untouched."""
    import repro.data.indexed_dataset as ix

    path = _write_jsonl(tmp_path / "corpus.jsonl", [f"document {i} of the corpus " * 20 for i in range(60)])
    _prepare(data_dir, _write_jsonl(tmp_path / "small.jsonl", ["an earlier dataset"] * 3), tmp_path / "out",
             filters=NO_FILTERS, split="1,1,1")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out*")}
    original = ix.write_index

    def failing(handle, *args):
        if target in handle.name:
            handle.write(b"partial")
            raise error
        original(handle, *args)
    monkeypatch.setattr(ix, "write_index", failing)
    # a full disk is a DataError naming it (test_crash_safety.py); SystemExit passes through
    with pytest.raises(DataError if isinstance(error, OSError) else type(error)):
        _prepare(data_dir, path, tmp_path / "out", filters=NO_FILTERS, split="40,15,5", split_order=order,
                 overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out*")} == before


# --- a bad --output-prefix --------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["file", "file_below", "read_only"])
def test_an_unwritable_output_prefix_is_named_before_the_tokenizer_loads(data_dir, tmp_path, monkeypatch, capsys,
                                                                        where):
    """Its parent is a file (or below one), or a directory this user cannot write: exit 2 naming
    --output-prefix and the fix, before the tokenizer loads, nothing written (before: a traceback)."""
    import os

    import repro.data.prepare_checks as checks
    import repro.data.preprocess as pre

    (tmp_path / "notes.md").write_text("a file")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    prefix = {"file": tmp_path / "notes.md" / "c", "file_below": tmp_path / "notes.md" / "a" / "b" / "c",
              "read_only": tmp_path / "ro" / "sub" / "c"}[where]
    if where == "read_only" and os.geteuid() == 0:  # root writes anyway: fail the write as for a user
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(checks.tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(pre, "build_tokenizer", lambda *a: pytest.fail("the tokenizer was loaded"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc = main(["data", "prepare", "--input", str(data_dir / "wikitext" / "wikitext-2.valid.tokens"),
               "--output-prefix", str(prefix), "--data-dir", str(data_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--output-prefix {prefix}: cannot write there" in err and "Fix:" in err, err
    assert ("is not a directory" if where != "read_only" else "Permission denied") in err
    assert "Traceback" not in err and sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# --- pool workers and stop signals ------------------------------------------------------------------

def _late_signal_setup() -> None:
    """A pool worker whose TERM arrives before it has set up its signals (the race of a pool closed
    right after it started): it then sets them up as every worker does, and would live on."""
    import time

    from repro.data.preprocess import worker_signal_defaults

    time.sleep(0.5)
    worker_signal_defaults()
    time.sleep(30)


@pytest.mark.parametrize("blocked", [True, False])
def test_a_term_that_reaches_a_worker_before_its_signal_setup_still_ends_it(blocked):
    """The CI hang of `repro data prepare` (pool.terminate() joining a worker forever): with a Python
    TERM handler in the parent, a TERM that a fresh worker receives before its own setup can be lost
    (here: a handler that does nothing stands for it). Forked under stop_signals_blocked, the worker
    holds the TERM pending and dies of it once its setup unblocks it; without, it lives on."""
    import contextlib
    import multiprocessing as mp
    import os
    import signal

    from repro.data.preprocess import stop_signals_blocked

    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    child = None
    try:
        with stop_signals_blocked() if blocked else contextlib.nullcontext():
            child = mp.get_context("fork").Process(target=_late_signal_setup)
            child.start()
        os.kill(child.pid, signal.SIGTERM)
        child.join(5)
        assert (child.exitcode == -signal.SIGTERM) if blocked else child.is_alive()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child is not None and child.is_alive():
            child.kill()
            child.join()


def test_a_pool_prepare_restores_the_signal_mask_and_equals_one_process(data_dir, tmp_path):  # noqa: F811
    """prepare with 2 workers leaves this process's signal mask as it was, and its output equals
    the one-process output (the pool closes and joins its workers on success)."""
    import signal

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} with a few words"}) + "\n" for i in range(40)))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        prepare(PrepareOptions(input=src, output_prefix=str(prefix), data_dir=data_dir, workers=workers,
                               split="1,0,0", progress=False, filters=FilterOptions(min_tokens=0, dedup=False,
                                                                                     eval_overlap=False)))
        outputs.append(Path(f"{prefix}_train.bin").read_bytes())
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert outputs[0] == outputs[1] and outputs[0]


def _large_result(_text: str) -> bytes:
    return b"x" * 32_000_000  # far past a pipe's 64 KiB: a worker is mostly in the middle of writing one


def test_a_stop_while_the_workers_write_their_results_never_hangs():
    """The CI hang of a stop signal mid-`repro data prepare` (1 in about 10 stops): the pool killed its
    workers, one in the middle of writing a result, and the parent then waited forever for the rest of
    that message. Abandoned right after its first result (as SystemExit from a stop signal abandons
    it), the pool now winds down within seconds every time; the old one hung in 1 of about 5 tries."""
    import threading

    from repro.data.preprocess import process_documents

    for attempt in range(10):
        results = process_documents(iter(["a document"] * 200), _large_result, workers=2, chunk_docs=1)
        assert len(next(results)) == 32_000_000
        closing = threading.Thread(target=results.close, daemon=True)
        closing.start()
        closing.join(30)
        assert not closing.is_alive(), f"the pool hung winding down (attempt {attempt})"


def _dies_on_poison(text: str) -> str:
    import os
    import signal

    if text == "poison":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer ends a worker
    return text


def test_a_worker_that_dies_is_a_data_error_that_names_the_fix():
    """A worker killed mid-run (out of memory) is a DataError naming --workers, not a hang: the old
    pool started a new worker and waited forever for the chunk the dead one held."""
    from repro.data.preprocess import process_documents

    docs = ["fine"] * 50 + ["poison"] + ["fine"] * 50
    with pytest.raises(DataError, match="--workers process died.*Fix: rerun with fewer --workers"):
        list(process_documents(iter(docs), _dies_on_poison, workers=2, chunk_docs=4))


def test_eval_sets_chooses_which_test_sets_are_filtered(data_dir, tmp_path, capsys):
    """--eval-sets wikitext is the paper's filter (WikiText-103 test articles only): a LAMBADA passage stays."""
    lambada = [json.loads(x) for x in (data_dir / "lambada" / "lambada_openai.test.jsonl").read_text().splitlines()]
    lambada_docs = [f"{r['context']} {r['continuation']}" * 3 for r in lambada[:3]]
    wiki_docs = _paragraphs(data_dir / "wikitext" / "wiki.test.raw", 150)[:2]
    other = _paragraphs(data_dir / "wikitext" / "wikitext-2.valid.tokens", 150)[:1]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lambada_docs + wiki_docs + other))
    base = ["data", "prepare", "--input", str(path), "--split", "1,0,0", "--data-dir", str(data_dir),
            "--min-tokens", "0", "--no-dedup", "--no-progress", "--workers", "1"]
    kept = {}
    for sets in ("wikitext", "lambada", "wikitext,lambada"):
        prefix = tmp_path / sets.replace(",", "_")
        assert main([*base, "--output-prefix", str(prefix), "--eval-sets", sets]) == 0
        record = json.loads((tmp_path / f"{prefix.name}_prepare.json").read_text())
        kept[sets] = record["report"]["kept"]
        assert len(record["filters"]["eval_files"]) == sets.count(",") + 1
    assert kept == {"wikitext": 4, "lambada": 3, "wikitext,lambada": 1}
    capsys.readouterr()
    assert main([*base, "--output-prefix", str(tmp_path / "bad"), "--eval-sets", "wikitext,lambda"]) == 2
    err = capsys.readouterr().err
    assert "'lambda' is none" in err and "wikitext, lambada" in err and "--no-eval-filter" in err
    assert not list(tmp_path.glob("bad*"))

"""`repro data fetch`: copy/download, sha256 verification, idempotence, and its error messages."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from data_fixtures import data_dir, data_mirror  # noqa: F401

from repro.cli import main
from repro.data.errors import DataError
from repro.data.fetch import MANIFEST, DataFile, FetchOptions, data_path, fetch, sha256_file
from repro.data.tokenizers import build_tokenizer


def test_fetch_copies_every_file_verified(data_dir, data_mirror):
    for entry in MANIFEST:
        path = data_dir / entry.path
        assert path.is_file() and sha256_file(path) == entry.sha256
        assert path.read_bytes() == (data_mirror / entry.path).read_bytes()


def test_fetch_is_idempotent(data_dir, data_mirror):
    done = fetch(FetchOptions(data_dir=data_dir, mirror=data_mirror))
    assert set(done.values()) == {"present"}
    assert not list(data_dir.rglob("*.tmp"))


def _copy_vocab(data_dir: Path, dest: Path) -> Path:
    shutil.copytree(data_dir / "vocab", dest / "vocab")
    return dest


def test_wrong_vocab_sha_is_an_error_naming_file_and_fix(data_dir, tmp_path):
    bad = _copy_vocab(data_dir, tmp_path)
    merges = bad / "vocab" / "gpt2-merges.txt"
    merges.write_bytes(merges.read_bytes()[:-100])  # truncated
    with pytest.raises(DataError) as err:
        build_tokenizer("gpt2", bad)
    message = str(err.value)
    assert str(merges) in message and "sha256" in message and "repro data fetch" in message


def test_missing_vocab_names_file_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"bert-large-uncased-vocab\.txt: missing\. Fix: run `repro data fetch"):
        build_tokenizer("bert", tmp_path)


def test_fetch_replaces_a_corrupt_copy(data_dir, data_mirror, tmp_path):
    target = _copy_vocab(data_dir, tmp_path)
    vocab = target / "vocab" / "bert-large-uncased-vocab.txt"
    vocab.write_text("garbage")
    only = ("vocab/bert-large-uncased-vocab.txt",)
    done = fetch(FetchOptions(data_dir=target, mirror=data_mirror, only=only))
    assert done == {only[0]: "replaced a bad copy"}
    assert data_path(target, only[0]) == vocab


def test_bad_mirror_file_is_never_used(data_dir, tmp_path):
    mirror = _copy_vocab(data_dir, tmp_path / "mirror")
    json_path = mirror / "vocab" / "gpt2-vocab.json"
    json_path.write_bytes(json_path.read_bytes()[:1000])
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as err:
        fetch(FetchOptions(data_dir=dest, mirror=mirror, only=("vocab/gpt2-vocab.json",)))
    assert str(json_path) in str(err.value) and "Fix:" in str(err.value)
    assert not (dest / "vocab" / "gpt2-vocab.json").exists()
    assert not list(dest.rglob("*.tmp"))


def test_missing_mirror_dir(tmp_path):
    with pytest.raises(DataError, match="mirror directory does not exist"):
        fetch(FetchOptions(data_dir=tmp_path / "d", mirror=tmp_path / "nowhere"))


def test_download_zip_member_and_lambada_conversion(data_dir, tmp_path):
    """The download path, served by file:// URLs: a zip member, and OpenAI's LAMBADA {"text"} file."""
    wiki = data_dir / "wikitext" / "wikitext-2.valid.tokens"
    with zipfile.ZipFile(tmp_path / "wt.zip", "w") as archive:
        archive.write(wiki, "wikitext-2/wiki.valid.tokens")
    lambada = data_dir / "lambada" / "lambada_openai.test.jsonl"
    records = [json.loads(x) for x in lambada.read_text(encoding="utf-8").splitlines()]
    openai = "".join(json.dumps({"text": r["context"] + " " + r["continuation"]}) + "\n"
                     for r in records)
    (tmp_path / "lambada_test.jsonl").write_text(openai, encoding="utf-8")
    manifest = (
        DataFile("wikitext/wikitext-2.valid.tokens", sha256_file(wiki),
                 (tmp_path / "wt.zip").as_uri(), zip_member="wikitext-2/wiki.valid.tokens"),
        DataFile("lambada/lambada_openai.test.jsonl", sha256_file(lambada),
                 (tmp_path / "lambada_test.jsonl").as_uri(), convert="lambada_context_continuation"),
    )
    dest = tmp_path / "dest"
    done = fetch(FetchOptions(data_dir=dest, manifest=manifest))
    assert set(done.values()) == {"downloaded"}
    assert (dest / "lambada" / "lambada_openai.test.jsonl").read_bytes() == lambada.read_bytes()


def test_download_with_wrong_sha_is_rejected(tmp_path):
    (tmp_path / "src.txt").write_text("not the real vocab")
    entry = DataFile("vocab/x.txt", hashlib.sha256(b"something else").hexdigest(),
                     (tmp_path / "src.txt").as_uri())
    with pytest.raises(DataError, match=r"vocab/x\.txt \(fetched from .*src\.txt\): sha256"):
        fetch(FetchOptions(data_dir=tmp_path / "dest", manifest=(entry,)))
    assert not (tmp_path / "dest" / "vocab" / "x.txt").exists()


def test_cli_fetch_and_error_exit_code(data_mirror, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REPRO_DATA_MIRROR", str(data_mirror))
    monkeypatch.setenv("REPRO_DATA_DIR", str(tmp_path / "d"))
    assert main(["data", "fetch", "--only", "vocab/gpt2-merges.txt"]) == 0
    assert "copied" in capsys.readouterr().out
    assert main(["data", "fetch", "--only", "vocab/nope.txt"]) == 2
    assert "error: vocab/nope.txt: not a file this project knows" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=oct)
def test_fetched_files_get_the_mode_of_the_umask_not_mkstemps_0600(data_mirror, tmp_path, umask):
    """A shared REPRO_DATA_DIR: other users' jobs read the vocab and eval files (copied and
    downloaded alike), so each file is 0666 & ~umask, as open() would have made it."""
    import os
    import stat

    (tmp_path / "src.txt").write_text("a downloaded file")
    downloaded = DataFile("vocab/x.txt", sha256_file(tmp_path / "src.txt"), (tmp_path / "src.txt").as_uri())
    old = os.umask(umask)
    try:
        fetch(FetchOptions(data_dir=tmp_path / "d", mirror=data_mirror, only=("vocab/gpt2-merges.txt",)))
        fetch(FetchOptions(data_dir=tmp_path / "d", manifest=(downloaded,)))
    finally:
        os.umask(old)
    for path in (tmp_path / "d" / "vocab" / "gpt2-merges.txt", tmp_path / "d" / "vocab" / "x.txt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, oct(path.stat().st_mode)

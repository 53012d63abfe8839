"""`repro data fetch`: evaluation sets and vocabularies into a data directory, verified by sha256.

Files come from a mirror directory (REPRO_DATA_MIRROR, same relative paths) when one is given, else
from their public sources. A file is written through a temporary name and moved into place only
after its sha256 matches, so a truncated or wrong download is never used. Running it again skips
every file that is present and valid.

    REPRO_DATA_MIRROR=../shared/data repro data fetch       # copy from the mirror
    repro data fetch --data-dir /scratch/data               # download
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from repro.data.errors import DataError

DEFAULT_DATA_DIR = "./data"
_OPENAI = "https://openaipublic.blob.core.windows.net/gpt-2"
_WIKITEXT = "https://wikitext.smerity.com"


@dataclass(frozen=True)
class DataFile:
    """One file of the manifest: where it lives in the data dir, its sha256 and its public source."""

    path: str
    sha256: str
    url: str
    zip_member: str | None = None  # the file inside a zip archive at `url`
    convert: str | None = None  # name of a conversion applied after download (see _CONVERTERS)


MANIFEST: tuple[DataFile, ...] = (
    DataFile("wikitext/wiki.test.raw",
             "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
             f"{_WIKITEXT}/wikitext-2-raw-v1.zip", zip_member="wikitext-2-raw/wiki.test.raw"),
    DataFile("wikitext/wikitext-2.test.tokens",
             "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
             f"{_WIKITEXT}/wikitext-2-v1.zip", zip_member="wikitext-2/wiki.test.tokens"),
    DataFile("wikitext/wikitext-2.valid.tokens",
             "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
             f"{_WIKITEXT}/wikitext-2-v1.zip", zip_member="wikitext-2/wiki.valid.tokens"),
    DataFile("lambada/lambada_openai.test.jsonl",
             "411bfbe5b9054346b6a19299c0242670adbefb9162efd958593cbc0290b8c9dc",
             f"{_OPENAI}/data/lambada_test.jsonl", convert="lambada_context_continuation"),
    DataFile("vocab/gpt2-vocab.json",
             "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
             f"{_OPENAI}/encodings/main/encoder.json"),
    DataFile("vocab/gpt2-merges.txt",
             "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
             f"{_OPENAI}/encodings/main/vocab.bpe"),
    DataFile("vocab/bert-large-uncased-vocab.txt",
             "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
             "https://huggingface.co/google-bert/bert-large-uncased/resolve/main/vocab.txt"),
)


@dataclass(frozen=True)
class FetchOptions:
    """What `fetch` does: where to put the files and where to take them from."""

    data_dir: Path
    mirror: Path | None = None  # copy from here; None: download from the public sources
    only: tuple[str, ...] = ()  # relative paths to fetch; empty: the whole manifest
    timeout_s: float = 60.0  # per download
    manifest: tuple[DataFile, ...] = MANIFEST  # the files to know about (tests give their own)


def manifest_entry(rel_path: str, manifest: tuple[DataFile, ...] = MANIFEST) -> DataFile:
    """The manifest entry of one relative path, or a DataError listing the known ones."""
    for entry in manifest:
        if entry.path == rel_path:
            return entry
    known = ", ".join(e.path for e in manifest)
    raise DataError(f"{rel_path}: not a file this project knows; known files: {known}")


def sha256_file(path: Path, progress: bool = False) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (with a progress bar in bytes if asked)."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as handle, tqdm(total=Path(path).stat().st_size, unit="B", unit_scale=True,
                                          desc=Path(path).name, disable=not progress, leave=False) as bar:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def data_dir_from_env() -> Path:
    """REPRO_DATA_DIR, or ./data."""
    return Path(os.environ.get("REPRO_DATA_DIR") or DEFAULT_DATA_DIR)


def mirror_from_env() -> Path | None:
    """REPRO_DATA_MIRROR, or None (download)."""
    value = os.environ.get("REPRO_DATA_MIRROR")
    return Path(value) if value else None


def _check(path: Path, entry: DataFile, fix: str, label: str | None = None) -> None:
    label = label or str(path)
    if not path.is_file():
        raise DataError(f"{label}: missing. Fix: {fix}")
    actual = sha256_file(path)
    if actual != entry.sha256:
        size = path.stat().st_size
        raise DataError(f"{label}: sha256 {actual} ({size} bytes) is not the expected "
                        f"{entry.sha256}: the file is wrong or truncated and will not be used. "
                        f"Fix: {fix}")


def data_path(data_dir: Path | str, rel_path: str, verify: bool = True) -> Path:
    """The path of a manifest file in the data dir, checked to exist and (if verify) by sha256."""
    entry = manifest_entry(rel_path)
    path = Path(data_dir) / rel_path
    fix = (f"run `repro data fetch --data-dir {data_dir}` (it replaces a bad copy; set "
           "REPRO_DATA_MIRROR to a mirror directory when offline)")
    if verify:
        _check(path, entry, fix)
    elif not path.is_file():
        raise DataError(f"{path}: missing. Fix: {fix}")
    return path


def _lambada_context_continuation(raw: bytes) -> bytes:
    """OpenAI's {"text"} lines -> {"context", "continuation"}, split at the last space."""
    out = []
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            context, continuation = json.loads(line)["text"].rsplit(" ", 1)
            record = {"context": context, "continuation": continuation}
            out.append(json.dumps(record, ensure_ascii=False) + "\n")
    return "".join(out).encode("utf-8")


_CONVERTERS = {"lambada_context_continuation": _lambada_context_continuation}


def _download(entry: DataFile, tmp: Path, timeout_s: float) -> None:
    try:
        with urllib.request.urlopen(entry.url, timeout=timeout_s) as response:
            payload = response.read()
    except OSError as err:
        raise DataError(f"{entry.path}: download from {entry.url} failed ({err}). Fix: check the "
                        "network, or set REPRO_DATA_MIRROR to a directory holding the files") from err
    if entry.zip_member:
        tmp.write_bytes(payload)
        with zipfile.ZipFile(tmp) as archive:
            payload = archive.read(entry.zip_member)
    if entry.convert:
        payload = _CONVERTERS[entry.convert](payload)
    tmp.write_bytes(payload)


def _fetch_one(entry: DataFile, opts: FetchOptions) -> str:
    from repro.provenance import chmod_as_created

    dest = opts.data_dir / entry.path
    if dest.is_file() and sha256_file(dest) == entry.sha256:
        return "present"
    replaced = dest.exists()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        if opts.mirror is not None:
            source = opts.mirror / entry.path
            _check(source, entry, f"repair the mirror {opts.mirror}, or unset REPRO_DATA_MIRROR "
                                  "to download from the public source")
            shutil.copyfile(source, tmp)
        else:
            _download(entry, tmp, opts.timeout_s)
        source = opts.mirror / entry.path if opts.mirror else entry.url
        _check(tmp, entry, "get a good copy and point REPRO_DATA_MIRROR at its directory",
               label=f"{dest} (fetched from {source})")
        chmod_as_created(tmp)  # not mkstemp's 0600: other users' jobs read a shared data directory
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return "replaced a bad copy" if replaced else ("copied" if opts.mirror else "downloaded")


def _check_data_dir(data_dir: Path) -> None:
    """A DataError when the data dir is, or is under, a file (a NotADirectoryError traceback before)."""
    from repro.provenance import file_in_the_way

    existing = file_in_the_way(data_dir)
    if existing is not None:
        raise DataError(f"data dir {data_dir} (--data-dir, else REPRO_DATA_DIR): {existing} is not a directory "
                        "(the files go into wikitext/, lambada/ and vocab/ under it). Fix: give a directory path, "
                        "e.g. --data-dir data, or set REPRO_DATA_DIR to one")


def _check_destinations(data_dir: Path, entries: list[DataFile]) -> None:
    """A DataError, before any file is fetched, for a destination taken by a directory (or under a file)."""
    from repro.provenance import file_in_the_way

    for entry in entries:
        dest = data_dir / entry.path
        if dest.is_dir():
            raise DataError(f"{dest} is a directory where the file {entry.path} goes; nothing was fetched. Fix: "
                            f"remove it (`rmdir {dest}` if empty) and fetch again")
        if (blocked := file_in_the_way(dest.parent)) is not None:
            raise DataError(f"{blocked} is a file where the directory of {entry.path} goes; nothing was fetched. "
                            f"Fix: remove or move it and fetch again")


def fetch(opts: FetchOptions) -> dict[str, str]:
    """Fetch the manifest's files into opts.data_dir; returns {relative path: what was done}."""
    if opts.mirror is not None and not opts.mirror.is_dir():
        what = "mirror is a file, not a directory" if opts.mirror.exists() else "mirror directory does not exist"
        raise DataError(f"{opts.mirror}: the {what}. Fix: set "
                        "REPRO_DATA_MIRROR (or --mirror) to the folder holding wikitext/, "
                        "lambada/ and vocab/, or unset it to download")
    _check_data_dir(opts.data_dir)
    entries = [manifest_entry(p, opts.manifest) for p in opts.only] or list(opts.manifest)
    _check_destinations(opts.data_dir, entries)
    return {entry.path: _fetch_one(entry, opts) for entry in entries}

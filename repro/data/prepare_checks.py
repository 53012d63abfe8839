"""What `repro data prepare` checks before any work: the --split weights, order and seed, the input
files (found, readable, their format decided) and the output prefix (free, writable), each failure a
DataError that names the fix."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import socket
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from repro.data.documents import JSON_SUFFIXES, TEXT_SUFFIXES, check_gzip, detect_format, is_gzip, read_documents
from repro.data.errors import DataError
from repro.run_lock import held

if TYPE_CHECKING:
    from repro.data.preprocess import PrepareOptions

SPLIT_NAMES = ("train", "valid", "test")
SPLIT_ORDERS = ("file", "random")
CORPUS_SUFFIXES = JSON_SUFFIXES + TEXT_SUFFIXES  # also with .gz


def parse_split(split: str) -> tuple[float, float, float]:
    """'949,50,1' -> (949.0, 50.0, 1.0): train, valid, test weights."""
    try:
        weights = tuple(float(x) for x in split.split(","))
    except ValueError:
        weights = ()
    if (len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or not 0 < sum(weights) < math.inf):
        raise DataError(f"split {split!r} is not three finite non-negative weights with a positive, finite "
                        "sum. Fix: e.g. --split 949,50,1 (train,valid,test)")
    return weights


def check_split(opts: PrepareOptions) -> tuple[float, float, float]:
    """The --split weights, once --split-order and --split-seed are known good too: a DataError now,
    not after the whole corpus is tokenized."""
    weights = parse_split(opts.split)
    if opts.split_order not in SPLIT_ORDERS:
        raise DataError(f"--split-order {opts.split_order!r} is unknown. Fix: choose {' or '.join(SPLIT_ORDERS)}")
    if not isinstance(opts.split_seed, numbers.Integral) or opts.split_seed < 0:
        raise DataError(f"--split-seed {opts.split_seed!r} is not a non-negative integer (the seed of "
                        "--split-order random). Fix: a seed of 0 or more, e.g. 1234 (the default)")
    return weights


def is_output_prefix(prefix: str | Path) -> bool:
    """True when `prepare` wrote a dataset at PREFIX (its PREFIX_prepare.json is there)."""
    return Path(f"{prefix}_prepare.json").exists()


def base_prefix(prefix: str | Path) -> str:
    """prepare's --output-prefix, given it or one of its PREFIX_train/_valid/_test: PREFIX itself when
    it is one (a dataset prepared as data/wiki_test), else PREFIX less one split suffix."""
    base = str(prefix)
    if is_output_prefix(base):
        return base
    name = next((n for n in SPLIT_NAMES if base.endswith(f"_{n}")), None)
    return base.removesuffix(f"_{name}") if name else base


def output_files(prefix: str) -> list[Path]:
    """Every file `prepare` writes for PREFIX."""
    return [Path(f"{prefix}_{n}{x}") for n in SPLIT_NAMES for x in (".bin", ".idx")] + [Path(f"{prefix}_prepare.json")]


def _is_corpus_file(path: Path) -> bool:
    name = path.name.removesuffix(".gz")
    return Path(name).suffix in CORPUS_SUFFIXES and not name.endswith("_prepare.json")


def _directory_files(directory: Path) -> list[Path]:
    """The corpus files under a directory, recursively, sorted by path; others are named in a warning."""
    found = sorted(p for p in directory.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    kept = [p for p in found if _is_corpus_file(p)]
    if len(kept) < len(found):
        other = [p.name for p in found if not _is_corpus_file(p)]
        warnings.warn(f"--input {directory}: {len(other)} files are not read, e.g. {', '.join(other[:3])} "
                      f"(a directory contributes its {', '.join(CORPUS_SUFFIXES)} files and their .gz; "
                      "name other files explicitly)", stacklevel=4)
    if not kept:
        raise DataError(f"--input {directory} is a directory without corpus files ({', '.join(CORPUS_SUFFIXES)} "
                        "or their .gz). Fix: give the directory that holds the corpus, or the files themselves")
    return kept


def input_files(inputs: Path | str | Iterable[Path | str]) -> list[Path]:
    """The files to read, in order: each given file, and each directory's corpus files (recursively,
    sorted). An empty directory or a file given twice is a DataError."""
    items = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    files = [f for item in map(Path, items) for f in (_directory_files(item) if item.is_dir() else [item])]
    if not files:
        raise DataError("no --input given. Fix: give one or more JSON-lines or text files")
    seen: dict[Path, Path] = {}
    for path in files:
        if path.resolve() in seen:
            raise DataError(f"--input names {path} twice ({seen[path.resolve()]}): every document would be "
                            "a near-duplicate of itself. Fix: give each file once")
        seen[path.resolve()] = path
    return files


def describe_inputs(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{len(files)} input files ({files[0]}, ...)"


def check_inputs(opts: PrepareOptions, files: list[Path]) -> list[str]:
    """Every input file exists, is text (a gzip one decompresses whole), and its format (returned,
    'jsonl' or 'text' each) is decided and holds for its first document, before any work starts."""
    formats = []
    for path in tqdm(files, desc="check inputs", unit="file", disable=not opts.progress or len(files) < 2):
        bad = [] if opts.skip_bad_records else None
        with contextlib.closing(read_documents(path, opts.input_format, opts.json_key, opts.layout, bad)) as docs:
            next(docs, None)  # its first document: text read as JSON lines fails now, not hours into the run
        formats.append(detect_format(path, opts.input_format, opts.json_key, opts.layout))
        if is_gzip(path):
            check_gzip(path)  # a cut-short download found now, not hours into the run
    if len(files) > 1 and opts.split_order == "file" and parse_split(opts.split)[1:] != (0, 0):
        warnings.warn(f"{len(files)} input files with --split-order file: valid and test are the last "
                      f"documents read, so come from {files[-1].name} (and the files just before it) alone. "
                      "--split-order random draws them from every file", stacklevel=3)
    return formats


def output_prefix_locked(prefix: str):
    """Hold PREFIX.lock (repro.run_lock) while inside: a DataError at once, naming the holder, when
    another prepare of PREFIX holds it. Waiting instead would only end in check_outputs' refusal or,
    with --overwrite, in replacing a dataset just written: a second prepare of one prefix is a mistake."""
    path = Path(f"{prefix}.lock")
    return held(path, refusal=lambda holder: DataError(
        f"--output-prefix {prefix}: another `repro data prepare` is writing this dataset ({holder}; lock file "
        f"{path}). Fix: wait for it to end (then --overwrite replaces its dataset), or choose another --output-prefix"))


def temporary_tag() -> str:
    """What makes this process's temporary names unique: host and pid (jobs on two nodes may share a pid)."""
    return f"{socket.gethostname().replace(os.sep, '-')}-{os.getpid()}"


def warn_stale_temporaries(prefix: str) -> None:
    """A prepare killed outright (OOM, SIGKILL) leaves its temporary files; say so, with their size.
    Call it holding PREFIX.lock: no other prepare of PREFIX is running then."""
    path = Path(prefix)
    stale = sorted({*path.parent.glob(f"{path.name}.unsplit-tmp*"), *path.parent.glob(f"{path.name}.tmp*")})
    if stale:
        size = sum(p.stat().st_size for p in stale if p.is_file())
        warnings.warn(f"{len(stale)} temporary files of an earlier `prepare` of {prefix} ({size / 2**30:.1f} GiB, e.g. "
                      f"{stale[0].name}) are still there (no prepare of this prefix is running: this one holds "
                      f"{prefix}.lock); remove them: rm {prefix}.unsplit-tmp* {prefix}.tmp*", stacklevel=3)


def check_outputs(opts: PrepareOptions) -> None:
    """The output prefix names files, and no dataset is there unless --overwrite; --workers is positive."""
    if opts.workers < 1:
        raise DataError(f"--workers {opts.workers}: give a positive number of tokenizing processes (1: in this "
                        "one). Fix: e.g. --workers 8, or leave it out for one per available CPU")
    prefix = str(opts.output_prefix)
    if prefix.endswith(os.sep):  # (it wrote DIR/_train.bin, DIR/_prepare.json, ...)
        name = Path(prefix) / "corpus"
        raise DataError(f"--output-prefix {prefix} names a directory, and a prefix names files ({name}_train.bin, "
                        f"..., {name}_prepare.json for --output-prefix {name}). Fix: --output-prefix {name}")
    existing = [str(p) for p in output_files(opts.output_prefix) if p.exists()]
    if existing and not opts.overwrite:
        raise DataError(f"--output-prefix {opts.output_prefix}: a dataset is already there "
                        f"({', '.join(existing)}). Fix: choose another --output-prefix, or pass "
                        "--overwrite to replace it")


def _unwritable(prefix: str, where: Path, why: str) -> DataError:
    return DataError(f"--output-prefix {prefix}: cannot write there: {where} {why}. Fix: choose an "
                     "--output-prefix in a directory you can write (e.g. data/corpus), or make that one writable")


def check_output_dir(prefix: str) -> None:
    """The directory of PREFIX can be written, or created in its nearest existing ancestor: a
    DataError before the tokenizer loads, with nothing written (the probe is an unnamed file)."""
    ancestor = Path(prefix).absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _unwritable(prefix, ancestor, "is not a directory")
    try:
        tempfile.TemporaryFile(dir=ancestor).close()
    except OSError as err:
        raise _unwritable(prefix, ancestor, f"refuses a new file ({err.strerror or err})") from None


def make_output_dir(prefix: str) -> None:
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(prefix, Path(prefix).parent, f"cannot be created ({err.strerror or err})") from None

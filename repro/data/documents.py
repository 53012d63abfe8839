"""Input documents for `repro data prepare`: loose JSON lines or plain text, and a sentence splitter.

What a document is:
- JSON lines: one document per line, its text under `json_key` ("text"). Which files are JSON lines
  (`detect_format`): those of --format jsonl, else `.json`/`.jsonl` ones; `.txt`, `.text`,
  `.tokens`, `.raw` and every file of layout `file` are plain text whatever their first line; any
  other file is JSON lines when its first line is a JSON object with `json_key`, and an error when
  that line starts with "{" without being one (so a web page that starts with JSON-LD is not
  read as JSON lines, and a JSON-lines file with another key is not read as text).
- Plain text in WikiText layout (a line " = Title = " with single "=" marks a level-1 heading):
  each article, from its heading to the next one, is a document (sub-headings " = = ... = = " stay
  inside). Its text is the article's lines exactly as in the file, heading included. A heading
  must be followed by a blank line: two formula lines inside "Constant k filter" look like
  headings but are not (the WikiText test file then has its 60 articles, not 62).
- Other plain text: paragraphs separated by blank lines are documents.
- Layout `file`: the whole file is one document (an extracted OpenWebText page per .txt file).
- Layout `endoftext`: documents end at each "<|endoftext|>", GPT-2's separator in plain-text corpora
  (TinyStories' .txt, text dumps of GPT-2's data); the marker and the line break right after it are
  not text, blank lines inside a document are. `auto` picks it when one of the file's first 200 lines
  is the marker alone, else `wikitext` when they hold a WikiText heading, else `paragraph`; in those,
  and in JSON lines, a spelled-out marker is text (a web page about language models).
A gzip file (known by its first bytes, whatever its name) is read as the text it holds
(`corpus.jsonl.gz` is JSON lines). Other binary files (xz, zstd, bz2, tar) are refused by name.
Whitespace-only documents are skipped. A UTF-8 byte-order mark that starts a file is dropped (before
the format is decided). Bytes that are not UTF-8 read as U+FFFD, and so do the lone
surrogates a JSON escape can hold (web crawls have both): one bad byte never stops a long run. A
record that holds no text (malformed JSON, no `json_key`, a non-string value) is an error naming
its line, or, with `bad_records` (a list), is skipped and noted there.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import itertools
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from repro.data.errors import DataError

_WIKITEXT_TITLE = re.compile(r"^ = (?!=).*(?<!=) = $")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
FORMATS = ("auto", "jsonl", "text")
LAYOUTS = ("auto", "wikitext", "paragraph", "file", "endoftext")
ENDOFTEXT = "<|endoftext|>"  # the document separator of GPT-2-style plain-text corpora
GZIP_MAGIC = b"\x1f\x8b"
BOM = "\ufeff"  # UTF-8 byte-order mark, dropped from the start of a file
JSON_SUFFIXES = (".jsonl", ".json")  # also with .gz
TEXT_SUFFIXES = (".txt", ".text", ".tokens", ".raw")


def is_wikitext_title(line: str) -> bool:
    """True for a WikiText level-1 heading line such as ' = Valkyria Chronicles III = '."""
    return bool(_WIKITEXT_TITLE.match(line.rstrip("\n")))


def split_sentences(text: str) -> list[str]:
    """Sentences of a text: lines split after . ! ? followed by space and a capital or digit."""
    out = []
    for line in text.splitlines():
        out.extend(s.strip() for s in _SENTENCE_END.split(line.strip()) if s.strip())
    return out


def _check_readable(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"{path}: input file is missing. Fix: give an existing file with --input")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: input file is empty. Fix: give a file with at least one "
                        "document (JSON lines with a 'text' key, or plain text)")


def _valid_utf8(text: str) -> str:
    """`text` with lone surrogates (from JSON escapes such as \\ud800) replaced by U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:  # through UTF-16: a lone surrogate becomes one U+FFFD
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _record_text(line: str, key: str) -> str:
    """The text of one JSON line; ValueError says why there is none."""
    try:
        text = json.loads(line)[key]
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"not a JSON object with a {key!r} key") from None
    if not isinstance(text, str):
        raise ValueError(f"its {key!r} is {json.dumps(text)[:40]}, not a string")
    return _valid_utf8(text)


def is_gzip(path: Path) -> bool:
    """A gzip-compressed file (by its first two bytes, so also a symlink or a name without .gz)."""
    with open(path, "rb") as handle:
        return handle.read(2) == GZIP_MAGIC


def _gzip_error(path: Path, err: Exception) -> DataError:
    return DataError(f"{path}: the gzip stream is damaged or cut short ({err}). Fix: download or "
                     "compress the file again (`gzip -t FILE` checks it)")


def check_gzip(path: Path) -> None:
    """Decompress a gzip file to nowhere: a damaged or cut-short one is a DataError now, not when a
    long run reaches it."""
    try:
        with gzip.open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise _gzip_error(path, err) from None


def _check_text(path: Path) -> None:
    """Refuse UTF-16 text (its byte-order mark) and a binary file (a NUL byte in its first 4 KiB, after
    gzip decompression)."""
    try:
        with (gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")) as handle:
            head = handle.read(4096)
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise _gzip_error(path, err) from None
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(f"{path}: UTF-16 (or UTF-32) text, its byte-order mark says; UTF-8 is read. Fix: convert "
                        "it, e.g. `iconv -f UTF-16 -t UTF-8 IN > OUT` (`zcat IN | iconv ...` for a .gz)")
    if b"\0" in head:
        raise DataError(f"{path}: not text (a binary file: xz, zstd, bz2, tar or another format?). Fix: "
                        "decompress or extract it first; plain text, JSON lines and their gzip are read")


def _lines(path: Path, on_bytes: Callable[[int], None] | None) -> Iterator[str]:
    """The file's lines as text mode gives them (universal newlines; bytes that are not UTF-8 as
    U+FFFD; a leading byte-order mark dropped, as "utf-8-sig" does), telling `on_bytes` how many
    bytes of the file on disk each took (progress through a large input; compressed bytes for a
    `.gz`). A damaged or truncated `.gz` is a DataError."""
    compressed = is_gzip(path)
    with open(path, "rb") as raw:
        handle = gzip.GzipFile(fileobj=raw) if compressed else raw
        seen = 0
        try:
            for number, line in enumerate(handle):
                if on_bytes is not None:
                    position = raw.tell() if compressed else seen + len(line)
                    on_bytes(position - seen)
                    seen = position
                text = line.decode("utf-8", errors="replace")
                if number == 0:  # Windows tools and pandas' to_json(encoding="utf-8-sig") write a BOM
                    text = text.removeprefix(BOM)
                if "\r" in text:  # \r\n, or a lone \r that text mode also ends a line at
                    yield from io.StringIO(text, newline=None)
                else:
                    yield text
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise _gzip_error(path, err) from None
        if on_bytes is not None and raw.tell() > seen:  # a gzip trailer read after the last line
            on_bytes(raw.tell() - seen)


def _jsonl_documents(path: Path, key: str, bad_records: list[str] | None,
                     on_bytes: Callable[[int], None] | None) -> Iterator[str]:
    for number, line in enumerate(_lines(path, on_bytes), 1):
        if not line.strip():
            continue
        try:
            text = _record_text(line, key)
        except ValueError as err:
            if bad_records is None:
                raise DataError(f"{path}:{number}: {err}. Fix: one JSON object per line with a string "
                                "under --json-key, or pass --skip-bad-records to skip such lines") from None
            bad_records.append(f"{path}:{number}: {err}")
            continue
        if text.strip():
            yield text


def _wikitext_documents(lines: Iterator[str]) -> Iterator[str]:
    current: list[str] = []
    for line, following in itertools.pairwise(itertools.chain(lines, [None])):
        starts_article = is_wikitext_title(line) and (following is None or not following.strip())
        if starts_article and current:
            yield "".join(current)
            current = []
        current.append(line)
    if current:
        yield "".join(current)


def _paragraph_documents(lines: Iterator[str]) -> Iterator[str]:
    current: list[str] = []
    for line in itertools.chain(lines, [""]):
        if line.strip():
            current.append(line)
        elif current:
            yield "".join(current)
            current = []


def _endoftext_documents(lines: Iterator[str]) -> Iterator[str]:
    current: list[str] = []
    for line in lines:
        first, *after_markers = line.split(ENDOFTEXT)
        current.append(first)
        for piece in after_markers:  # a marker ends the document; the line break after it is not text
            yield "".join(current)
            current = [piece.removeprefix("\n")]
    yield "".join(current)


def _detected_layout(head: list[str]) -> str:
    """The layout `auto` means for a file beginning with the lines `head`: endoftext when a line holds the
    marker alone (a text that only mentions it keeps its paragraphs)."""
    if any(line.strip() == ENDOFTEXT for line in head):
        return "endoftext"
    return "wikitext" if any(is_wikitext_title(line) for line in head) else "paragraph"


SPLITTERS = {"wikitext": _wikitext_documents, "paragraph": _paragraph_documents, "endoftext": _endoftext_documents}


def _text_documents(path: Path, layout: str, on_bytes: Callable[[int], None] | None) -> Iterator[str]:
    handle = _lines(path, on_bytes)
    head = list(itertools.islice(handle, 200))
    if layout == "auto":
        layout = _detected_layout(head)
    lines = itertools.chain(head, handle)
    if layout == "file":
        text = "".join(lines)
        yield from [text] if text.strip() else []
        return
    yield from (doc for doc in SPLITTERS[layout](lines) if doc.strip())


def _first_line(path: Path) -> tuple[int, str]:
    """The number and text of the first non-blank line ((0, "") for none)."""
    with contextlib.closing(_lines(path, None)) as lines:
        return next(((n, line) for n, line in enumerate(lines, 1) if line.strip()), (0, ""))


def _is_record(line: str, key: str) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and key in record


def detect_format(path: Path, input_format: str = "auto", json_key: str = "text", layout: str = "auto") -> str:
    """'jsonl' or 'text' for one input file, by the rules of the module docstring."""
    if input_format != "auto":
        return input_format
    suffix = Path(path.name.removesuffix(".gz")).suffix
    if suffix in JSON_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES or layout == "file":
        return "text"
    number, first = _first_line(path)
    if not first.lstrip().startswith("{"):
        return "text"
    if not _is_record(first, json_key):
        raise DataError(f"{path}:{number}: starts with \"{{\" but is not a JSON object with a {json_key!r} key, "
                        "so neither clearly JSON lines nor plain text. Fix: --format text (or a .txt name) for "
                        "plain text; --json-key KEY or --format jsonl for JSON lines")
    return "jsonl"


def read_documents(path: Path | str, input_format: str = "auto", json_key: str = "text",
                   layout: str = "auto", bad_records: list[str] | None = None,
                   on_bytes: Callable[[int], None] | None = None) -> Iterator[str]:
    """The documents of an input file, in file order (see the module docstring for the rules);
    with `bad_records`, JSON lines without text are skipped and described there; `on_bytes` hears
    how many bytes of the file each line took."""
    path = Path(path)
    if input_format not in FORMATS or layout not in LAYOUTS:
        raise DataError(f"{path}: format {input_format!r} / layout {layout!r} unknown. Fix: use "
                        f"a format from {FORMATS} and a layout from {LAYOUTS}")
    _check_readable(path)
    _check_text(path)
    if detect_format(path, input_format, json_key, layout) == "jsonl":
        return _jsonl_documents(path, json_key, bad_records, on_bytes)
    return _text_documents(path, layout, on_bytes)

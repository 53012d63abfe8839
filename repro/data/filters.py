"""The paper's corpus filters: minimum length, near-duplicate removal (MinHash LSH), eval overlap.

Text is compared as lower-cased Unicode words (`words`): runs of letters and digits of any script,
and each character of a script written without spaces (Chinese, Japanese, Thai) on its own. So
WikiText's tokenized form ("1 @,@ 000 , said") and raw text ("1,000, said") give the same words and
the same n-grams, English gives the ASCII words it always did, and Russian or Chinese text is
compared by its own words, not by the few Latin ones it holds.

- Near-duplicates: a MinHash signature of each document's word 5-gram shingles; LSH finds
  candidates among the documents kept so far, and a document whose estimated Jaccard similarity with
  a candidate exceeds the threshold (0.7 in the paper) is dropped: the first of a cluster is kept.
  The LSH bands favour recall (`LSH_WEIGHTS`): every candidate is checked, so a false candidate costs
  one signature comparison, while a pair the bands miss is a duplicate kept. datasketch's default
  (equal weights: 14 bands of 9 rows) makes a pair at Jaccard 0.75 a candidate with probability
  1 - (1 - 0.75^9)^14 = 67%; 21 bands of 6 rows, 98% (tests/test_data_prepare.py measures 71% and 99%
  of the pairs the Jaccard check passes; Megatron-LM's own dedup script used 20 bands of 5 of 100).
  A document with fewer words than a shingle (symbols, a table of numbers: rare past min_tokens)
  has no shingle and is never a near-duplicate: it is kept, and nothing is compared with it.
- Eval overlap: a document that shares at least `min_matches` distinct word 8-grams with an evaluation set
  (WikiText test, LAMBADA test) is dropped. The paper removed the WikiText-103 test articles from its
  Wikipedia; LAMBADA is this project's addition (its passages come from books, which the corpus has
  too), and `eval_files` with WikiText alone (`--eval-sets wikitext`) is the paper's rule.
  The default is 10, not 1: with 1, 5 of the 60 WikiText-2 validation articles went for one or
  three stock phrases ("by the recording industry association of america riaa"), while a copied
  test article shares thousands of 8-grams and a copied LAMBADA passage about 70.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasketch import MinHash, MinHashLSH

from repro.data.fetch import data_path

# (false positive, false negative) weights for choosing the LSH bands: misses weigh 19x more, since
# every candidate is verified by its estimated Jaccard anyway (threshold 0.7, 128 hashes: 21 x 6).
LSH_WEIGHTS = (0.05, 0.95)

_NO_SPACES = "\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # Thai, kana, Han
_WORD = re.compile(rf"[{_NO_SPACES}]|[^\W_{_NO_SPACES}]+")  # one character each, or a run of letters/digits
_PRIME = np.uint64(1099511628211)  # FNV-64 prime, a good odd multiplier for the rolling hash
NO_SHINGLES = 2**32 - 1  # every min-hash of an empty shingle set (affine32)
EVAL_SETS = {"wikitext": "wikitext/wiki.test.raw", "lambada": "lambada/lambada_openai.test.jsonl"}
EVAL_FILES = tuple(EVAL_SETS.values())  # the default: the paper's WikiText-103 test, and LAMBADA's


@dataclass(frozen=True)
class FilterOptions:
    """Which filters `repro data prepare` applies and with what settings."""

    min_tokens: int = 128  # drop documents with fewer tokens (end-of-document token not counted)
    dedup: bool = True  # MinHash LSH near-duplicate removal
    dedup_threshold: float = 0.7  # Jaccard similarity above which a document is a duplicate
    num_perm: int = 128  # MinHash permutations
    shingle_words: int = 5  # words per shingle for MinHash
    eval_overlap: bool = True  # drop documents overlapping the evaluation sets
    eval_files: tuple[str, ...] = EVAL_FILES  # manifest paths of the evaluation sets
    ngram: int = 8  # n of the overlap n-grams
    min_matches: int = 10  # shared n-grams that make a document overlap (see the module docstring)


def words(text: str) -> list[str]:
    """Lower-cased Unicode words of a text (see the module docstring); ASCII text gives its
    [a-z0-9]+ runs."""
    return _WORD.findall(text.lower())


def _word_hashes(tokens: list[str]) -> np.ndarray:
    table: dict[str, int] = {}
    out = np.empty(len(tokens), dtype=np.uint64)
    for i, word in enumerate(tokens):
        value = table.get(word)
        if value is None:
            digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
            value = table[word] = int.from_bytes(digest, "little")
        out[i] = value
    return out


def ngram_hashes(tokens: list[str], n: int) -> np.ndarray:
    """A stable 64-bit hash of every n-word window (empty when there are fewer than n words)."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    hashed = _word_hashes(tokens)
    out = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            out = out * _PRIME + hashed[k:k + count]
    return out


def eval_texts(data_dir: Path | str, rel_path: str) -> list[str]:
    """The texts of one evaluation file (LAMBADA: context + ' ' + continuation per passage)."""
    path = data_path(data_dir, rel_path)
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        return [r["context"] + " " + r["continuation"] for r in records]
    return [raw]


def eval_ngram_set(data_dir: Path | str, files: tuple[str, ...], n: int) -> np.ndarray:
    """Sorted unique n-gram hashes of the evaluation files (checked by sha256)."""
    parts = [ngram_hashes(words(t), n) for f in files for t in eval_texts(data_dir, f)]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


def count_overlap(hashes: np.ndarray, eval_set: np.ndarray) -> int:
    """How many distinct n-grams of these hashes occur in the sorted eval set: a stock phrase a list
    page repeats three times is one shared n-gram of each of its words' windows, not three."""
    if len(hashes) == 0 or len(eval_set) == 0:
        return 0
    hashes = np.unique(hashes)
    pos = np.minimum(np.searchsorted(eval_set, hashes), len(eval_set) - 1)
    return int(np.count_nonzero(eval_set[pos] == hashes))


class MinHasher:
    """MinHash signatures of word shingles, with the permutations drawn once."""

    def __init__(self, num_perm: int = 128, shingle_words: int = 5, seed: int = 1) -> None:
        self.num_perm = num_perm
        self.shingle_words = shingle_words
        self._template = MinHash(num_perm=num_perm, seed=seed, scheme="affine32")

    def signature(self, tokens: list[str]) -> np.ndarray:
        """uint signature of the document's word shingles; fewer words than a shingle give the
        empty signature (`NO_SHINGLES`), never a near-duplicate of anything."""
        shingles = ngram_hashes(tokens, self.shingle_words)
        minhash = MinHash(num_perm=self.num_perm, hashfunc=int, scheme="affine32",
                          permutations=self._template.permutations)
        minhash.update_batch((shingles >> np.uint64(32)).tolist())
        return minhash.hashvalues.copy()


class NearDuplicateFilter:
    """Keeps the first document of each near-duplicate cluster (MinHash LSH, then Jaccard check).

    LSH banding with datasketch's optimal (bands, rows) for the threshold and `LSH_WEIGHTS`; each
    band is one dict from the hash of a kept document's band to its row (a list when several share
    it), and the kept signatures are rows of one growing uint32 array: about a third of the memory
    datasketch's MinHashLSH holds (a set and bytes objects per band; results/bench/data_preprocess.md).
    """

    def __init__(self, threshold: float = 0.7, num_perm: int = 128) -> None:
        self.threshold = threshold
        self.num_perm = num_perm
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)  # (bands, rows) only
        self.bands, self.rows = lsh.b, lsh.r
        self._buckets: list[dict[int, int | list[int]]] = [{} for _ in range(self.bands)]
        self._signatures = np.empty((1024, num_perm), dtype=np.uint32)  # affine32 min-hashes
        self.kept = 0

    def _band_keys(self, signature: np.ndarray) -> list[int]:
        sig = np.ascontiguousarray(signature, dtype=np.uint32)
        return [hash(sig[i * self.rows:(i + 1) * self.rows].tobytes()) for i in range(self.bands)]

    def _candidates(self, keys: list[int]) -> set[int]:
        found: set[int] = set()
        for bucket, key in zip(self._buckets, keys):
            rows = bucket.get(key)
            if rows is not None:
                found.update(rows if isinstance(rows, list) else (rows,))
        return found

    def _remember(self, signature: np.ndarray, keys: list[int]) -> None:
        row = self.kept
        if row == len(self._signatures):  # grow by half: amortised O(1) appends
            grown = np.empty((row + row // 2, self.num_perm), dtype=np.uint32)
            grown[:row] = self._signatures
            self._signatures = grown
        self._signatures[row] = signature
        self.kept += 1
        for bucket, key in zip(self._buckets, keys):
            rows = bucket.get(key)
            if rows is None:
                bucket[key] = row
            elif isinstance(rows, list):
                rows.append(row)
            else:
                bucket[key] = [rows, row]

    def is_duplicate(self, key: int, signature: np.ndarray) -> bool:
        """True if it duplicates a kept document; otherwise remember it as kept and return False.
        The empty signature (no shingles) is never a duplicate and is not remembered.
        (`key` names the document in the caller's count; the filter keeps rows of its own.)"""
        if signature.max(initial=0) >= 2**32:
            raise ValueError("signatures must be affine32 min-hashes (MinHasher): values below 2^32")
        if np.all(signature == NO_SHINGLES):  # nothing to compare (it equals every other such signature)
            return False
        keys = self._band_keys(signature)
        sig = signature.astype(np.uint32)
        for row in self._candidates(keys):  # estimated Jaccard: the share of equal min-hashes
            if np.count_nonzero(self._signatures[row] == sig) / self.num_perm > self.threshold:
                return True
        self._remember(sig, keys)
        return False

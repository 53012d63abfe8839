"""BERT samples: sentence pairs with sentence-order prediction and whole-word n-gram masking.

A sample is a run of >= 2 consecutive sentences of one document, packed greedily from the
document's first sentence and grown until it reaches its target length: max_seq_length - 3, or
w.p. short_seq_prob (for every sample, a document's first too) a uniform length in
[2, max_seq_length - 3], drawn from a hash of (seed, first sentence) so the map is a pure function
of data and options. A sample that would leave one sentence of its document behind takes it too
(Megatron-LM's rule: no sentence is dropped). The sample map (numpy, vectorized over documents) is
built once and cached beside the data. Drawing sample i at epoch e (its own seeded RNG, so the
masks change each epoch): split the run at a random sentence into A and B, swap them w.p. 0.5
(sop_label 1 = swapped), trim the longer segment until both fit, and lay out
`[CLS] A [SEP] B [SEP]` with token types 0 / 1. Then mask 15% of the non-special tokens in whole
words (WordPiece '##' pieces stay with their word), in spans of 1-3 words (probability
proportional to 1/n, as the paper's whole-word n-gram masking); each chosen token becomes [MASK]
w.p. 0.8, a random token w.p. 0.1, and stays unchanged w.p. 0.1.

Output (after `collate_bert`), all LongTensors: tokens [b, s], token_types [b, s], padding_mask
[b, s] (1 = real token, 0 = padding), mlm_labels [b, s] (the original id where a token is to be
predicted, -100 elsewhere: `F.cross_entropy(..., ignore_index=-100)`; the loss mask is
`mlm_labels != -100`), sop_label [b].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from repro.data.errors import DataError
from repro.data.gpt_dataset import _cache_prefix
from repro.data.indexed_dataset import IndexedDataset
from repro.data.sampler import EpochShuffle, ResumableLoader, cached_array
from repro.data.tokenizers import TextTokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class BertOptions:
    """Sample layout and masking; defaults follow the paper and the 2020 Megatron-LM code."""

    max_seq_length: int = 512
    mask_prob: float = 0.15  # share of non-special tokens to predict
    mask_token_prob: float = 0.8  # of those, replaced by [MASK]
    random_token_prob: float = 0.1  # ... by a random token (the rest stay unchanged)
    max_ngram: int = 3  # whole-word spans of 1..max_ngram words
    short_seq_prob: float = 0.1  # a sample targets a random shorter length
    seed: int = 1234


CHUNK_SENTENCES = 1 << 18  # sentences a step of build_sample_map: its 2 MiB cumsum stays in cache
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_target(seed: int, first_sentence: np.ndarray, max_tokens: int,
                  short_seq_prob: float) -> np.ndarray:
    """int64 target length of a sample (not a document's first) starting at each first_sentence.

    Stateless: h = splitmix64(splitmix64(seed) + first * 0x9E3779B97F4A7C15); the sample is short
    when h's top 53 bits / 2**53 < short_seq_prob, then its length is 2 + splitmix64(h) %
    (max_tokens - 1), else max_tokens.
    """
    first = np.atleast_1d(np.asarray(first_sentence, dtype=np.int64)).astype(np.uint64)
    key = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))
    h = _splitmix64(key + first * _GOLDEN)
    short = (h >> np.uint64(11)) * 2.0**-53 < short_seq_prob
    length = 2 + (_splitmix64(h) % np.uint64(max_tokens - 1)).astype(np.int64)
    return np.where(short, length, np.int64(max_tokens))


def build_sample_map(data: IndexedDataset, opts: BertOptions) -> np.ndarray:
    """int64 [n, 3]: first sentence, end sentence (exclusive), target length of each sample, in
    file order. Documents go in chunks of about CHUNK_SENTENCES sentences; the map does not
    depend on the chunk size."""
    max_tokens = opts.max_seq_length - 3
    if max_tokens < 2:
        raise ValueError(f"max_seq_length={opts.max_seq_length} leaves no room for two sentences")
    parts = [_chunk_samples(data, first_doc, end_doc, opts.seed, max_tokens, opts.short_seq_prob)
             for first_doc, end_doc in _document_chunks(data.document_indices)]
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)


def _document_chunks(doc_index: np.ndarray) -> list[tuple[int, int]]:
    """[first, end) document ranges of about CHUNK_SENTENCES sentences (at least one document)."""
    chunks, first, num_documents = [], 0, len(doc_index) - 1
    while first < num_documents:
        limit = int(doc_index[first]) + CHUNK_SENTENCES
        end = max(int(np.searchsorted(doc_index, limit, side="right")) - 1, first + 1)
        chunks.append((first, min(end, num_documents)))
        first = chunks[-1][1]
    return chunks


def _chunk_samples(data: IndexedDataset, first_doc: int, end_doc: int, seed: int,
                   max_tokens: int, short_seq_prob: float) -> np.ndarray:
    """The samples of documents [first_doc, end_doc): each round, every document with >= 2
    sentences left emits one sample, its end found by searchsorted on the chunk's cumsum."""
    bounds = np.asarray(data.document_indices[first_doc:end_doc + 1], dtype=np.int64)
    offset = int(bounds[0])
    lengths = data.sequence_lengths[offset:int(bounds[-1])]
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # cum[i]: tokens before i
    start, stop = bounds[:-1] - offset, bounds[1:] - offset  # local sentence indices
    rounds = []
    while True:
        left = stop - start >= 2
        start, stop = start[left], stop[left]
        if not len(start):
            break
        target = sample_target(seed, start + offset, max_tokens, short_seq_prob)  # a document's first too
        end = np.searchsorted(cum, cum[start] + target)  # first end with enough tokens
        end = np.minimum(np.maximum(end, start + 2), stop)
        end = np.where(stop - end == 1, stop, end)  # a lone last sentence joins this sample
        rounds.append(np.stack([start + offset, end + offset, target], axis=1))
        start = end
    rows = np.concatenate(rounds) if rounds else np.empty((0, 3), dtype=np.int64)
    return rows[np.argsort(rows[:, 0], kind="stable")]


def truncated_lengths(len_a: int, len_b: int, limit: int) -> tuple[int, int]:
    """Lengths after trimming one token at a time from the longer segment (B on a tie, as
    Megatron-LM's truncate_segments and Google BERT's truncate_seq_pair) until
    len_a + len_b <= limit, in closed form."""
    excess = len_a + len_b - limit
    if excess <= 0:
        return len_a, len_b
    gap = min(abs(len_a - len_b), excess)  # first the longer one, down to the other's length
    len_a, len_b = (len_a - gap, len_b) if len_a > len_b else (len_a, len_b - gap)
    rest = excess - gap  # then alternately, B first
    return len_a - rest // 2, len_b - (rest + 1) // 2


def _truncate(a: np.ndarray, b: np.ndarray, limit: int, rng: np.random.Generator):
    """Trim the longer segment token by token until both fit, each token from the front or the back
    with probability 1/2 (as the 2020 Megatron code): the count from the front is Binomial(n, 1/2),
    drawn at once, so a 10k-token web "sentence" costs one draw, not 10k."""
    keep_a, keep_b = truncated_lengths(len(a), len(b), limit)
    front_a, front_b = rng.binomial([len(a) - keep_a, len(b) - keep_b], 0.5)
    return a[front_a:front_a + keep_a], b[front_b:front_b + keep_b]


def _word_spans(tokens: np.ndarray, continuation: np.ndarray, real: np.ndarray) -> list[range]:
    """Position ranges of whole words among the real (non-special) positions."""
    spans: list[range] = []
    for p in np.flatnonzero(real):
        if spans and spans[-1].stop == p and continuation[tokens[p]]:
            spans[-1] = range(spans[-1].start, p + 1)
        else:
            spans.append(range(p, p + 1))
    return spans


def index_stamp(prefix: str | Path) -> str:
    """8 hex digits of the .idx file's size and modification time. The sample map depends on where
    documents start and on every sentence's length, not only on the totals: a re-prepared corpus with
    the same token and sentence counts (the same documents in another order) must not load the old
    map, whose samples would then pair sentences of different documents. Cheap (no pass over a
    billion sentence lengths); a copy that keeps modification times (rsync -a) keeps its cache."""
    import hashlib

    stat = Path(f"{prefix}.idx").stat()
    return hashlib.blake2b(f"{stat.st_size}:{stat.st_mtime_ns}".encode(), digest_size=4).hexdigest()


class BertDataset:
    """Map from a global position (epoch-aware) to one BERT sample (a dict of numpy arrays)."""

    def __init__(self, prefix: str | Path, tokenizer: TextTokenizer,
                 opts: BertOptions = BertOptions(), cache_dir: Path | str | None = None,
                 write_cache: bool = True, vocab_size: int | None = None) -> None:
        if opts.max_seq_length < 8:
            raise ValueError(f"max_seq_length={opts.max_seq_length} is too short; use >= 8")
        from repro.data.verify import check_split_record

        self.data, self.tokenizer, self.opts = IndexedDataset(prefix), tokenizer, opts
        check_split_record(prefix, self.data.num_documents)  # a half-swapped `prepare --overwrite`
        self._check_model_vocabulary(vocab_size)
        self.continuation = tokenizer.continuation_mask()
        special = [tokenizer.special.pad, tokenizer.special.unk, tokenizer.cls, tokenizer.sep,
                   tokenizer.mask]
        self.random_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), special)
        cache = _cache_prefix(str(prefix), cache_dir)
        key = (f"L{opts.max_seq_length}_p{opts.short_seq_prob}_seed{opts.seed}"
               f"_t{self.data.num_tokens}_n{len(self.data)}_i{index_stamp(prefix)}_v3")  # v3: Megatron's sample ends
        path = Path(f"{cache}_bert_map_{key}.npy")
        self.samples = cached_array(path, lambda: build_sample_map(self.data, opts),
                                    lambda a: a.ndim == 2 and a.shape[1] == 3, write_cache)
        if self.data.num_documents == 0:
            raise DataError(f"{prefix}: holds no documents (an empty split). Fix: give this split a "
                            "share in `repro data prepare --split`, or point the config at another "
                            "prefix (data.valid_prefix: '' skips evaluation)")
        if len(self.samples) == 0:
            raise DataError(f"{prefix}: no document has two sentences, so there is no sentence "
                            "pair. Fix: prepare the data with --tokenizer bert (one sentence a "
                            "sequence) from documents of several sentences")
        self.shuffle = EpochShuffle(len(self.samples), opts.seed, f"{cache}_bert_{key}", write_cache)

    def __len__(self) -> int:
        return len(self.samples)

    def at(self, position: int) -> dict[str, np.ndarray]:
        """The sample at a global position (epoch = position // len(self))."""
        epoch, index = self.shuffle.locate(position)
        return self.sample(index, epoch)

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        """Sample `index` as drawn in `epoch` (a dict of numpy arrays, see the module docstring)."""
        rng = np.random.default_rng([self.opts.seed, epoch, index])
        first, end, target = (int(x) for x in self.samples[index])
        cut = int(rng.integers(first + 1, end))
        a = np.concatenate([self.data[j] for j in range(first, cut)])
        b = np.concatenate([self.data[j] for j in range(cut, end)])
        swapped = bool(rng.random() < 0.5)
        if swapped:
            a, b = b, a
        a, b = _truncate(a, b, target, rng)
        tok = self.tokenizer
        tokens = np.concatenate([[tok.cls], a, [tok.sep], b, [tok.sep]]).astype(np.int64)
        self._check_vocabulary(tokens, index)
        types = np.concatenate([np.zeros(len(a) + 2), np.ones(len(b) + 1)]).astype(np.int64)
        real = np.ones(len(tokens), dtype=bool)
        real[[0, len(a) + 1, len(tokens) - 1]] = False
        tokens, labels = self._mask(tokens, real, rng)
        return self._pad(tokens, types, labels, int(swapped))

    def _check_model_vocabulary(self, vocab_size: int | None) -> None:
        """A DataError, before any sample, when the model's vocabulary (model.vocab_size) cannot hold
        the tokenizer's ids: samples and their random replacement tokens use them all. The per-sample
        check (_check_vocabulary) then covers the model too."""
        vocab = self.tokenizer.vocab_size
        if vocab_size is not None and vocab_size < vocab:
            raise DataError(f"{self.data.prefix}: BERT samples use the {vocab:,}-id WordPiece vocabulary, but "
                            f"model.vocab_size={vocab_size}: the model has no embedding for ids {vocab_size:,} and "
                            f"up. Fix: set model.vocab_size: {vocab} (the tokenizer's size)")

    def _check_vocabulary(self, tokens: np.ndarray, index: int) -> None:
        """A DataError when an id of the sample is not in the tokenizer's vocabulary (a corpus prepared
        with another one). Per sample (~3 us of a ~1 ms sample), not a pass over a multi-GB .bin at open."""
        vocab = self.tokenizer.vocab_size
        if tokens.min() >= 0 and tokens.max() < vocab:
            return
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise DataError(f"{self.data.prefix}: sample {index} holds token id {bad}, outside the {vocab:,}-id "
                        f"{self.tokenizer.kind} vocabulary: the corpus was prepared with another vocabulary. Fix: "
                        "prepare it again with `repro data prepare --tokenizer bert` (BERT uncased WordPiece)")

    def _choose(self, spans: list[range], budget: int, rng: np.random.Generator) -> list[int]:
        weights = 1.0 / np.arange(1, self.opts.max_ngram + 1)
        ngram = rng.choice(len(weights), size=len(spans), p=weights / weights.sum()) + 1
        chosen: list[int] = []
        taken = np.zeros(len(spans), dtype=bool)
        for w in rng.permutation(len(spans)):
            n = int(ngram[w])
            while n > 0:
                words = range(w, min(w + n, len(spans)))
                size = sum(len(spans[k]) for k in words)
                if not taken[words.start:words.stop].any() and len(chosen) + size <= budget:
                    taken[words.start:words.stop] = True
                    chosen.extend(p for k in words for p in spans[k])
                    break
                n -= 1
            if len(chosen) >= budget:
                break
        return chosen

    def _mask(self, tokens: np.ndarray, real: np.ndarray, rng: np.random.Generator):
        spans = _word_spans(tokens, self.continuation, real)
        budget = max(1, int(round(real.sum() * self.opts.mask_prob)))
        chosen = np.array(sorted(self._choose(spans, budget, rng)), dtype=np.int64)
        labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
        labels[chosen] = tokens[chosen]
        draw = rng.random(len(chosen))
        to_mask = chosen[draw < self.opts.mask_token_prob]
        high = self.opts.mask_token_prob + self.opts.random_token_prob
        to_random = chosen[(draw >= self.opts.mask_token_prob) & (draw < high)]
        tokens = tokens.copy()
        tokens[to_mask] = self.tokenizer.mask
        tokens[to_random] = rng.choice(self.random_ids, size=len(to_random))
        return tokens, labels

    def _pad(self, tokens, types, labels, sop_label: int) -> dict[str, np.ndarray]:
        pad = self.opts.max_seq_length - len(tokens)
        return {
            "tokens": np.pad(tokens, (0, pad), constant_values=self.tokenizer.pad),
            "token_types": np.pad(types, (0, pad)),
            "padding_mask": np.pad(np.ones(len(tokens), dtype=np.int64), (0, pad)),
            "mlm_labels": np.pad(labels, (0, pad), constant_values=IGNORE_INDEX),
            "sop_label": np.array(sop_label, dtype=np.int64),
        }


def collate_bert(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack sample dicts into LongTensors ([b, s], sop_label [b])."""
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def bert_loader(dataset: BertDataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                consumed_samples: int = 0, total_samples: int | None = None,
                workers: int = 0) -> ResumableLoader:
    """Micro batches of BERT sample dicts for one DP rank, resuming after consumed_samples."""
    return ResumableLoader(dataset.at, collate_bert, micro_batch_size, dp_rank, dp_size,
                           consumed_samples, total_samples, workers)

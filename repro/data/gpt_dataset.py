"""GPT samples: seq_length + 1 contiguous tokens over the concatenated documents.

Each epoch has its own token stream: every document (one sequence each, ending in the
end-of-document token) once, in a seeded order of that epoch, as Megatron-LM shuffles its document
index per epoch; samples cross document boundaries. Sample i of an epoch holds tokens
[i*s, i*s + s + 1) of its stream: inputs are its first s tokens, labels its last s. Each token is
an input of exactly one sample per epoch except the stream's tail (fewer than s + 1 tokens), and a
document sits in other windows, beside other neighbours, each epoch. The order of samples is a new
seeded permutation each epoch, cached beside the data (see repro.data.sampler). Unlike Megatron,
epochs are not chained (the tail is left out, not carried into the next epoch), so every epoch has
(tokens - 1) // s samples. The document order is rebuilt per epoch, not cached: at the paper's ~40M
documents ~0.5 GB per rank (int32 order, int64 ends) and about a second.

    data = GPTDataset("data/corpus_train", seq_length=1024, seed=1234)
    loader = gpt_loader(data, micro_batch_size=8, dp_rank=dp_rank, dp_size=dp_size,
                        consumed_samples=state.consumed_samples)
    for tokens, labels in loader: ...          # LongTensor [8, 1024] each
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from repro.data.errors import DataError
from repro.data.indexed_dataset import IndexedDataset
from repro.data.sampler import EpochShuffle, ResumableLoader


class GPTBatch(NamedTuple):
    """One micro batch: inputs and next-token labels, LongTensor [micro_batch_size, seq_length]."""

    tokens: torch.Tensor
    labels: torch.Tensor


def samples_per_epoch(num_tokens: int, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens, overlapping by one, that num_tokens tokens hold."""
    return (num_tokens - 1) // seq_length if seq_length > 0 and num_tokens > 0 else 0


def _cache_prefix(prefix: str, cache_dir: Path | str | None) -> str:
    """Where the sample caches of `prefix` go: beside it, or in cache_dir (created by the rank that
    writes them, when it writes: see save_npy_atomic)."""
    if cache_dir is None:
        return prefix
    return str(Path(cache_dir) / Path(prefix).name)


class GPTDataset:
    """Map from a global position (epoch-aware) to a sample of seq_length + 1 token ids."""

    def __init__(self, prefix: str | Path, seq_length: int, seed: int = 1234,
                 cache_dir: Path | str | None = None, write_cache: bool = True,
                 vocab_size: int | None = None) -> None:
        from repro.data.verify import check_split_record

        self.data = IndexedDataset(prefix)
        check_split_record(prefix, self.data.num_documents)  # a half-swapped `prepare --overwrite`
        self.vocab_size = vocab_size
        if len(self.data) > self.data.num_documents:  # some document holds several sequences
            raise DataError(f"{prefix}: {len(self.data):,} sequences in {self.data.num_documents:,} documents: "
                            "sentence-split data (`repro data prepare --tokenizer bert`, or Megatron's "
                            "--split-sentences), which GPT would shuffle apart sentence by sentence, with no "
                            "end-of-document tokens. Fix: prepare GPT data with --tokenizer gpt2 (one "
                            "sequence a document) and point the config at it")
        self.seq_length = seq_length
        tokens = self.data.num_tokens
        self.samples_per_epoch = samples_per_epoch(tokens, seq_length)
        if self.samples_per_epoch < 1:
            raise DataError(f"{prefix}.bin: {tokens} tokens cannot fill one sample of "
                            f"seq_length + 1 = {seq_length + 1}. Fix: use a shorter seq_length "
                            "or prepare more data")
        cache = f"{_cache_prefix(str(prefix), cache_dir)}_gpt_s{seq_length}"
        self.shuffle = EpochShuffle(self.samples_per_epoch, seed, cache, write_cache)
        self.seed = seed
        self._stream_epoch, self._order, self._ends = -1, np.zeros(0, np.int32), np.zeros(0, np.int64)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def document_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in epoch's stream order, the stream offset where each ends)."""
        if epoch != self._stream_epoch:
            n = len(self.data)
            order = np.random.default_rng([self.seed, epoch, 1]).permutation(n)
            self._order = order.astype(np.int32 if n < 2**31 else np.int64)
            self._ends = np.cumsum(self.data.sequence_lengths[self._order], dtype=np.int64)
            self._stream_epoch = epoch
        return self._order, self._ends

    def sample(self, index: int, epoch: int) -> np.ndarray:
        """Sample `index` of `epoch`: tokens [index*s, index*s + s + 1) of its stream, int64."""
        order, ends = self.document_order(epoch)
        position, stop = index * self.seq_length, index * self.seq_length + self.seq_length + 1
        k = int(np.searchsorted(ends, position, side="right"))  # the document holding `position`
        parts = []
        while position < stop:
            doc, end = int(order[k]), int(ends[k])
            begin = end - int(self.data.sequence_lengths[doc])
            parts.append(self.data[doc][position - begin:min(stop, end) - begin])
            position, k = min(stop, end), k + 1
        tokens = np.concatenate(parts).astype(np.int64)
        self._check_vocabulary(tokens, index, epoch)
        return tokens

    def _check_vocabulary(self, tokens: np.ndarray, index: int, epoch: int) -> None:
        """A DataError when an id is outside the model's vocabulary (a corpus prepared with another
        tokenizer): named here, with its fix, not as an embedding's bounds check deep in the first
        forward (a device-side assert on a GPU). Per sample, ~4 us for 1,025 ids (timeit, 2-core VM); no pass
        over a multi-GB .bin."""
        vocab = self.vocab_size
        if vocab is None or (tokens.min() >= 0 and tokens.max() < vocab):
            return
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise DataError(f"{self.data.prefix}: sample {index} of epoch {epoch} holds token id {bad}, outside the "
                        f"model's {vocab:,}-id vocabulary: the corpus was prepared with another tokenizer. Fix: "
                        "prepare it again with `repro data prepare --tokenizer gpt2`, or set model.vocab_size to "
                        "its tokenizer's size")

    def at(self, position: int) -> np.ndarray:
        """The sample at a global position (epoch = position // len(self))."""
        epoch, index = self.shuffle.locate(position)
        return self.sample(index, epoch)


def collate_gpt(samples: list[np.ndarray]) -> GPTBatch:
    """Stack samples [b, s + 1] and shift: tokens = [:, :-1], labels = [:, 1:]."""
    stacked = torch.from_numpy(np.stack(samples))
    return GPTBatch(stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous())


def gpt_loader(dataset: GPTDataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
               consumed_samples: int = 0, total_samples: int | None = None,
               workers: int = 0) -> ResumableLoader:
    """Micro batches of GPTBatch for one DP rank, resuming after consumed_samples (all ranks)."""
    return ResumableLoader(dataset.at, collate_gpt, micro_batch_size, dp_rank, dp_size,
                           consumed_samples, total_samples, workers)
